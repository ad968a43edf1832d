"""Teacher configuration: the model, the Serve pool, the client, each source's keys, and the offline top-k cache job.

All sections are plain dataclasses loaded through `hylo.pipeline.config` (YAML + `--set a.b=c`, unknown
keys rejected); each field's range or choices is declared once in its class's `@rules`. Each teacher source
(pipeline/teacher/sources) reads a typed section of its own, here: the keys every source reads (`SourceSection`)
and its own (`InProcessSection`, `ServeSection`, `OfflineSection`). Stage 2's `teacher` section
(`TeacherSection`, pipeline/train/config.py) is all of them in one flat mapping, checked by the source it names.
Defaults are sized for this 2-core CPU machine; on a cluster set `pool.num_gpus: 1` and
`model.device: cuda`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hylo.pipeline.config import (
    NONEMPTY,
    NONEMPTY_PATH,
    OUTPUT_PATH,
    PATH,
    PORT,
    FieldError,
    RayInitSection,
    above,
    at_least,
    between,
    each,
    one_of,
    rules,
)

# float64: for exactness checks on CPU (a split teacher sums in another order than the whole row's)
DTYPES = ("float32", "bfloat16", "float16", "float64")
ISOLATIONS = ("auto", "per_doc", "packed")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_TEACHER = "asset:smollm2-135m-instruct"
TOPK_DTYPES = ("float16", "bfloat16", "float32")
# The exact teacher (k = 0): hidden = its hidden states + lm_head go into the fused KL (in-process; or from the
# pool, the trainer holding the lm_head read from the teacher's checkpoint); logits = its full-vocabulary logits
# streamed chunk by chunk; auto = the source's own choice (hidden in-process; from the pool, hidden where it runs a
# transformers teacher whose lm_head can be read, else logits). Which source gives which: pipeline/teacher/sources.
EXACT_FORMS = ("auto", "hidden", "logits")


# teacher.k: no tokenizer has this many tokens (the largest in use, Gemma's, 262,144); before Ray starts k is also
# checked against the teacher's own vocabulary (stage 2: train/inputs.py; the cache job: teacher/cache.py).
MAX_TOP_K = 1 << 20
TOP_K = between(0, MAX_TOP_K, note="no vocabulary is larger")


def check_cache_k(k: int) -> None:
    """The width of a top-k cache's records (the cache job's and the offline source's): FieldError naming `k`."""
    if k == 0:
        raise FieldError("k", k, "the offline cache holds top-k records: set k to the cache's k (0 is the exact "
                                 "teacher, which a top-k cache cannot give)")


@dataclass
@rules(path=NONEMPTY_PATH, tokenizer=PATH, dtype=one_of(*DTYPES), device=one_of(*DEVICES), isolation=one_of(*ISOLATIONS),
       logits_chunk_tokens=at_least(1), max_forward_tokens=at_least(1), torch_threads=at_least(0))
class TeacherModelConfig:
    # HF causal-LM directory, HyLo checkpoint directory, or "asset:<name>" (hylo.assets).
    path: str = DEFAULT_TEACHER
    dtype: str = "float32"
    device: str = "auto"
    # per_doc: one forward per document (exact, no block mask); packed: one forward per row with
    # restarting positions (flash-attn varlen / HF block mask / HyLo cu_seqlens); auto picks.
    isolation: str = "auto"
    # Tokens per lm_head chunk: no [T, V] logits tensor ever exists, only [chunk, V].
    logits_chunk_tokens: int = 1024
    # Tokens per forward when several documents/rows are batched together in per_doc mode.
    max_forward_tokens: int = 8192
    # torch intra-op threads in this process (0 = leave as is; Serve replicas start with 1).
    torch_threads: int = 0
    # Tokenizer used for the tokenizer hash; None = the model directory.
    tokenizer: str | None = None
    # transformers attention implementation (None = its default, sdpa; flash_attention_2 on GPU
    # makes `packed` isolation run varlen kernels instead of a block mask).
    attn_implementation: str | None = None


@dataclass
@rules(app_name=NONEMPTY, num_replicas=at_least(1), num_cpus=at_least(0), num_gpus=at_least(0),
       max_batch_tokens=at_least(1), batch_wait_timeout_s=at_least(0), max_ongoing_requests=at_least(1),
       stream_sessions=at_least(1), host=NONEMPTY, port=PORT, resources=each(at_least(0)))
class TeacherPoolConfig:
    app_name: str = "teacher"
    num_replicas: int = 1
    # Per replica: a whole GPU on a cluster; a fraction of a CPU core here.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Custom Ray resources per replica, e.g. {teacher_node: 1} to keep the replicas on the nodes that
    # declare that resource (`ray start --resources='{"teacher_node": 1}'`), apart from the train workers.
    resources: dict[str, float] | None = None
    # Token budget of one batched forward (serve.batch size function = tokens, not requests).
    max_batch_tokens: int = 8192
    batch_wait_timeout_s: float = 0.02
    max_ongoing_requests: int = 16
    # Hidden states kept per replica for windowed `stream` requests of the same row.
    stream_sessions: int = 2
    # The HTTP proxy's address (it only answers `GET /<app_name>` with the teacher's identity). port: null =
    # a free port chosen when the pool starts (printed); a port you set must be free, or the run stops at once
    # naming teacher.pool.port.
    host: str = "127.0.0.1"
    port: int | None = None


def pool_port_taken(host: str, port: int, why: str) -> str:
    """The one line of a `teacher.pool.port` the pool's HTTP proxy cannot listen on (sources/serve.py's check
    before Ray starts, and serve.start_teacher_pool's after)."""
    return (f"teacher.pool.port={port}: the teacher pool's HTTP proxy cannot listen on {host}:{port} ({why}); "
            f"choose a free port, or leave teacher.pool.port unset (null) to have one chosen")


@dataclass
@rules(kill_at_row=at_least(1), kill_target=one_of("process", "node"))
class TeacherFaultConfig:
    """Fault injection for the teacher pool's recovery tests (stage 2's `fault.teacher`): while the file
    `kill_marker` exists, a replica counts the rows it receives and on the `kill_at_row`-th one deletes the
    file (so exactly one replica dies per arming) and ends its process, or its whole Ray node."""

    kill_marker: str = ""
    kill_at_row: int = 1
    # process: the replica's process; node: its Ray node (raylet and all), as when a machine vanishes.
    kill_target: str = "process"


@dataclass
@rules(dtype=one_of(*TOPK_DTYPES), max_inflight_rows=at_least(1), timeout_s=above(0), max_retries=at_least(0),
       retry_backoff_s=at_least(0), window_chunks=at_least(1))
class TeacherClientConfig:
    # (The width is teacher.k.) Dtype of the top-k log-probabilities on the wire (indices int32, tail fp32).
    dtype: str = "float16"
    max_inflight_rows: int = 4
    timeout_s: float = 600.0
    # A row whose replica died (or timed out, or was unavailable) is sent again, to a live replica, up to
    # max_retries times, after retry_backoff_s, 2x, 4x ... seconds; size it to ride out a replica that
    # Serve restarts elsewhere (with one replica, a lost node stalls the step until the new one is up).
    max_retries: int = 3
    retry_backoff_s: float = 0.2
    # The exact teacher from the pool (teacher.k: 0): logits chunks (of teacher.model.logits_chunk_tokens
    # tokens) per window request (bounds what is in flight).
    window_chunks: int = 4


# ------------------------------------------------------------------ the keys each teacher source reads
@dataclass
@rules(k=TOP_K, exact_form=one_of(*EXACT_FORMS))
class SourceSection:
    """The keys of stage 2's `teacher` section that every source reads (`source`'s choices: stage 2's section)."""

    # Where the targets come from: a source of pipeline/teacher/sources. inprocess: a (small) teacher on every
    # worker; serve: the Ray Serve pool; offline: a top-k cache.
    source: str = "inprocess"
    # Width of the teacher's targets: k > 0 = its top-k log-probabilities plus the tail mass; 0 = exact, the
    # full vocabulary (inprocess or serve; offline needs the cache's k).
    k: int = 0
    # How the exact teacher (k: 0) reaches the fused KL: hidden (its hidden states + lm_head; from the pool, the
    # trainer reads the lm_head from teacher.model.path), logits (full-vocabulary logits streamed chunk by chunk),
    # auto (hidden inprocess; from the pool, hidden where its transformers teacher's lm_head can be read).
    exact_form: str = "auto"


@dataclass
class InProcessSection(SourceSection):
    """`teacher.source: inprocess` (sources/inprocess.py)."""

    # The teacher model, loaded on every training worker.
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)


@dataclass
class ServeSection(SourceSection):
    """`teacher.source: serve` (sources/serve.py)."""

    # The teacher model the driver deploys when start_pool is true; its logits_chunk_tokens is the size of the
    # logits chunks the client asks for (k: 0).
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    # The pool (app name, replicas, resources) and the client (retries, in-flight rows).
    pool: TeacherPoolConfig = field(default_factory=TeacherPoolConfig)
    client: TeacherClientConfig = field(default_factory=TeacherClientConfig)
    # The driver deploys the pool before training (and shuts it down after); false = attach
    # to a pool someone else runs under pool.app_name.
    start_pool: bool = True


@dataclass
@rules(cache_path=PATH)
class OfflineSection(SourceSection):
    """`teacher.source: offline` (sources/offline.py)."""

    # Directory of the top-k cache written by the teacher's cache job.
    cache_path: str | None = None


# ------------------------------------------------------------------ the cache job
@dataclass
@rules(k=TOP_K)
class CacheTeacherSection:
    """The teacher of the cache job, spelled as stage 2's `teacher` section spells it."""

    # Top-k width of the records the cache holds (stage 2's teacher.k must be the same).
    k: int = 64
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)

    def __post_init__(self) -> None:
        check_cache_k(self.k)


@dataclass
@rules(dtype=one_of(*TOPK_DTYPES), rows_per_shard=at_least(1), num_actors=at_least(1), cpus_per_actor=at_least(0),
       gpus_per_actor=at_least(0), max_new_shards=at_least(0), data=PATH, out=OUTPUT_PATH)
class TeacherCacheConfig:
    # Directory of Parquet shards of packed rows (input_ids, position_ids, cu_seqlens, ...).
    data: str = ""
    out: str = ""
    # Dtype of the stored top-k log-probabilities (indices uint16/int32, tail fp32).
    dtype: str = "float16"
    # Rows per output shard: the unit of work, of atomic writes and of resume.
    rows_per_shard: int = 16
    # Ray Data actor pool: actors, and resources of each (each holds one teacher).
    num_actors: int = 1
    cpus_per_actor: float = 1.0
    gpus_per_actor: float = 0.0
    # Stop after this many new shards (0 = all); a smoke run or a planned partial run.
    max_new_shards: int = 0
    # The job's Ray (pipeline/ray_init.py): an address, else $RAY_ADDRESS, else a local Ray.
    ray: RayInitSection = field(default_factory=RayInitSection)
    teacher: CacheTeacherSection = field(default_factory=CacheTeacherSection)
