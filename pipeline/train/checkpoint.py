"""Training checkpoints (ZeRO shards + our state), resume checks, and the final HF-format consolidation.

A checkpoint is one directory `<run dir>/step_<NNNNNNNN>/`:

    zero/state/...                       DeepSpeed's files: each rank's ZeRO-3 partition of parameters
                                         and optimiser state (+ rank 0's `latest`), written by
                                         `engine.save_checkpoint`
    trainer_state.json                   rank 0: step, config (whole) + breaking-key hash, world size,
                                         scheduler state (checked against DeepSpeed's on load), data
                                         fingerprint, metrics of the step
    ranks/rank_<r>.json                  each rank: its exact data position and Python RNG state
    ranks/rank_<r>.rng.safetensors       each rank: torch / CUDA / numpy RNG states

Design choices:
* Our own state is JSON + safetensors, written atomically (temp file + rename); a checkpoint directory
  counts only once `trainer_state.json` and every rank's JSON exist (`is_complete`). Under Ray each
  worker writes into its own scratch directory and Ray merges them into storage after all workers
  reported; under torchrun the ranks write into `.tmp-step_N` and rank 0 renames it when all are done.
* DeepSpeed's shard files are pickles (torch.save). They are only ever read back from a run directory
  this code wrote; nothing else is unpickled.
* Resume refuses, with the list of keys, a config whose breaking keys changed (model, data, optimiser,
  schedule, batch, world size ...; see `config.NON_BREAKING` for what may change).
* Consolidation gathers ZeRO-3 partitions one module at a time (bounded extra memory) into a CPU
  state dict on rank 0, loads it into a fresh `HyLoForCausalLM` and saves it with `hylo.io.save_hylo`
  (safetensors + config.json + hybrid_config.json, atomic directory rename).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import ConfigError
from pipeline.train.config import StageConfig, breaking_diff, breaking_hash, config_to_dict

STEP_DIR = re.compile(r"^step_(\d{8})$")
ZERO_DIR = "zero"
ZERO_TAG = "state"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the file and the reason."""


# ------------------------------------------------------------------------------------ atomic files
def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


# ------------------------------------------------------------------------------------ RNG
def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able part, tensor part) of every RNG a worker uses."""
    py = random.getstate()
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_key": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    meta = {"python": [py[0], list(py[1]), py[2]], "numpy": [np_state[0], int(np_state[2]), int(np_state[3]),
                                                           float(np_state[4])]}
    return meta, tensors


def restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    v, st, gauss = meta["python"]
    random.setstate((v, tuple(st), gauss))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["numpy_key"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# ------------------------------------------------------------------------------------ layout
def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(ckpt: Path) -> bool:
    """True when rank 0's state and every rank's state are present."""
    ckpt = Path(ckpt)
    state = ckpt / STATE_FILE
    if not state.is_file():
        return False
    try:
        world = int(json.loads(state.read_text())["world_size"])
    except (ValueError, KeyError, json.JSONDecodeError):
        return False
    return all((ckpt / "ranks" / f"rank_{r}.json").is_file() for r in range(world))


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = []
    for p in run_dir.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def checkpoint_step(ckpt: Path) -> int:
    return int(read_json(Path(ckpt) / STATE_FILE)["step"])


# ------------------------------------------------------------------------------------ save / load
def save_checkpoint(engine, ckpt: Path, rank: int, world_size: int, step: int, cfg: StageConfig,
                    rank_state: dict[str, Any], global_state: dict[str, Any]) -> None:
    """Collective: every rank writes its ZeRO partition and its own state into `ckpt`."""
    ckpt = Path(ckpt)
    (ckpt / ZERO_DIR).mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(ckpt / ZERO_DIR), tag=ZERO_TAG, save_latest=(rank == 0))
    meta, tensors = capture_rng()
    save_tensors_atomic(ckpt / "ranks" / f"rank_{rank}.rng.safetensors", tensors)
    write_json_atomic(ckpt / "ranks" / f"rank_{rank}.json", {"step": step, "rank": rank, **rank_state, "rng": meta})
    if rank == 0:
        sched = engine.lr_scheduler
        write_json_atomic(ckpt / STATE_FILE, {
            "format_version": FORMAT_VERSION, "stage": cfg.stage, "step": step, "world_size": world_size,
            "config": config_to_dict(cfg), "breaking_hash": breaking_hash(cfg),
            "scheduler": {"last_epoch": sched.last_epoch, "base_lrs": sched.base_lrs, "last_lr": sched.get_last_lr()},
            **global_state,
        })


def check_compatible(ckpt: Path, cfg: StageConfig, world_size: int, data_fingerprint: str | None = None) -> dict[str, Any]:
    """Read rank 0's state and refuse a resume that would silently break the run."""
    state = read_json(Path(ckpt) / STATE_FILE)
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}/{STATE_FILE}: format_version {state.get('format_version')} != {FORMAT_VERSION}")
    if state["stage"] != cfg.stage:
        raise ConfigError(f"cannot resume stage {cfg.stage} from {ckpt}: it is a stage {state['stage']} checkpoint")
    if state["world_size"] != world_size:
        raise ConfigError(
            f"cannot resume from {ckpt}: it was written by {state['world_size']} workers, this run has {world_size}; "
            f"ZeRO-3 partitions are per rank: set ray.num_workers={state['world_size']}")
    if state["breaking_hash"] != breaking_hash(cfg):
        diffs = breaking_diff(state["config"], config_to_dict(cfg))
        raise ConfigError(
            f"cannot resume from {ckpt}: the config changed in ways that break the run:\n  " + "\n  ".join(diffs)
            + "\nrestore these values, or start a new run (another ray.name)")
    if data_fingerprint is not None and state.get("data_fingerprint") not in (None, data_fingerprint):
        raise ConfigError(
            f"cannot resume from {ckpt}: the training data changed (fingerprint {state['data_fingerprint']} -> "
            f"{data_fingerprint}); the saved data positions would point at other rows")
    return state


def load_checkpoint(engine, ckpt: Path, rank: int) -> dict[str, Any]:
    """Collective: restore ZeRO shards, optimiser, scheduler and this rank's RNG; return this rank's state."""
    ckpt = Path(ckpt)
    path, _ = engine.load_checkpoint(str(ckpt / ZERO_DIR), tag=ZERO_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointError(f"{ckpt / ZERO_DIR}: DeepSpeed found no checkpoint with tag {ZERO_TAG!r}")
    rank_state = read_json(ckpt / "ranks" / f"rank_{rank}.json")
    saved = read_json(ckpt / STATE_FILE).get("scheduler")
    if saved is not None and engine.lr_scheduler.last_epoch != saved["last_epoch"]:
        raise CheckpointError(f"{ckpt}: DeepSpeed restored the LR schedule at step {engine.lr_scheduler.last_epoch}, "
                              f"our state says {saved['last_epoch']}")
    tensors = load_file(str(ckpt / "ranks" / f"rank_{rank}.rng.safetensors"))
    restore_rng(rank_state.pop("rng"), tensors)
    return rank_state


def finalize_local(tmp: Path, final: Path) -> None:
    """torchrun mode, rank 0 after a barrier: move a finished `.tmp-step_N` into place."""
    if not is_complete(tmp):
        raise CheckpointError(f"{tmp}: incomplete after all ranks reported (missing rank state)")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(run_dir: Path, keep: int | None) -> None:
    if not keep:
        return
    for _, p in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def delete_checkpoints(run_dir: Path) -> tuple[int, int]:
    """Remove every checkpoint of a run (complete, partial and scratch `.tmp-step_*`): (count, bytes freed)."""
    run_dir = Path(run_dir)
    count = freed = 0
    if not run_dir.is_dir():
        return 0, 0
    for p in run_dir.iterdir():
        if p.is_dir() and STEP_DIR.match(p.name.removeprefix(".tmp-")):
            freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p)
            count += 1
    return count, freed


# ------------------------------------------------------------------------------------ consolidation
def _is_zero3(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


@torch.no_grad()
def gather_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective: full fp32 CPU state dict on rank 0 (None elsewhere), gathered submodule by submodule."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if id(p) not in seen]
        for _, p in params:
            seen.add(id(p))
        if params:
            full = [p for _, p in params if _is_zero3(p)]
            with deepspeed.zero.GatheredParameters(full, modifier_rank=None, enabled=bool(full)):
                if rank == 0:
                    for n, p in params:
                        out[f"{prefix}.{n}" if prefix else n] = p.detach().to("cpu", torch.float32).clone()
        if rank == 0:
            for n, b in sub.named_buffers(recurse=False):
                if b is not None:
                    out[f"{prefix}.{n}" if prefix else n] = b.detach().cpu().clone()
    return out if rank == 0 else None


def consolidate_hylo(module: torch.nn.Module, out_dir: Path, rank: int, dtype: torch.dtype = torch.float32,
                     tokenizer_from: str | Path | None = None) -> Path | None:
    """Collective: write the trained `HyLoForCausalLM` (possibly ZeRO-3 partitioned) as an HF checkpoint,
    with the tokenizer files of directory `tokenizer_from` (the checkpoint training started from)."""
    from hylo.io import save_hylo
    from hylo.modeling import HyLoForCausalLM

    sd = gather_state_dict(module, rank)
    if rank != 0:
        return None
    cfg = module.config
    model = HyLoForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"consolidation into {out_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if getattr(module, "generation_config", None) is not None:
        model.generation_config = module.generation_config
    return save_hylo(model.to(dtype), out_dir, tokenizer_from=tokenizer_from)
