"""Saving and loading a checkpoint's engine state: DeepSpeed's ZeRO files and our per-rank state (data
position, RNG states), and DeepSpeed's pickles loaded safely.

Design choices:
* Nothing is unpickled unchecked: DeepSpeed's shard files are torch pickles, loaded only after the
  manifest check (`layout.checkpoint_problem(deep=True)`), and then with `torch.load(weights_only=True)`
  and an allow-list of the few DeepSpeed classes its checkpoints hold (`safe_deepspeed_load`); our own
  state is JSON + safetensors.
* A failed write (a full disk above all) is a `CheckpointError` naming the checkpoint, the file and the
  space left (`write_errors.write_error`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import random
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from hylo.pipeline.train.checkpoint.layout import (
    FORMAT_VERSION,
    STATE_FILE,
    ZERO_DIR,
    ZERO_TAG,
    CheckpointError,
    read_json,
    read_manifest,
    save_tensors_atomic,
    write_json_atomic,
)
from hylo.pipeline.train.checkpoint.write_errors import write_error
from hylo.pipeline.train.config import StageConfig, breaking_hash, config_to_dict
from hylo.pipeline.train.storage import Loc


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


# ------------------------------------------------------------------------------------ save / load
def save_checkpoint(engine, ckpt: Path, rank: int, world_size: int, step: int, cfg: StageConfig,
                    rank_state: dict[str, Any], global_state: dict[str, Any]) -> None:
    """Collective: every rank writes its ZeRO partition and its own state into local directory `ckpt`.
    A full disk (any failed write) is reported as a `CheckpointError` naming the directory, the file and the
    space left; the partial directory is removed first (a failed write leaves nothing: under torchrun the ranks
    share it, and the checkpoint is lost for all of them). The previous checkpoint is untouched."""
    ckpt = Path(ckpt)
    try:
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
                "scheduler": {"last_epoch": sched.last_epoch, "base_lrs": sched.base_lrs,
                              "last_lr": sched.get_last_lr()},
                **global_state,
            })
    except (OSError, RuntimeError) as e:
        # torch.save reports a failed write (ENOSPC included) as a RuntimeError without errno
        error = write_error(ckpt, e, step=step, rank=rank)  # names the file and the free space, before removing
        shutil.rmtree(ckpt, ignore_errors=True)
        raise error from e


def load_checkpoint(engine, ckpt: Path, rank: int) -> dict[str, Any]:
    """Collective: restore ZeRO shards, optimiser, scheduler and this rank's RNG from local directory
    `ckpt` (already checked against its manifest); return this rank's state."""
    ckpt = Path(ckpt)
    try:
        with safe_deepspeed_load(engine):
            path, _ = engine.load_checkpoint(str(ckpt / ZERO_DIR), tag=ZERO_TAG, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{ckpt}: refused to load a DeepSpeed file: it holds objects that are not weights "
                              f"({str(e).splitlines()[0]})") from None
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


# ------------------------------------------------------------------------------------ DeepSpeed's pickles
DEEPSPEED_ENUMS: tuple[type, ...] = ()


def enum_member_by_name(cls: Any, name: str) -> Any:
    """`getattr(cls, name)` as a pickle calls it, for one thing only: a member of an allowed enum.
    Some Python 3.11 releases pickle an enum member as `getattr(EnumClass, 'name')` (3.11.2 does, 3.11.7
    pickles it by value), so a checkpoint DeepSpeed saved there holds `builtins.getattr`: this stands in for
    it (measured: every resume failed weights-only under Debian's 3.11.2) and refuses everything else."""
    if cls in DEEPSPEED_ENUMS and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) in a pickle: only members of "
                                 f"{', '.join(c.__name__ for c in DEEPSPEED_ENUMS)} are allowed")


def deepspeed_safe_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed puts into its checkpoint pickles (ZeRO stages 0-3, fp32/bf16),
    allowed for `torch.load(weights_only=True)`, and `builtins.getattr` limited to their enums' members
    (`enum_member_by_name`); anything else in a pickle is refused."""
    global DEEPSPEED_ENUMS
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: deepspeed

    DEEPSPEED_ENUMS = (ZeroStageEnum,)
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, (enum_member_by_name, "builtins.getattr")]


@contextlib.contextmanager
def safe_deepspeed_load(engine) -> Iterator[None]:
    """While DeepSpeed loads a checkpoint: its checkpoint engine loads with `weights_only=True` and an
    allow-list, and any other `torch.load` in the process is forced to weights-only as well."""
    ce = engine.checkpoint_engine

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)

    original = ce.__dict__.get("load")
    ce.load = types.MethodType(load, ce)
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
        if original is None:
            del ce.load
        else:
            ce.load = original


def stored_param_shapes(ckpt: Path | Loc) -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes DeepSpeed recorded in a checkpoint (rank 0's model-states file: `param_shapes`
    and `frozen_param_shapes`, by the engine module's names), or None when it has no such file. The file is
    checked against the manifest's sha256 first and loaded weights-only with DeepSpeed's allow-list."""
    loc = Loc.of(ckpt)
    manifest = read_manifest(loc)
    names = sorted(n for n in manifest["files"] if n.startswith(f"{ZERO_DIR}/{ZERO_TAG}/")
                   and n.endswith("model_states.pt"))
    names = [n for n in names if "rank_0_" in n or n.endswith("/mp_rank_00_model_states.pt")] or names[:1]
    if not names:
        return None
    f = loc / names[0]
    data = f.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["files"][names[0]]["sha256"]:
        raise CheckpointError(f"{f}: content differs from the manifest's sha256 (corrupted or replaced)")
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{f}: refused to load a DeepSpeed file: it holds objects that are not weights "
                              f"({str(e).splitlines()[0]})") from None
    out: dict[str, tuple[int, ...]] = {}
    for key in ("param_shapes", "frozen_param_shapes"):
        groups = state.get(key) or []
        for group in groups if isinstance(groups, list) else [groups]:
            out.update({str(k): tuple(int(d) for d in v) for k, v in dict(group).items()})
    return out
