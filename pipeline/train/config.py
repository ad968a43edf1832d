"""Run configuration of the two training stages, as dataclasses loaded by `hylo.pipeline.config`.

    cfg = load_stage_config(2, "configs/demo-smollm2.yaml", ["optim.lr=1e-4"])

Design choices:
* One tree per stage (`Stage1Config`, `Stage2Config`). They share every section except the loss: `ild` for
  stage 1, `teacher` and `kd` for stage 2. Defaults follow the HyLo recipe.
* A YAML file may hold both stages under `stage1:` and `stage2:` over shared sections. The stage's own
  section wins.
* Each section states its fields' ranges once (`@rules`). Rules between sections live in the stage classes,
  the sequence-parallel ones included. All are checked at load, before Ray or torchrun starts.
* The config stays this typed object all the way to the workers.
* `breaking_diff(old, new)` lists the keys whose change breaks a resumed run. Run-time knobs may change.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hylo.pipeline.config import (
    OUTPUT_PATH,
    PATH,
    RELATIVE_NAME,
    ROW_TOKENS,
    SEED,
    ConfigError,
    FieldError,
    RayInitSection,
    Rule,
    above,
    at_least,
    between,
    config_hash,
    deep_merge,
    each,
    from_dict,
    load_config,
    one_of,
    rules,
    to_dict,
)
from hylo.pipeline.data.config import SPLITS
from hylo.pipeline.teacher.config import InProcessSection, OfflineSection, ServeSection, TeacherFaultConfig
from hylo.upcycle.config import ConvertConfig

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

STAGE_KEYS = ("stage1", "stage2")


@dataclass
@rules(dtype=one_of("auto", "float32", "bfloat16"), student=PATH, base=PATH)
class ModelSection:
    # HyLo checkpoint the student starts from (stage 1: the converted model; stage 2: stage 1's output).
    student: str | None = None
    # Stage 1: the frozen base model (HF directory or asset name) whose layers the student imitates.
    base: str | None = None
    # Stage 1 only: when `student` is missing, convert `base` first with these options (mla_layers,
    # kv_lora_rank, qk_rope_head_dim, gdn_num_heads, seed, ...: hylo.upcycle.ConvertConfig, the options
    # of jobs/convert.py), into <run dir>/converted.
    convert: ConvertConfig | None = None
    # auto = bf16 on GPU, fp32 on CPU.
    dtype: str = "auto"
    activation_checkpointing: bool = True


@dataclass
@rules(rows=at_least(1), vocab_size=at_least(2), min_doc_len=at_least(1), max_doc_len=at_least(1))
class SyntheticData:
    """Deterministic random packed rows (tests, benchmarks, smoke runs without prepared data)."""

    rows: int = 64
    vocab_size: int = 256
    min_doc_len: int = 8
    max_doc_len: int = 64

    def __post_init__(self) -> None:
        if self.max_doc_len < self.min_doc_len:
            raise FieldError("max_doc_len", self.max_doc_len, f"must be >= min_doc_len ({self.min_doc_len})")


@dataclass
@rules(source=one_of("parquet", "synthetic"), split=one_of(*SPLITS), seq_len=ROW_TOKENS, path=PATH)
class DataSection:
    # parquet = shards written by the data pipeline (pipeline/data); synthetic = SyntheticData rows.
    source: str = "parquet"
    # Directory of a prepared dataset (holding its manifest).
    path: str | None = None
    # Which split of the prepared data this stage reads (stage 1 reads the 20 % split by default).
    split: str = "stage1"
    # Tokens per packed row (the context length). Parquet rows take theirs from the dataset's manifest
    # (the data job's packing.max_len): leave this unset, or set it as a check (a different number is
    # refused naming both). Synthetic rows need it.
    seq_len: int | None = None
    synthetic: SyntheticData = field(default_factory=SyntheticData)


@dataclass
@rules(lr=between(0, 1e38, lo_open=True, hi_open=True, note="torch's Adam keeps lr in float32, whose largest value is 3.4e38"), min_lr_ratio=between(0, 1), warmup_ratio=between(0, 1, hi_open=True), weight_decay=at_least(0),
       betas=each(between(0, 1, hi_open=True)), eps=above(0), grad_clip=at_least(0))
class OptimSection:
    lr: float = 2e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.01
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if len(self.betas) != 2:
            raise FieldError("betas", self.betas, "must have two entries")


# Micro-batches (one packed row each) a worker may accumulate into one optimiser step. The recipe's global
# batch is 8 rows; 4,096 rows of 64K tokens per worker are 268M tokens per worker per step, hours of compute on
# one GPU before the first update: a larger batch is a typo (or 2^70), refused before Ray starts.
MAX_GRAD_ACCUM = 4096
# The conv width of the linear blocks a conversion gives (HybridConfig's gdn_conv_size; a student checkpoint
# states its own, checked against the rows before Ray starts: pipeline/train/inputs.py).
CONVERTED_CONV_SIZE = 4


def sp_shard_problem(tokens: int, sp: int, conv_size: int, length: str = "", at: str = "") -> str | None:
    """Why `tokens`-long rows cannot be split over a sequence-parallel group of `sp` ranks, else None.

    The rules, written once: the parts are equal, and each holds the conv window the next rank takes from it
    (conv_size - 1 tokens of a linear block; hylo/seq_parallel.py `conv_prefix`). `length` names the row
    length in the first message (`data.seq_len (64)`), `at` heads the second (`data.seq_len=64`)."""
    if sp <= 1:
        return None
    if tokens % sp:
        if not length:
            return f"the {tokens:,}-token rows do not split into {sp} equal parts"
        return f"must divide {length}: each of the {sp} workers of a group takes an equal slice of a row"
    if tokens // sp < max(conv_size - 1, 1):
        return (f"{at + ': ' if at else ''}a {tokens:,}-token row split over {sp} ranks gives shards of "
                f"{tokens // sp} token(s), shorter than the linear blocks' conv window ({conv_size - 1} tokens, "
                f"gdn_conv_size {conv_size} - 1) the next rank takes from each: use fewer ranks per row or longer rows")
    return None


def largest_group(limit: int, *, workers: int | None = None, heads: int | None = None,
                  tokens: Iterable[int] = (), conv_size: int = 1) -> int:
    """The largest sequence-parallel group size up to `limit` that every rule given allows, the advice an error
    gives: it divides `workers` (ray.num_workers: whole groups), divides `heads` (Ulysses gives each rank
    heads / N), and splits every row length in `tokens` (`sp_shard_problem` with the student's `conv_size`).
    1 always does."""
    rows = list(tokens)
    for n in range(max(limit, 1), 1, -1):
        if (workers and workers % n) or (heads and heads % n):
            continue
        if any(sp_shard_problem(t, n, conv_size) for t in rows):
            continue
        return n
    return 1


# How the teacher and stage 1's base split with the row (`train.sequence_parallel_teacher`; hylo/seq_parallel.py
# holds the same tuple, a test checks that they agree).
TEACHER_SPLITS = ("allgather", "ulysses", "whole")
# `train.compile` (pipeline/train/compile.py)
COMPILE_MODES = ("off", "blocks")

# The global batch whatever the number of workers: 4,096 rows per worker x 256 workers.
MAX_GLOBAL_BATCH = MAX_GRAD_ACCUM * 256


@dataclass
@rules(global_batch_sequences=between(1, MAX_GLOBAL_BATCH, note=f"{MAX_GLOBAL_BATCH:,} = {MAX_GRAD_ACCUM:,} packed rows "
                                     f"per worker per optimiser step x 256 workers"), epochs=above(0), max_steps=at_least(1), total_steps=at_least(1),
       seed=SEED, nonfinite_patience=at_least(0), sequence_parallel=at_least(1),
       sequence_parallel_teacher=one_of(*TEACHER_SPLITS), compile=one_of(*COMPILE_MODES))
class TrainSection:
    # Optimiser step = this many packed rows over all workers (grad accumulation fills the rest).
    global_batch_sequences: int = 8
    epochs: float = 1.0
    # Stop early after this many optimiser steps (the schedule still spans the full run).
    max_steps: int | None = None
    # Total optimiser steps for the schedule; None = rows of the split * epochs / global batch.
    total_steps: int | None = None
    seed: int = 0
    # A step whose loss or gradient norm is NaN / inf stops the run (one line naming the step, exit status
    # 2); this many such steps in a row are tolerated first (no checkpoint is written from them). 0 = stop
    # at the first. (pipeline/train/nonfinite.py)
    nonfinite_patience: int = 0
    # Sequence parallelism: this many workers hold one packed row split by tokens (ranks [g*N, (g+1)*N) form
    # group g; each takes an equal contiguous slice, so N divides ray.num_workers and data.seq_len). Data
    # parallelism runs across the groups (ray.num_workers / N of them); ZeRO-3 still shards over every
    # worker. 1 = off. May change on resume (same ray.num_workers). (pipeline/train/README.md)
    sequence_parallel: int = 1
    # How the teacher (stage 2's in-process teacher or Serve pool) and stage 1's base split with the row:
    # "allgather" (each rank runs its own tokens, attention all-gathers the keys and values: any head count),
    # "ulysses" (DeepSpeed's all-to-all by heads: the heads must divide by N), "whole" (every rank runs the
    # whole row and keeps its tokens: N times the FLOPs). docs/sequence-parallel.md compares them.
    sequence_parallel_teacher: str = "allgather"
    # The student's step: "off" (eager) or "blocks" (each decoder block through torch.compile, the kernel calls
    # left between its graphs; rows of any document layout reuse the first row's graphs; a recompile-limit
    # fallback to eager is an error). Off by default: on CPU the step is GEMM-bound and gains little
    # (docs/results.md). Under ZeRO-3 each block is a ZeRO-3 leaf module, gathered whole around its compiled
    # forward (deepspeed_cfg.leaf_blocks). pipeline/train/compile.py, docs/cold-start.md.
    compile: str = "off"


@dataclass
@rules(every_steps=at_least(1), keep=at_least(1), upload_retries=at_least(0), upload_backoff_s=at_least(0),
       preempt_grace_s=at_least(0))
class CheckpointSection:
    every_steps: int = 100
    # Ray keeps this many checkpoints (oldest deleted first); None keeps all.
    keep: int | None = 2
    # Write the consolidated HF-format HyLo checkpoint (<run dir>/model) at the end.
    consolidate: bool = True
    # After a run that finished and consolidated, delete its ZeRO checkpoints (weights + Adam moments:
    # 12 bytes per parameter, 3x the fp32 model); for runs whose output is the consolidated model only.
    delete_after_consolidate: bool = False
    # A checkpoint upload that fails (storage outage, network) is retried this many times, after
    # upload_backoff_s, 2x, 4x ... seconds; then the run fails with one line naming the checkpoint, and
    # `--resume` continues from the newest intact one once the storage is back. 0 = fail at once.
    upload_retries: int = 3
    upload_backoff_s: float = 5.0
    # SIGTERM to the driver (a preemption): the workers finish their step and write a final checkpoint
    # when the last checkpoint took less than this many seconds, else stop without one (the newest
    # intact checkpoint is resumed from). Set it to the platform's notice period minus a margin
    # (GCE spot 30 s, Kubernetes terminationGracePeriodSeconds, AWS spot 120 s).
    preempt_grace_s: float = 25.0


@dataclass
@rules(launcher=one_of("ray", "torchrun"), num_workers=at_least(1), cpus_per_worker=at_least(0),
       resources_per_worker=each(at_least(0)), name=RELATIVE_NAME, max_failures=at_least(-1), storage_path=OUTPUT_PATH,
       kernel_cache=OUTPUT_PATH)
class RaySection(RayInitSection):
    # address, num_cpus: where the job's Ray is (pipeline/ray_init.py).
    # ray = Ray Train TorchTrainer; torchrun = launched by torchrun (tests, debugging).
    launcher: str = "ray"
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    resources_per_worker: dict[str, float] | None = None
    # Root of all runs; a run lives in <storage_path>/<name>. A local path or a URI (s3://bucket/runs).
    storage_path: str = "runs"
    # A relative name below storage_path ("a" or "a/b"): no "..", no absolute path.
    name: str = "run"
    # Worker-group restarts after a failure; -1 = without limit (Ray's FailureConfig).
    max_failures: int = 0
    # Compiled Triton kernels and fla's autotune choices, shared by every worker (pipeline/train/kernel_cache.py):
    # a filesystem path every node sees; "" = <run dir>/kernel_cache, or ~/.cache/hylo/kernel_cache on each node
    # for a run stored at a URI.
    kernel_cache: str = ""

    def __post_init__(self) -> None:
        if self.kernel_cache and _URI.match(self.kernel_cache):
            raise FieldError("kernel_cache", self.kernel_cache, "must be a filesystem path every node sees (Triton "
                             "reads and writes its cache as files), not a URI")


@dataclass
@rules(zero_stage=one_of(0, 1, 2, 3), offload_optimizer=one_of("none", "cpu"), offload_param=one_of("none", "cpu"),
       reduce_bucket_size=at_least(1), stage3_prefetch_bucket_size=at_least(0),
       stage3_param_persistence_threshold=at_least(0))
class DeepSpeedSection:
    zero_stage: int = 3
    # none | cpu: where ZeRO keeps optimiser states / parameters between uses.
    offload_optimizer: str = "none"
    offload_param: str = "none"
    overlap_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    # Parameters smaller than this stay whole on every rank; 0 partitions everything.
    stage3_param_persistence_threshold: int = 0

    def __post_init__(self) -> None:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise FieldError("offload_param", self.offload_param,
                             f"needs deepspeed.zero_stage=3 (only ZeRO-3 partitions the parameters; zero_stage is {self.zero_stage})")


# The optional trackers of `metrics` (pipeline/train/trackers.py): their sections check at load time that the
# package can be imported, so a missing one fails before Ray starts.
EXTRA_HINT = "pip install 'hylo-pipeline[trackers]'"


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_package(module: str, key: str) -> None:
    """ValueError (a ConfigError at load time) when config key `key` needs a package that is missing."""
    if not _importable(module):
        raise ValueError(f"{key} is set but the `{module}` package is not installed: {EXTRA_HINT} "
                         f"(or pip install {module}), or remove {key} from the config")


@dataclass
class WandbSection:
    # W&B project; None = W&B's default (WANDB_PROJECT, else "uncategorized").
    project: str | None = None
    entity: str | None = None
    # online | offline (written under <run dir>/wandb, upload later with `wandb sync`) | disabled
    mode: str = "online"
    # Run name; None = ray.name.
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(f"metrics.wandb.mode={self.mode!r}; allowed: online, offline, disabled")
        require_package("wandb", "metrics.wandb")


@dataclass
class MlflowSection:
    # None = MLflow's default (MLFLOW_TRACKING_URI, else its local store in the working directory).
    tracking_uri: str | None = None
    experiment: str = "hylo"
    # Run name; None = ray.name.
    run_name: str | None = None

    def __post_init__(self) -> None:
        require_package("mlflow", "metrics.mlflow")


@dataclass
@rules(log_every=at_least(1))
class MetricsSection:
    # Print one progress line every this many steps.
    log_every: int = 1
    tensorboard: bool = True
    # Optional trackers, off unless set (pipeline/train/trackers.py; pip install 'hylo-pipeline[trackers]'):
    # wandb: {project, entity, mode: online|offline|disabled, name}; mlflow: {tracking_uri, experiment, run_name}.
    wandb: WandbSection | None = None
    mlflow: MlflowSection | None = None


@dataclass
@rules(kill_at_step=at_least(1), kill_rank=at_least(0), kill_when=one_of("mid_step", "after_checkpoint"),
       kill_target=one_of("worker", "node"))
class FaultSection:
    """Fault injection for the recovery tests: SIGKILL one worker (or its whole Ray node) once, at a chosen step."""

    kill_at_step: int | None = None
    kill_rank: int = 0
    # mid_step: after the backward of the step's first micro-batch (before its engine.step);
    # after_checkpoint: once step's checkpoint has been reported.
    kill_when: str = "mid_step"
    # worker: the worker process; node: the worker's Ray node (its raylet, object store and every
    # process on it), as when a machine vanishes.
    kill_target: str = "worker"


@dataclass
class Stage2FaultSection(FaultSection):
    # A teacher pool replica (teacher.source: serve): TeacherFaultConfig (kill_marker, kill_at_row, kill_target).
    teacher: TeacherFaultConfig = field(default_factory=TeacherFaultConfig)


# What stage 1 may train (ILDSection.trainable), in the order each adds to the one before.
ILD_TRAINABLE = ("mixers", "mixers+mlp", "all")


@dataclass
@rules(output_weight=at_least(0), mixer_weight=at_least(0), trainable=one_of(*ILD_TRAINABLE))
class ILDSection:
    """Stage 1 loss: sum over layers of per-token L2 distances (layer output + mixer output)."""

    # false: mean over tokens of ||x - y||_2 (scale-robust across layers); true: of ||x - y||_2^2.
    squared: bool = False
    output_weight: float = 1.0
    mixer_weight: float = 1.0
    # What trains. all: every parameter of every decoder layer (the new mixer, the MLP and the layer's
    # two RMSNorms), Enhanced-ILD as published; mixers+mlp: the mixers and the MLPs; mixers: the new
    # mixers only (MLA / GDN / Mamba-2), the rest stays the base model's. Embeddings, final norm and
    # LM head are outside the ILD loss (each layer is fed the base model's layer input and compared at
    # its own output), so no setting trains them: they stay the base's until stage 2.
    trainable: str = "all"

    def __post_init__(self) -> None:
        if self.output_weight == 0 and self.mixer_weight == 0:
            raise FieldError("mixer_weight", self.mixer_weight, "output_weight and mixer_weight are both 0: no loss to train on")


class _RegisteredSources:
    """The choices of `teacher.source`: the names in the teacher source registry (pipeline/teacher/sources), read
    when a value is checked, so that importing this module imports no source."""

    @staticmethod
    def _names() -> tuple[str, ...]:
        from hylo.pipeline.teacher.sources import source_names  # lazy: layering (a config loads no source)

        return source_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __len__(self) -> int:
        return len(self._names())


@dataclass
@rules(source=Rule(choices=_RegisteredSources()))  # type: ignore[arg-type]
class TeacherSection(OfflineSection, ServeSection, InProcessSection):
    """Stage 2's `teacher`: the typed sections of the sources (pipeline/teacher/config.py, each named by its source
    as `section`) in one flat mapping, and an instance of each: the keys every source reads (source, k,
    exact_form), then inprocess's (model), serve's (pool, client, start_pool) and offline's (cache_path); the bases
    are listed last first. The source that `source` names checks it and reads it as its own section; the other
    sources' keys keep their values, unread."""

    def __post_init__(self) -> None:
        from hylo.pipeline.teacher.sources import check_section  # lazy: layering

        check_section(self)

    @property
    def form(self) -> str:
        """topk, hidden or logits (`target_form` of pipeline/teacher/sources)."""
        from hylo.pipeline.teacher.sources import target_form  # lazy: layering

        return target_form(self)


# The fused loss's gradient products for bf16/fp16 students (hylo.kernels.fused_kl.gemm.PRECISIONS; a test checks
# that the two lists agree).
KL_PRECISIONS = ("accurate", "fast")


@dataclass
@rules(kl_weight=at_least(0), ce_weight=at_least(0), temperature=above(0), chunk_size=at_least(1),
       kl_precision=one_of(*KL_PRECISIONS))
class KDSection:
    """Stage 2's loss per loss token, kl_weight * KL_T(teacher || student) + ce_weight * CE(next token):
    both terms go through hylo.kernels.fused_kl (fused_linear_kl_div, fused_linear_cross_entropy)."""

    kl_weight: float = 1.0
    ce_weight: float = 0.0
    # T: both the teacher's and the student's logits are divided by T before the softmax (T goes to
    # fused_linear_kl_div unchanged), and the KL term is NOT multiplied by T^2 (Hinton's convention is; the
    # kernel's and F.kl_div's is not): at T = 2 its gradient is about a quarter of T = 1's for soft logits.
    # For Hinton's scaling set kl_weight = T^2. At T = 1 the two agree. The CE term is at T = 1.
    temperature: float = 1.0
    # Tokens per chunk of the fused loss (bounds the [chunk, V] logits it materialises); None = auto.
    chunk_size: int | None = None
    # How the fused KL and CE of a bf16/fp16 student multiply the fp32 logit gradient on tensor cores:
    # fast = rounded once to bf16, one product each (the loss's 3 products: 6 N V H FLOPs); accurate = as a
    # hi + lo pair of bf16 halves, two products each (5 products: +9.3 / +5.4 / +7.5 % of the 1B / 3B / Qwen
    # 64K step). As returned (bf16), fast's gradients are 1.4x as far from fp64 as the final cast alone puts
    # them, accurate's 1.0x; before the cast 2e-3 against 2e-6. The default is the rule's choice (the cheapest
    # mode within 2x of the cast's error: kernels/fused_kl/README.md, "Which mode"; bench/kl_precision.py).
    # Logits, softmax and the weight gradient's accumulation are fp32 in both; an fp32 student ignores it.
    kl_precision: str = "fast"

    def __post_init__(self) -> None:
        if self.kl_weight == 0 and self.ce_weight == 0:
            raise FieldError("ce_weight", self.ce_weight, "kl_weight and ce_weight are both 0: no loss to train on")


@dataclass
class _SharedSections:
    """The sections of both stages (each stage adds its loss; a redeclared section keeps its place)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    ray: RaySection = field(default_factory=RaySection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    fault: FaultSection = field(default_factory=FaultSection)

    def __post_init__(self) -> None:
        """What no single section can check: values that must agree with the number of workers."""
        workers = self.ray.num_workers
        sp = self.train.sequence_parallel
        if workers % sp:
            raise FieldError("train.sequence_parallel", sp,
                             f"must divide ray.num_workers ({workers}): the workers form groups of {sp}")
        # a student converted by this run has the conversion's conv width; a checkpoint's is checked with its rows
        all_mla = self.model.convert is not None and self.model.convert.mla_layers == "all"
        conv = CONVERTED_CONV_SIZE if not self.model.student and not all_mla else 1
        n = self.data.seq_len
        if n is not None and (why := sp_shard_problem(n, sp, conv, f"data.seq_len ({n})", f"data.seq_len={n}")):
            raise FieldError("train.sequence_parallel", sp, why)
        # the data-parallel ranks (one per sequence-parallel group) each read whole rows
        dp = self.data_parallel
        per = "worker" if sp == 1 else f"sequence-parallel group of {sp} workers"
        groups = f"ray.num_workers ({workers})" if sp == 1 else f"ray.num_workers / train.sequence_parallel ({dp})"
        gbs = self.train.global_batch_sequences
        if gbs > MAX_GRAD_ACCUM * dp:
            raise FieldError("train.global_batch_sequences", gbs,
                             f"at most {MAX_GRAD_ACCUM * dp:,} = {MAX_GRAD_ACCUM:,} micro-batches per {per} x "
                             f"{groups}; {gbs:,} / {dp} = {gbs // dp:,} packed rows per "
                             f"{per} per optimiser step")
        if gbs % dp:
            raise FieldError("train.global_batch_sequences", gbs, f"must be a multiple of {groups}")
        if self.fault.kill_rank >= workers:
            raise FieldError("fault.kill_rank", self.fault.kill_rank, f"must be < ray.num_workers ({workers})")

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: one per sequence-parallel group (ray.num_workers / train.sequence_parallel)."""
        return self.ray.num_workers // self.train.sequence_parallel

    @property
    def grad_accum(self) -> int:
        """Micro-batches (one packed row each) per optimiser step on every worker: the global batch over the
        data-parallel ranks (the workers of a sequence-parallel group share their rows; a whole number:
        checked above)."""
        return self.train.global_batch_sequences // self.data_parallel


@dataclass
class Stage1Config(_SharedSections):
    ild: ILDSection = field(default_factory=ILDSection)

    stage = 1


@dataclass
class Stage2Config(_SharedSections):
    data: DataSection = field(default_factory=lambda: DataSection(split="stage2"))
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=4e-5))
    fault: Stage2FaultSection = field(default_factory=Stage2FaultSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    kd: KDSection = field(default_factory=KDSection)

    stage = 2


StageConfig = Stage1Config | Stage2Config
STAGE_CLASSES: dict[int, type] = {1: Stage1Config, 2: Stage2Config}


def load_stage_config(stage: int, path: str | Path | None = None, overrides: list[str] | None = None) -> StageConfig:
    """Load the config of `stage` (1 or 2) from a YAML file (shared sections + optional stageN: section)."""
    if stage not in STAGE_CLASSES:
        raise ConfigError(f"stage must be 1 or 2, got {stage}")

    def own_over_shared(loaded: dict[str, Any], p: Path) -> dict[str, Any]:
        # `stage: N` heads what --print-config prints (and config_stageN.json): it names the stage it was for
        if "stage" in loaded and loaded["stage"] != stage:
            raise ConfigError(f"config file {p}: it says stage: {loaded['stage']!r}, a config for "
                              f"{'stage ' + str(loaded['stage']) if loaded['stage'] in STAGE_CLASSES else 'no stage'}; "
                              f"this is stage {stage} (hylo stage{stage}): drop the key or use the other stage's job",
                              "stage")
        shared = {k: v for k, v in loaded.items() if k not in (*STAGE_KEYS, "stage")}
        own = loaded.get(f"stage{stage}") or {}
        if not isinstance(own, dict):
            raise ConfigError(f"config file {p}: stage{stage} must be a mapping")
        return deep_merge(shared, own)

    return load_config(STAGE_CLASSES[stage], path, overrides, select=own_over_shared,
                       label=f"{path or '<defaults>'} (stage {stage})", line_prefixes=(f"stage{stage}.", ""))


# The keys of stage 1's `ray` section that say where its run, and so the model it writes, lives.
RUN_KEYS = ("ray.storage_path", "ray.name")


def load_conversion_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Stage1Config:
    """The stage-1 conversion a config describes (its `model` section: model.base, model.convert, the shared one
    merged with stage1's; and where stage 1's run lives, `RUN_KEYS`), for a tool that needs the student's shape
    when model.student has no checkpoint. The other sections, and a stage-2 file's own keys (stage, teacher, kd),
    are not read: the stage's own load checks them."""

    def model_only(loaded: dict[str, Any], p: Path) -> dict[str, Any]:
        own = loaded.get("stage1") or {}
        out: dict[str, Any] = {}
        for section, keys in (("model", None), ("ray", [k.split(".", 1)[1] for k in RUN_KEYS])):
            value = loaded.get(section) or {}
            if isinstance(own, dict) and isinstance(value, dict) and isinstance(own.get(section), dict):
                value = deep_merge(value, own[section])
            if isinstance(value, dict) and keys is not None:
                value = {k: v for k, v in value.items() if k in keys}
            if value:
                out[section] = value
        return {"model": {}, **out}

    def wanted(o: str) -> bool:
        key = o.split("=", 1)[0].strip()
        return key.split(".", 1)[0] == "model" or key in RUN_KEYS

    mine = [o for o in overrides or [] if wanted(o)]
    return load_config(Stage1Config, path, mine, select=model_only, label=f"{path or '<defaults>'} (model)",
                       line_prefixes=("stage1.", ""))


def config_to_dict(cfg: StageConfig) -> dict[str, Any]:
    return {"stage": cfg.stage, **to_dict(cfg)}


def config_from_dict(d: dict[str, Any]) -> StageConfig:
    d = dict(d)
    stage = int(d.pop("stage"))
    return from_dict(STAGE_CLASSES[stage], d)


# Keys that may change between a stop and a resume without breaking the run (prefix match).
NON_BREAKING = (
    "ray.address", "ray.num_cpus", "ray.launcher", "ray.max_failures", "ray.storage_path", "ray.cpus_per_worker",
    "ray.resources_per_worker", "ray.use_gpu", "checkpoint.", "metrics.", "fault.",
    "deepspeed.offload_optimizer", "deepspeed.offload_param", "deepspeed.overlap_comm",
    "deepspeed.reduce_bucket_size", "deepspeed.stage3_prefetch_bucket_size", "train.max_steps",
    "train.nonfinite_patience",
    # the same rows in the same steps at any N (the data position is kept in global rows; ZeRO-3 shards over
    # every worker whatever N): a run saved at N = 4 resumes at N = 2 or 1
    "train.sequence_parallel", "train.sequence_parallel_teacher",
    # the same step, eager or through compiled blocks (the same weights and state dict)
    "train.compile",
    # data.seq_len is a check of the rows' length, which the data decides (its fingerprint is checked on resume)
    "data.path", "data.seq_len", "model.student", "model.base", "teacher.model.path", "teacher.model.device",
    "teacher.model.torch_threads", "teacher.model.max_forward_tokens", "teacher.pool.", "teacher.client.max_inflight_rows",
    "teacher.client.timeout_s", "teacher.client.max_retries", "teacher.client.retry_backoff_s", "teacher.start_pool", "teacher.cache_path",
)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _breaking(key: str) -> bool:
    return not any(key == nb or (nb.endswith(".") and key.startswith(nb)) for nb in NON_BREAKING)


def breaking_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Keys (dotted) whose values differ between two config dicts and that break a resumed run."""
    fo, fn = _flatten(old), _flatten(new)
    return [f"{k}: {fo.get(k)!r} -> {fn.get(k)!r}" for k in sorted(set(fo) | set(fn))
            if _breaking(k) and fo.get(k) != fn.get(k)]


def breaking_hash(cfg: StageConfig) -> str:
    """Fingerprint of the keys that must not change across a resume."""
    return config_hash({k: v for k, v in _flatten(config_to_dict(cfg)).items() if _breaking(k)})
