"""Run configuration of the two training stages, as dataclasses loaded by `pipeline.config`.

    cfg = load_config(Stage2Config, "configs/demo-smollm2.yaml", ["optim.lr=1e-4"])

Design choices:
* One tree per stage (`Stage1Config`, `Stage2Config`) sharing every section except the loss:
  `ild` for stage 1 (Enhanced-ILD), `teacher` + `kd` for stage 2. Defaults follow design.md §1
  (stage 1: context 2,048, lr 2e-4, the 20 % split; stage 2: context 65,536, lr 4e-5, global batch 8
  sequences, 1 epoch, warm-up ratio 0.01, kl_weight 1, ce_weight 0).
* A YAML file may hold both stages under `stage1:` / `stage2:` keys plus shared top-level sections;
  `load_stage_config` merges them (stage section wins) so one recipe file describes a whole run.
* `breaking_diff(old, new)` lists the keys whose change breaks a resumed run (model, data, optimiser,
  batch, world size, seed ...); run-time knobs (Ray address, checkpoint cadence, metrics, fault
  injection, offload) may change between a stop and a resume.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import ConfigError, config_hash, from_dict, parse_override, to_dict
from pipeline.teacher.config import TeacherClientConfig, TeacherModelConfig, TeacherPoolConfig
from pipeline.train.trackers import MlflowSection, WandbSection

STAGE_KEYS = ("stage1", "stage2")


@dataclass
class ModelSection:
    # HyLo checkpoint the student starts from (stage 1: the converted model; stage 2: stage 1's output).
    student: str | None = None
    # Stage 1: the frozen base model (HF directory or asset name) whose layers the student imitates.
    base: str | None = None
    # Stage 1 only: when `student` is missing, convert `base` first with these `hylo.upcycle` options
    # (mla_layers, kv_lora_rank, qk_rope_head_dim, gdn_num_heads, ...), into <run dir>/converted.
    convert: dict[str, Any] | None = None
    # auto = bf16 on GPU, fp32 on CPU.
    dtype: str = "auto"
    activation_checkpointing: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"model.dtype={self.dtype!r}; allowed: auto, float32, bfloat16")


@dataclass
class SyntheticData:
    """Deterministic random packed rows (tests, benchmarks, smoke runs without prepared data)."""

    rows: int = 64
    vocab_size: int = 256
    min_doc_len: int = 8
    max_doc_len: int = 64


@dataclass
class DataSection:
    # parquet = shards written by the data pipeline (pipeline/data); synthetic = SyntheticData rows.
    source: str = "parquet"
    # Directory of a prepared dataset (holding its manifest).
    path: str | None = None
    # Which split of the prepared data this stage reads (stage 1 reads the 20 % split by default).
    split: str = "stage1"
    # Tokens per packed row (the context length); must match the prepared data.
    seq_len: int = 2048
    synthetic: SyntheticData = field(default_factory=SyntheticData)

    def __post_init__(self) -> None:
        if self.source not in ("parquet", "synthetic"):
            raise ValueError(f"data.source={self.source!r}; allowed: parquet, synthetic")
        if self.seq_len <= 1:
            raise ValueError(f"data.seq_len must be > 1, got {self.seq_len}")


@dataclass
class OptimSection:
    lr: float = 2e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.01
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas must have two entries, got {self.betas}")


@dataclass
class TrainSection:
    # Optimiser step = this many packed rows over all workers (grad accumulation fills the rest).
    global_batch_sequences: int = 8
    epochs: float = 1.0
    # Stop early after this many optimiser steps (the schedule still spans the full run).
    max_steps: int | None = None
    # Total optimiser steps for the schedule; None = rows of the split * epochs / global batch.
    total_steps: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.global_batch_sequences <= 0:
            raise ValueError(f"train.global_batch_sequences must be > 0, got {self.global_batch_sequences}")


@dataclass
class CheckpointSection:
    every_steps: int = 100
    # Ray keeps this many checkpoints (oldest deleted first); None keeps all.
    keep: int | None = 2
    # Write the consolidated HF-format HyLo checkpoint (<run dir>/model) at the end.
    consolidate: bool = True
    # After a run that finished and consolidated, delete its ZeRO checkpoints (weights + Adam moments:
    # 12 bytes per parameter, 3x the fp32 model); for runs whose output is the consolidated model only.
    delete_after_consolidate: bool = False


@dataclass
class RaySection:
    # None = start a local Ray; "auto" or ray://... = the cluster a job runs on.
    address: str | None = None
    # ray = Ray Train TorchTrainer; torchrun = launched by torchrun (tests, debugging).
    launcher: str = "ray"
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    resources_per_worker: dict[str, float] | None = None
    # Root of all runs; a run lives in <storage_path>/<name>.
    storage_path: str = "runs"
    name: str = "run"
    max_failures: int = 0

    def __post_init__(self) -> None:
        if self.launcher not in ("ray", "torchrun"):
            raise ValueError(f"ray.launcher={self.launcher!r}; allowed: ray, torchrun")
        if self.num_workers <= 0:
            raise ValueError(f"ray.num_workers must be > 0, got {self.num_workers}")


@dataclass
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
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage={self.zero_stage}; allowed: 0, 1, 2, 3")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) not in ("none", "cpu"):
                raise ValueError(f"deepspeed.{key}={getattr(self, key)!r}; allowed: none, cpu")


@dataclass
class MetricsSection:
    # Print one progress line every this many steps.
    log_every: int = 1
    tensorboard: bool = True
    # Optional trackers, off unless set (pipeline/train/trackers.py; pip install 'hylo-pipeline[trackers]'):
    # wandb: {project, entity, mode: online|offline|disabled, name}; mlflow: {tracking_uri, experiment, run_name}.
    wandb: WandbSection | None = None
    mlflow: MlflowSection | None = None


@dataclass
class FaultSection:
    """Fault injection for the recovery tests: SIGKILL one worker once, at a chosen step."""

    kill_at_step: int | None = None
    kill_rank: int = 0
    # mid_step: after the forward of the step's first micro-batch; after_checkpoint: once step's
    # checkpoint has been reported.
    kill_when: str = "mid_step"

    def __post_init__(self) -> None:
        if self.kill_when not in ("mid_step", "after_checkpoint"):
            raise ValueError(f"fault.kill_when={self.kill_when!r}; allowed: mid_step, after_checkpoint")


@dataclass
class ILDSection:
    """Stage 1 loss: sum over layers of per-token L2 distances (layer output + mixer output)."""

    # false: mean over tokens of ||x - y||_2 (scale-robust across layers); true: of ||x - y||_2^2.
    squared: bool = False
    output_weight: float = 1.0
    mixer_weight: float = 1.0
    # Also train the MLPs (copied from the base); the new mixers are always trained.
    train_mlp: bool = False


@dataclass
class TeacherSection:
    # inprocess: a (small) teacher on every worker; serve: the Ray Serve pool; offline: top-k cache.
    source: str = "inprocess"
    # inprocess: 0 = exact (the teacher's hidden states + lm_head go into the fused KL), k > 0 = top-k.
    # serve: the pool answers top-k (client.k) or streams full logits (mode stream).
    top_k: int = 0
    # serve: topk | stream.
    mode: str = "topk"
    # The teacher model (inprocess), or what the driver deploys when start_pool is true.
    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    # serve: the pool (app name, replicas, resources) and the client (k, retries, in-flight rows).
    pool: TeacherPoolConfig = field(default_factory=TeacherPoolConfig)
    client: TeacherClientConfig = field(default_factory=TeacherClientConfig)
    # serve: the driver deploys the pool before training (and shuts it down after); false = attach
    # to a pool someone else runs under pool.app_name.
    start_pool: bool = True
    # offline: directory of the top-k cache written by the teacher's cache job.
    cache_path: str | None = None

    def __post_init__(self) -> None:
        if self.source not in ("inprocess", "serve", "offline"):
            raise ValueError(f"teacher.source={self.source!r}; allowed: inprocess, serve, offline")
        if self.mode not in ("topk", "stream"):
            raise ValueError(f"teacher.mode={self.mode!r}; allowed: topk, stream")
        if self.top_k < 0:
            raise ValueError(f"teacher.top_k must be >= 0, got {self.top_k}")
        if self.source == "offline" and not self.cache_path:
            raise ValueError("teacher.source=offline needs teacher.cache_path")


@dataclass
class KDSection:
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    # Tokens per chunk of the fused loss (bounds the [chunk, V] logits it materialises); None = auto.
    chunk_size: int | None = None


@dataclass
class Stage1Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    ray: RaySection = field(default_factory=RaySection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    fault: FaultSection = field(default_factory=FaultSection)
    ild: ILDSection = field(default_factory=ILDSection)

    stage = 1


@dataclass
class Stage2Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=lambda: DataSection(split="stage2", seq_len=65536))
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=4e-5))
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    ray: RaySection = field(default_factory=RaySection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    fault: FaultSection = field(default_factory=FaultSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    kd: KDSection = field(default_factory=KDSection)

    stage = 2


StageConfig = Stage1Config | Stage2Config
STAGE_CLASSES: dict[int, type] = {1: Stage1Config, 2: Stage2Config}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def load_stage_config(stage: int, path: str | Path | None = None, overrides: list[str] | None = None) -> StageConfig:
    """Load the config of `stage` (1 or 2) from a YAML file (shared sections + optional stageN: section)."""
    if stage not in STAGE_CLASSES:
        raise ConfigError(f"stage must be 1 or 2, got {stage}")
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        shared = {k: v for k, v in loaded.items() if k not in STAGE_KEYS}
        own = loaded.get(f"stage{stage}") or {}
        if not isinstance(own, dict):
            raise ConfigError(f"config file {p}: stage{stage} must be a mapping")
        tree = _deep_merge(shared, own)
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set_dotted(tree, key, value)
    try:
        return from_dict(STAGE_CLASSES[stage], tree)
    except ConfigError as e:
        raise ConfigError(f"{path or '<defaults>'} (stage {stage}): {e}") from None


def config_to_dict(cfg: StageConfig) -> dict[str, Any]:
    return {"stage": cfg.stage, **to_dict(cfg)}


def config_from_dict(d: dict[str, Any]) -> StageConfig:
    d = dict(d)
    stage = int(d.pop("stage"))
    return from_dict(STAGE_CLASSES[stage], d)


# Keys that may change between a stop and a resume without breaking the run (prefix match).
NON_BREAKING = (
    "ray.address", "ray.launcher", "ray.max_failures", "ray.storage_path", "ray.cpus_per_worker",
    "ray.resources_per_worker", "ray.use_gpu", "checkpoint.", "metrics.", "fault.",
    "deepspeed.offload_optimizer", "deepspeed.offload_param", "deepspeed.overlap_comm",
    "deepspeed.reduce_bucket_size", "deepspeed.stage3_prefetch_bucket_size", "train.max_steps",
    "data.path", "model.student", "model.base", "teacher.model.path", "teacher.model.device",
    "teacher.model.torch_threads", "teacher.model.max_forward_tokens", "teacher.pool.", "teacher.client.max_inflight_rows",
    "teacher.client.timeout_s", "teacher.client.max_retries", "teacher.start_pool", "teacher.cache_path",
)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k != "convert":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def breaking_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Keys (dotted) whose values differ between two config dicts and that break a resumed run."""
    fo, fn = _flatten(old), _flatten(new)
    keys = sorted(set(fo) | set(fn))
    diffs = []
    for k in keys:
        if any(k == nb or (nb.endswith(".") and k.startswith(nb)) for nb in NON_BREAKING):
            continue
        if fo.get(k) != fn.get(k):
            diffs.append(f"{k}: {fo.get(k)!r} -> {fn.get(k)!r}")
    return diffs


def breaking_hash(cfg: StageConfig) -> str:
    """Fingerprint of the keys that must not change across a resume."""
    flat = _flatten(config_to_dict(cfg))
    kept = {k: v for k, v in flat.items()
            if not any(k == nb or (nb.endswith(".") and k.startswith(nb)) for nb in NON_BREAKING)}
    return config_hash(kept)


def run_dir(cfg: StageConfig) -> Path:
    return Path(cfg.ray.storage_path).expanduser().resolve() / cfg.ray.name
