"""Configuration of jobs/eval.py (dataclasses for `pipeline.config.load_config`).

Defaults are the real-run sizes (retrieval 1K..64K, KV cache at 8K/16K/32K); `configs/eval_smoke.yaml`
or `--set` overrides shrink them for a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUITES = ("kl", "retrieval", "kvcache", "lm_eval")


def _positive_list(name: str, values: list[int]) -> None:
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive integers, got {values}")


@dataclass
class ModelsSection:
    # The model under evaluation: HyLo or HF checkpoint directory, or an asset name.
    path: str | None = None
    # Teacher for KL (HF or HyLo directory); None = perplexity only.
    teacher: str | None = None
    # Base (HF) model for the KV-cache and retrieval comparison; None = the model alone.
    base: str | None = None
    # Tokenizer directory; None = the model's own directory.
    tokenizer: str | None = None
    dtype: str = "float32"
    # auto = cuda when available, else cpu.
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"models.dtype={self.dtype!r}; allowed: float32, bfloat16, float16")


@dataclass
class KLSection:
    # Packed-data directory, Parquet rows, or JSON/JSONL chat records.
    data: str | None = None
    max_rows: int | None = 32
    # Use kernels.fused_kl.fused_linear_kl_div when importable (else exact chunked fp32).
    use_fused: bool = True
    chunk_tokens: int = 1024
    # File keeping the teacher's hidden states per row: a later evaluation against the same teacher
    # and rows skips the teacher's forward (None = off).
    teacher_cache: str | None = None
    # Chat records that cannot be read or rendered: "report" (counted and listed in the results,
    # then skipped) or "fail" (the job stops with the record's error).
    on_bad_record: str = "report"

    def __post_init__(self) -> None:
        if self.on_bad_record not in ("report", "fail"):
            raise ValueError(f"kl.on_bad_record={self.on_bad_record!r}; allowed: report, fail")


@dataclass
class RetrievalSection:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536])
    samples_per_length: int = 8
    tasks: list[str] = field(default_factory=lambda: ["niah_single", "niah_multikey"])
    max_new_tokens: int = 12
    # auto | chat | plain
    prompt_format: str = "auto"
    multikey_needles: int = 4

    def __post_init__(self) -> None:
        _positive_list("retrieval.lengths", self.lengths)


@dataclass
class KVCacheSection:
    lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    decode_tokens: int = 32

    def __post_init__(self) -> None:
        _positive_list("kvcache.lengths", self.lengths)


@dataclass
class LMEvalSection:
    # The published 0-shot suite; runs where the harness can fetch the datasets (a hub or its cache).
    tasks: list[str] = field(default_factory=lambda: [
        "arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "race", "winogrande", "gsm8k"])
    num_fewshot: int = 0
    # Examples per task (None = all); a fraction < 1 is a share of each task.
    limit: float | None = None
    # Extra task YAML directory (local tasks).
    include_path: str | None = None
    max_length: int | None = None


@dataclass
class EvalConfig:
    models: ModelsSection = field(default_factory=ModelsSection)
    suites: list[str] = field(default_factory=lambda: ["kl", "retrieval", "kvcache"])
    out: str = "runs/eval"
    seed: int = 0
    # torch CPU threads (0 = torch's default).
    threads: int = 0
    kl: KLSection = field(default_factory=KLSection)
    retrieval: RetrievalSection = field(default_factory=RetrievalSection)
    kvcache: KVCacheSection = field(default_factory=KVCacheSection)
    lm_eval: LMEvalSection = field(default_factory=LMEvalSection)

    def __post_init__(self) -> None:
        bad = [s for s in self.suites if s not in SUITES]
        if bad:
            raise ValueError(f"suites: unknown {bad}; allowed: {', '.join(SUITES)}")
