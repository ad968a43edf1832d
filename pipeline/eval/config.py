"""Configuration of jobs/eval.py (dataclasses for `hylo.pipeline.config.load_config`).

Defaults are the real-run sizes (retrieval 1K..64K, KV cache at 8K/16K/32K); `configs/eval_smoke.yaml`
or `--set` overrides shrink them for a CPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from hylo.pipeline.config import (
    NONEMPTY,
    OUTPUT_PATH,
    PATH,
    SEED,
    ConfigError,
    Rule,
    above,
    at_least,
    each,
    one_of,
    rules,
)

SUITES = ("kl", "retrieval", "kvcache", "lm_eval", "samples")
# hylo.pipeline.eval.retrieval.TASKS (not imported: that module needs torch; a test keeps the two equal).
RETRIEVAL_TASKS = ("niah_single", "niah_multikey")


@dataclass
@rules(dtype=one_of("float32", "bfloat16", "float16"),
       device=Rule(pattern=r"auto|cpu|cuda(:\d+)?", pattern_text="auto, cpu, cuda or cuda:N"),
       path=PATH, teacher=PATH, base=PATH, tokenizer=PATH)
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


@dataclass
@rules(max_rows=at_least(1), chunk_tokens=at_least(1), on_bad_record=one_of("report", "fail"), data=PATH,
       teacher_cache=PATH)
class KLSection:
    # Packed-data directory, Parquet rows, or JSON/JSONL chat records.
    data: str | None = None
    max_rows: int | None = 32
    # The KL and NLL's fastest path (hylo.kernels.fused_kl: Triton on a GPU); false = their pure-torch
    # path (exact chunked fp32) everywhere.
    use_fused: bool = True
    chunk_tokens: int = 1024
    # File keeping the teacher's hidden states per row: a later evaluation against the same teacher
    # and rows skips the teacher's forward (None = off).
    teacher_cache: str | None = None
    # Chat records that cannot be read or rendered: "report" (counted and listed in the results,
    # then skipped) or "fail" (the job stops with the record's error).
    on_bad_record: str = "report"


@dataclass
@rules(lengths=each(at_least(1), nonempty=True), samples_per_length=at_least(1), tasks=each(one_of(*RETRIEVAL_TASKS), nonempty=True),
       max_new_tokens=at_least(1), prompt_format=one_of("auto", "chat", "plain"), multikey_needles=at_least(1))
class RetrievalSection:
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536])
    samples_per_length: int = 8
    tasks: list[str] = field(default_factory=lambda: ["niah_single", "niah_multikey"])
    max_new_tokens: int = 12
    # auto | chat | plain
    prompt_format: str = "auto"
    multikey_needles: int = 4


@dataclass
@rules(lengths=each(at_least(1), nonempty=True), decode_tokens=at_least(1))
class KVCacheSection:
    lengths: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    decode_tokens: int = 32


@dataclass
@rules(model=one_of("hylo", "hf"), tasks=each(NONEMPTY, nonempty=True), num_fewshot=at_least(0),
       fewshot_per_task=each(at_least(0)), batch_size=at_least(1), limit=above(0), max_length=at_least(1),
       bootstrap_iters=at_least(0), include_path=PATH, output_path=OUTPUT_PATH)
class LMEvalSection:
    # hylo: this project's lm-eval model (packed scoring, the already loaded model); hf: lm-eval's own
    # HF backend, loading the checkpoint with trust_remote_code (its model code is saved beside it).
    model: str = "hylo"
    # The published suite; runs where the harness can fetch the datasets (a hub or its cache).
    tasks: list[str] = field(default_factory=lambda: [
        "arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "race", "winogrande", "gsm8k"])
    # Few-shot examples for every task; None = each task's own default (0 for most, 5 for gsm8k).
    num_fewshot: int | None = None
    # Per-task few-shot counts, over num_fewshot (e.g. {gsm8k: 8}).
    fewshot_per_task: dict[str, int] = field(default_factory=dict)
    # Prompts per generate() call (generation tasks); loglikelihood requests are packed by tokens.
    batch_size: int = 8
    # Examples per task (None = all); a fraction < 1 is a share of each task.
    limit: float | None = None
    # Extra task YAML directory (local tasks).
    include_path: str | None = None
    # Index lm-eval's own tasks too (false: only include_path's; skips a ~15 s scan of its task YAMLs).
    include_defaults: bool = True
    max_length: int | None = None
    # Write every prompt / response / score beside the results (samples_<task>_*.jsonl).
    log_samples: bool = False
    # Where the harness writes its results (and samples); None = <out>/lm_eval.
    output_path: str | None = None
    # Render prompts with the tokenizer's chat template (instruct models); few-shot examples as turns.
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = True
    system_instruction: str | None = None
    # Task metadata, e.g. RULER's {max_seq_lengths: [4096, 8192]}; `pretrained` (the model path) is added.
    metadata: dict[str, Any] = field(default_factory=dict)
    # Bootstrap resamples for standard errors (0 = none).
    bootstrap_iters: int = 100000


@dataclass
@rules(prompts=each(NONEMPTY, nonempty=True), max_new_tokens=at_least(1))
class SamplesSection:
    # Fixed prompts answered greedily by the model (and the base, when given); pipeline/eval/samples.py.
    prompts: list[str] = field(default_factory=lambda: [
        "What is the capital of France?", "Name three primary colors.",
        "Write a Python function that returns the square of a number."])
    max_new_tokens: int = 32
    # Render each prompt as a user turn with the tokenizer's chat template (when it has one).
    chat_template: bool = True
    # Also answer with the base model, when one is loaded (models.base).
    base: bool = True


@dataclass
@rules(suites=each(one_of(*SUITES), nonempty=True), seed=SEED, threads=at_least(0), out=OUTPUT_PATH)
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
    samples: SamplesSection = field(default_factory=SamplesSection)
    # Record the results in the evaluated checkpoint's model card (README.md / hylo_card.json).
    update_card: bool = False

    def check_inputs(self) -> None:
        """What the chosen suites need and the config lacks, before any model is loaded (a ConfigError)."""
        if not self.models.path:
            raise ConfigError("no model to evaluate: pass --model DIR (models.path)", "models.path")
        if "lm_eval" in self.suites:
            if importlib.util.find_spec("lm_eval") is None:
                raise ConfigError("suite 'lm_eval' needs lm-evaluation-harness, which is not installed: pip install "
                                  "'hylo-pipeline[eval]' (or pip install lm-eval)", "suites")
        if "kl" in self.suites and not self.kl.data:
            raise ConfigError(f"suite 'kl' needs --data DIR (kl.data: held-out rows, a packed-data directory, Parquet "
                              f"rows or JSON/JSONL chat records), or leave kl out of --suite (now "
                              f"{','.join(self.suites)})", "kl.data")
