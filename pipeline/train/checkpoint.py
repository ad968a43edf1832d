"""Training checkpoints (ZeRO shards + our state + a manifest), resume, and the final HF-format consolidation.

A checkpoint is one directory `<run dir>/step_<NNNNNNNN>/`:

    zero/state/...                       DeepSpeed's files: each rank's ZeRO-3 partition of parameters
                                         and optimiser state (+ rank 0's `latest`), written by
                                         `engine.save_checkpoint`
    trainer_state.json                   rank 0: step, config (whole) + breaking-key hash, world size,
                                         scheduler state (checked against DeepSpeed's on load), data
                                         fingerprint, metrics of the step
    ranks/rank_<r>.json                  each rank: its exact data position and Python RNG state
    ranks/rank_<r>.rng.safetensors       each rank: torch / CUDA / numpy RNG states
    ranks/rank_<r>.files.json            each rank: size + sha256 of the files it hashed
    manifest.json                        rank 0, LAST: every file of the checkpoint with size + sha256

Design choices:
* A checkpoint is complete only when `manifest.json` exists and every file it lists is present with
  the recorded size, and no other file is (`checkpoint_problem`; `is_complete`). Before anything is
  loaded, every file is also checked against its sha256 (`deep=True`). The manifest is written by
  rank 0 after all ranks' files are in place, so a write that died half-way (ENOSPC, a killed worker,
  a failed upload) never looks complete. Ranks hash in parallel: under Ray each worker hashes its own
  scratch directory (Ray merges them into storage on `report`); under torchrun the ranks share
  `.tmp-step_N` and each hashes every W-th file; rank 0 merges the lists, checks sizes in storage and
  writes the manifest (torchrun: then renames the directory into place).
* Resume (`resume_candidates` + the loop's collective check) walks back from the newest checkpoint
  to the newest intact one and prints every one it skipped and why (the file and the reason). The
  manifest names the launch (driver invocation) that wrote it: a worker group relaunched after a
  failure resumes from that launch's newest intact checkpoint in storage (`launch_checkpoints`), not
  from what Ray Train registered, which lags behind the manifests.
* Nothing is unpickled unchecked: DeepSpeed's shard files are torch pickles, loaded only after the
  manifest check, and then with `torch.load(weights_only=True)` and an allow-list of the few DeepSpeed
  classes its checkpoints hold (`safe_deepspeed_load`); our own state is JSON + safetensors.
* Resume refuses, with the list of keys, a config whose breaking keys changed (model, data, optimiser,
  schedule, batch, world size ...; see `config.NON_BREAKING` for what may change).
* Consolidation gathers, parameter group by parameter group, the fp32 MASTER weights from the
  optimiser (ZeRO keeps them partitioned there; with bf16 the module holds only bf16 copies) and the
  working weights of frozen parameters (or, when those are not fp32, the starting checkpoint's exact
  values) into a CPU state dict on rank 0, and saves a `HyLoForCausalLM` with `hylo.io.save_hylo`
  (safetensors + config.json + hybrid_config.json, atomic directory rename).
* Storage may be local or a URI (`storage.Loc`); all functions here take either.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import (
    StageConfig,
    breaking_diff,
    breaking_hash,
    config_from_dict,
    config_to_dict,
)
from hylo.pipeline.train.storage import Loc
from safetensors.torch import load_file, save_file

from hylo import files

STEP_DIR = re.compile(r"^step_(\d{8})$")
ZERO_DIR = "zero"
ZERO_TAG = "state"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
RANK_FILES = re.compile(r"^ranks/rank_\d+\.files\.json$")
FORMAT_VERSION = 2
# where a resume from an older checkpoint puts the run's checkpoints of the line it leaves (set_aside_other_lines)
ABANDONED_DIR = "abandoned"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the file and the reason."""


# ------------------------------------------------------------------------------------ atomic files
def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str))


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))


def read_json(path: Path | Loc) -> Any:
    loc = Loc.of(path)
    try:
        return files.read_json(loc, CheckpointError)
    except FileNotFoundError as e:
        raise CheckpointError(f"{loc}: missing") from e


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


def step_of(ckpt: Path | Loc) -> int | None:
    """The step in a checkpoint directory's name (`step_00000012` or `.tmp-step_00000012`), else None."""
    m = STEP_DIR.match(Loc.of(ckpt).name.removeprefix(".tmp-"))
    return int(m.group(1)) if m else None


def rank_files_name(rank: int) -> str:
    return f"ranks/rank_{rank}.files.json"


def step_dirs(run_dir: Path | Loc) -> list[tuple[int, Loc]]:
    """Every `step_N` directory of a run, complete or not, oldest first."""
    out = []
    for child in Loc.of(run_dir).children():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir():
            out.append((int(m.group(1)), child))
    return sorted(out, key=lambda t: t[0])


# ------------------------------------------------------------------------------------ manifest
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hashable_files(ckpt: Path) -> list[str]:
    """Files a rank may list: everything but the rank lists, the manifest and temp files of atomic writes."""
    out = []
    for p in ckpt.rglob("*"):
        rel = p.relative_to(ckpt).as_posix()
        if p.is_file() and rel != MANIFEST and not RANK_FILES.match(rel) and ".tmp-" not in p.name:
            out.append(rel)
    return sorted(out)


def write_rank_files(ckpt: Path, rank: int, world_size: int, shared: bool) -> dict[str, Any]:
    """This rank's part of the manifest: size and sha256 of the files it hashes, as
    `ranks/rank_<r>.files.json`. `shared=False` (Ray: the rank's own scratch directory): every file in
    it; `shared=True` (torchrun: one directory for all ranks, called after a barrier): every W-th file."""
    ckpt = Path(ckpt)
    rels = _hashable_files(ckpt)
    if shared:
        rels = rels[rank::world_size]
    files = {rel: {"size": (ckpt / rel).stat().st_size, "sha256": sha256_file(ckpt / rel)} for rel in rels}
    record = {"rank": rank, "files": files}
    write_json_atomic(ckpt / rank_files_name(rank), record)
    return record


def finalize_checkpoint(ckpt: Path | Loc, step: int, world_size: int, launch_id: str | None = None) -> dict[str, Any]:
    """Rank 0, once every rank's files are in `ckpt` (local or in storage): check them against the
    ranks' lists and write `manifest.json`, the completion marker, last. `launch_id` names the driver
    invocation that wrote it (`launch_checkpoints`)."""
    loc = Loc.of(ckpt)
    present = loc.files()
    files: dict[str, dict[str, Any]] = {}
    for r in range(world_size):
        name = rank_files_name(r)
        if name not in present:
            raise CheckpointError(f"{loc}: {name} is missing (rank {r} did not finish writing its files)")
        listed = read_json(loc / name)["files"]
        for rel, rec in listed.items():
            if rel in files and files[rel]["sha256"] != rec["sha256"]:
                raise CheckpointError(f"{loc}: {rel} was written differently by two ranks")
            files[rel] = rec
        files[name] = {"size": present[name], "sha256": (loc / name).sha256()}
    problem = _compare(files, present)
    if problem:
        raise CheckpointError(f"{loc}: {problem}")
    manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size, "files": files}
    if launch_id is not None:
        manifest["launch_id"] = launch_id
    (loc / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def _compare(files: dict[str, dict[str, Any]], present: dict[str, int]) -> str | None:
    for rel in sorted(files):
        if rel not in present:
            return f"{rel}: missing"
        if present[rel] != files[rel]["size"]:
            return (f"{rel}: {present[rel]:,} bytes, the manifest records {files[rel]['size']:,} "
                    f"(truncated or rewritten)")
    extra = sorted(set(present) - set(files) - {MANIFEST})
    if extra:
        return f"{extra[0]}: not in the manifest (not written by this checkpoint's ranks)"
    return None


def _manifest_or_reason(loc: Loc) -> tuple[dict[str, Any] | None, str | None]:
    try:
        m = json.loads((loc / MANIFEST).read_text())
    except FileNotFoundError:
        return None, (f"no {MANIFEST}: its write never finished (or it was not written by this project's "
                      f"training)")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"{MANIFEST} is not valid JSON ({e})"
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION or not isinstance(m.get("files"), dict):
        return None, f"{MANIFEST} is not a format-{FORMAT_VERSION} manifest of this project"
    return m, None


def read_manifest(ckpt: Path | Loc) -> dict[str, Any]:
    loc = Loc.of(ckpt)
    m, reason = _manifest_or_reason(loc)
    if m is None:
        raise CheckpointError(f"{loc}: {reason}")
    return m


def checkpoint_problem(ckpt: Path | Loc, deep: bool = False, only: Callable[[int], bool] | None = None) -> str | None:
    """Why `ckpt` cannot be resumed from (None: it can). Shallow: the manifest exists and every file it
    lists is there with its recorded size, and nothing else is. `deep`: also every file's sha256
    (`only(i)` limits the hashing to the i-th files in sorted order, for ranks that share the work)."""
    loc = Loc.of(ckpt)
    if not loc.is_dir():
        return "missing (no such directory)"
    m, reason = _manifest_or_reason(loc)
    if m is None:
        return reason
    files = m["files"]
    problem = _compare(files, loc.files())
    if problem or not deep:
        return problem
    for i, rel in enumerate(sorted(files)):
        if only is not None and not only(i):
            continue
        if (loc / rel).sha256() != files[rel]["sha256"]:
            return f"{rel}: content differs from the manifest's sha256 (corrupted or replaced)"
    return None


def is_complete(ckpt: Path | Loc) -> bool:
    """True when the manifest exists and lists exactly the files present, at their recorded sizes."""
    return checkpoint_problem(ckpt) is None


def list_checkpoints(run_dir: Path | Loc) -> list[tuple[int, Loc]]:
    """Complete checkpoints of a run, oldest first."""
    return [(s, p) for s, p in step_dirs(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: Path | Loc) -> Loc | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resume_candidates(run_dir: Path | Loc, start: Path | Loc | None = None, walk: bool = True) -> list[Loc]:
    """Checkpoints to try, newest first: `start` (default: the newest `step_N` of the run) and, with
    `walk`, every older `step_N` of the run."""
    dirs = step_dirs(run_dir)
    if start is None:
        return [p for _, p in reversed(dirs)] if walk else []
    start = Loc.of(start)
    first = step_of(start)
    if not walk or first is None:
        return [start]
    return [start] + [p for s, p in reversed(dirs) if s < first and p != start]


def launch_checkpoints(run_dir: Path | Loc, launch_id: str) -> list[Loc]:
    """The checkpoints of a run that launch `launch_id` finished (its manifest names it), newest first.

    What a worker group relaunched after a failure resumes from, whatever Ray Train registered: Ray
    records a checkpoint only once its controller has processed the report (a worker killed just after
    the manifest was written restarted from an older one, or from step 0). A checkpoint of an earlier
    launch newer than the one this launch started from (`--resume step_N` of an older step) is not
    this launch's, so it never wins."""
    out = []
    for _, p in reversed(step_dirs(run_dir)):
        m, _ = _manifest_or_reason(p)
        if m is not None and m.get("launch_id") == launch_id:
            out.append(p)
    return out


def choose_intact(candidates: list[Loc], deep: bool = True, log: Callable[[str], None] = print) -> Loc | None:
    """The first intact checkpoint of `candidates` (newest first); logs each skipped one and why."""
    for c in candidates:
        problem = checkpoint_problem(c, deep=deep)
        if problem is None:
            return c
        log(f"[resume] skipping {c.name}: {problem}")
    return None


def describe_skips(run_dir: Path | Loc) -> list[str]:
    """One line per checkpoint directory of a run that is not complete, with the reason."""
    out = []
    for _, p in reversed(step_dirs(run_dir)):
        problem = checkpoint_problem(p)
        if problem:
            out.append(f"{p.name}: {problem}")
    return out


# ------------------------------------------------------------------------------------ save / load
def save_checkpoint(engine, ckpt: Path, rank: int, world_size: int, step: int, cfg: StageConfig,
                    rank_state: dict[str, Any], global_state: dict[str, Any]) -> None:
    """Collective: every rank writes its ZeRO partition and its own state into local directory `ckpt`.
    A full disk is reported as a `CheckpointError` naming the directory (the partial files stay, and
    count as incomplete)."""
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
        raise write_error(ckpt, e, step=step, rank=rank) from e


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e` (or an exception it wraps) is a full disk or quota (ENOSPC, EDQUOT)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _usage(where: Path) -> tuple[Path, int, int] | None:
    """(existing directory, free bytes, total bytes) of the filesystem holding `where`."""
    try:
        d = next(p for p in (where, *where.parents) if p.exists())
        u = shutil.disk_usage(d)
    except (OSError, StopIteration):
        return None
    return d, u.free, u.total


def _failed_file(ckpt: Path, e: BaseException) -> str | None:
    """The file a failed checkpoint write was writing: the error's own file name, else the newest file."""
    name = getattr(e, "filename", None)
    if not name:
        try:
            name = max((p for p in ckpt.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
        except (OSError, ValueError):
            return None
    try:
        return Path(name).relative_to(ckpt).as_posix()
    except ValueError:
        return str(name)


def _space_note(where: Path) -> str:
    u = _usage(where)
    if u is None:
        return ""
    d, free, total = u
    return f"; {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB on {d} now"


def write_error(ckpt: Path, e: BaseException, step: int | None = None, rank: int | None = None) -> CheckpointError:
    """A failed checkpoint write, saying which checkpoint, which file, why, and how much space is left."""
    u = _usage(ckpt)
    # torch.save reports ENOSPC as a RuntimeError without errno: judge by the free space
    full = is_disk_full(e) or (u is not None and u[1] < 2**20)
    why = "the disk is full (ENOSPC)" if full else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    what = f"checkpoint {step_dir_name(step)} (" if step is not None else "checkpoint "
    what += f"{ckpt}" + (f", rank {rank}'s files)" if step is not None and rank is not None else
                         ")" if step is not None else "")
    file = _failed_file(ckpt, e)
    return CheckpointError(f"writing {what} failed{f' at {file}' if file else ''}: {why}{_space_note(ckpt)}. "
                           f"A partial checkpoint is never resumed from; free space (or lower checkpoint.keep), "
                           f"then --resume continues from the newest intact checkpoint")


def upload_error(target: Loc, scratch: Path | None, e: BaseException, step: int, rank: int,
                 file: str | None = None) -> CheckpointError:
    """Ray Train's copy of a rank's scratch directory into `target` (`<run>/step_N`) failed (or, with
    `file`, rank 0's write of that file there): name the first file that did not arrive whole, and
    (local storage) how much space is left there."""
    try:
        present = target.files()
    except OSError:
        present = {}
    for p in sorted(q for q in scratch.rglob("*") if q.is_file()) if scratch is not None and file is None else []:
        rel = p.relative_to(scratch).as_posix()
        if present.get(rel, -1) < p.stat().st_size:
            file = f"{rel} ({present.get(rel, 0):,} of {p.stat().st_size:,} bytes in storage)"
            break
    why = "the disk is full (ENOSPC)" if is_disk_full(e) else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    space = _space_note(target.local()) if target.is_local else ""
    return CheckpointError(f"writing checkpoint {target.name} ({target}, rank {rank}'s files) failed"
                           f"{f' at {file}' if file else ''}: {why}{space}. A partial checkpoint is never resumed "
                           f"from; free space (or lower checkpoint.keep), then --resume continues from the newest "
                           f"intact checkpoint")


def _stored_config(state: dict[str, Any]) -> StageConfig | None:
    """A checkpoint's config as this version reads it (renamed keys under their new names, e.g. ild.train_mlp
    -> ild.trainable), so a resume compares meanings, not spellings; None when it no longer loads."""
    try:
        return config_from_dict({**state["config"], "stage": state["stage"]})
    except (ConfigError, KeyError, TypeError):
        return None


def check_compatible(ckpt: Path | Loc, cfg: StageConfig, world_size: int,
                     data_fingerprint: str | None = None) -> dict[str, Any]:
    """Read rank 0's state and refuse a resume that would silently break the run."""
    ckpt = Loc.of(ckpt)
    state = read_json(ckpt / STATE_FILE)
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}/{STATE_FILE}: format_version {state.get('format_version')} != {FORMAT_VERSION}")
    if state["stage"] != cfg.stage:
        raise ConfigError(f"cannot resume stage {cfg.stage} from {ckpt}: it is a stage {state['stage']} checkpoint")
    if state["world_size"] != world_size:
        raise ConfigError(
            f"cannot resume from {ckpt}: it was written by {state['world_size']} workers, this run has {world_size}; "
            f"ZeRO-3 partitions are per rank: set ray.num_workers={state['world_size']}")
    stored = _stored_config(state)
    if state["breaking_hash"] != breaking_hash(cfg) and (stored is None or breaking_hash(stored) != breaking_hash(cfg)):
        diffs = breaking_diff(state["config"] if stored is None else config_to_dict(stored), config_to_dict(cfg))
        raise ConfigError(
            f"cannot resume from {ckpt}: the config changed in ways that break the run:\n  " + "\n  ".join(diffs)
            + "\nrestore these values, or start a new run (another ray.name)")
    if data_fingerprint is not None and state.get("data_fingerprint") not in (None, data_fingerprint):
        raise ConfigError(
            f"cannot resume from {ckpt}: the training data changed (fingerprint {state['data_fingerprint']} -> "
            f"{data_fingerprint}); the saved data positions would point at other rows")
    return state


def stored_param_shapes(ckpt: Path | Loc) -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes DeepSpeed recorded in a checkpoint (rank 0's model-states file: `param_shapes`
    and `frozen_param_shapes`, by the engine module's names), or None when it has no such file. The file is
    checked against the manifest's sha256 first and loaded weights-only with DeepSpeed's allow-list."""
    import io

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


def check_student_fits(ckpt: Path | Loc, student: Path, prefix: str = "student.") -> None:
    """Refuse a resume whose student (model.student, a local HyLo checkpoint) has other parameter shapes than
    the ones checkpoint `ckpt` holds (DeepSpeed would fail deep inside its load, in every worker and every
    retry: `The size of tensor a (26912) must match ...`). Cheap: config files, a meta-device model and
    rank 0's small model-states file."""
    stored = stored_param_shapes(ckpt)
    if not stored:
        return
    from hylo.config import HybridConfig
    from hylo.modeling import HyLoForCausalLM

    with torch.device("meta"):
        model = HyLoForCausalLM(HybridConfig.from_hybrid_json(student))
    mine = {prefix + n: tuple(p.shape) for n, p in model.named_parameters()}
    theirs = {n: s for n, s in stored.items() if n.startswith(prefix)}
    problems = [f"{n[len(prefix):]}: {theirs[n]} in the checkpoint, {mine[n]} in the student" for n in sorted(theirs)
                if n in mine and mine[n] != theirs[n]]
    problems += [f"{n[len(prefix):]}: in the checkpoint, not in the student" for n in sorted(set(theirs) - set(mine))]
    if problems:
        try:
            was = read_json(Loc.of(ckpt) / STATE_FILE)["config"]["model"]["student"]
        except (CheckpointError, KeyError, TypeError):
            was = None
        raise ConfigError(
            f"cannot resume from {ckpt}: model.student={str(student)!r} is not the model it trained "
            f"({len(problems)} parameter(s) differ, first {problems[0]}); resume with the student the run "
            f"started from" + (f" (model.student={was!r})" if was else "") + ", or start a new run (another ray.name)",
            "model.student")


def deepspeed_safe_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed puts into its checkpoint pickles (ZeRO stages 0-3, fp32/bf16),
    allowed for `torch.load(weights_only=True)`; anything else in a pickle is refused."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, DynamicLossScaler, ZeroStageEnum]


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


def finalize_local(tmp: Path, final: Path, step: int, world_size: int, launch_id: str | None = None) -> None:
    """torchrun mode, rank 0 after a barrier: write the manifest of a finished `.tmp-step_N`, move it into place."""
    finalize_checkpoint(tmp, step, world_size, launch_id)
    files.replace_dir(tmp, final)


def prune(run_dir: Path | Loc, keep: int | None) -> list[str]:
    """Keep the newest `keep` complete checkpoints; remove older complete ones and every incomplete one
    older than the oldest kept (nothing can resume from those). Returns the names removed."""
    if not keep:
        return []
    dirs = step_dirs(run_dir)
    complete = [s for s, p in dirs if is_complete(p)]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for s, p in dirs:
        if s < oldest_kept:
            p.rmtree()
            removed.append(p.name)
    return removed


def set_aside_other_lines(run_dir: Path | Loc, resumed: Path | Loc, step: int,
                          copies: tuple[str, ...] = ()) -> tuple[Loc, list[str]] | None:
    """A resume from checkpoint `resumed` (at `step`) continues the run's line of checkpoints from there:
    the run's complete checkpoints that are not on that line (the ones after `step`; every one when
    `resumed` is not a checkpoint of this run) are moved into `<run>/abandoned/<time>-after-<name>/`,
    with a copy of each file of `copies` (the metrics of the abandoned line), so that "the newest
    checkpoint" (`--resume`, `latest_checkpoint`) and pruning (`checkpoint.keep`) only ever see the line the
    run is on, and nothing of the abandoned line is deleted, overwritten or resumed from silently.
    Returns (that folder, the names moved), or None when every checkpoint is on the line.
    (Incomplete ones are left: nothing resumes from them, and the line overwrites or prunes them.)"""
    run, resumed = Loc.of(run_dir), Loc.of(resumed)
    ours = resumed.parent == run
    other = [(s, p) for s, p in step_dirs(run) if (s > step or not ours) and p != resumed and is_complete(p)]
    if not other:
        return None
    base = f"{time.strftime('%Y%m%dT%H%M%S')}-after-{resumed.name}"
    folder, n = run / ABANDONED_DIR / base, 1
    while folder.exists():
        n += 1
        folder = run / ABANDONED_DIR / f"{base}-{n}"
    for name in copies:
        if (run / name).is_file():
            (folder / name).write_bytes((run / name).read_bytes())
    for _, p in other:
        p.move_dir(folder / p.name)
    return folder, [p.name for _, p in other]


def delete_checkpoints(run_dir: Path | Loc) -> tuple[int, int]:
    """Remove every checkpoint of a run (complete, partial and scratch `.tmp-step_*`): (count, bytes freed)."""
    count = freed = 0
    for p in Loc.of(run_dir).children():
        if STEP_DIR.match(p.name.removeprefix(".tmp-")) and p.is_dir():
            freed += sum(p.files().values())
            p.rmtree()
            count += 1
    return count, freed


# ------------------------------------------------------------------------------------ consolidation
def _is_zero3(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def master_weight(p: torch.nn.Parameter) -> torch.Tensor | None:
    """Collective for partitioned parameters: the full fp32 master copy the optimiser updates (ZeRO-3:
    partitioned in the optimiser; ZeRO-1/2 and DeepSpeed's bf16 optimiser: a flat fp32 buffer), or None
    when the optimiser keeps none (frozen parameters; plain fp32 training, where the weights are the master)."""
    if not p.requires_grad or (_is_zero3(p) and getattr(p, "_z3_optimizer", None) is None):
        return None
    if not _is_zero3(p) and not hasattr(p, "_hp_mapping"):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(p)


@torch.no_grad()
def gather_state_dict(module: torch.nn.Module, rank: int) -> tuple[dict[str, torch.Tensor] | None, set[str]]:
    """Collective: full fp32 CPU state dict on rank 0 (None elsewhere), gathered submodule by submodule.

    Trained parameters come from the optimiser's fp32 master weights (`master_weight`), the others
    from the module (gathered when partitioned). Also returns the names taken from working weights
    that are not fp32 (their values were rounded when the model was loaded in that dtype)."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    rounded: set[str] = set()
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        params = [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub.named_parameters(recurse=False)
                  if id(p) not in seen]
        working = []
        for name, p in params:
            seen.add(id(p))
            master = master_weight(p)
            if master is None:
                working.append((name, p))
            elif rank == 0:
                out[name] = master.detach().to("cpu", torch.float32).reshape(p.ds_shape if _is_zero3(p) else p.shape).clone()
        full = [p for _, p in working if _is_zero3(p)]
        if working:
            with deepspeed.zero.GatheredParameters(full, modifier_rank=None, enabled=bool(full)):
                if rank == 0:
                    for name, p in working:
                        out[name] = p.detach().to("cpu", torch.float32).clone()
                        if p.dtype != torch.float32:
                            rounded.add(name)
        if rank == 0:
            for n, b in sub.named_buffers(recurse=False):
                if b is not None:
                    out[f"{prefix}.{n}" if prefix else n] = b.detach().cpu().clone()
    return (out if rank == 0 else None), rounded


def consolidate_hylo(module: torch.nn.Module, out_dir: Path, rank: int, dtype: torch.dtype = torch.float32,
                     tokenizer_from: str | Path | None = None) -> Path | None:
    """Collective: write the trained `HyLoForCausalLM` (possibly ZeRO-3 partitioned) as an HF checkpoint,
    with the tokenizer files of directory `tokenizer_from` (the checkpoint training started from).

    Trained weights are the fp32 masters; frozen weights that training held in a lower precision are
    taken from `tokenizer_from`'s checkpoint itself (they never changed), so nothing is rounded."""
    from hylo.io import load_hylo, save_hylo
    from hylo.modeling import HyLoForCausalLM

    sd, rounded = gather_state_dict(module, rank)
    if rank != 0:
        return None
    cfg = module.config
    if rounded and tokenizer_from is not None:
        model = load_hylo(tokenizer_from, dtype=torch.float32)
        for name in rounded:
            sd.pop(name, None)
        print(f"[train] consolidation: {len(rounded)} frozen tensors taken from {tokenizer_from} "
              f"(training held them in lower precision)", flush=True)
    else:
        model = HyLoForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight") and k not in rounded]
    if missing or unexpected:
        raise CheckpointError(f"consolidation into {out_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if getattr(module, "generation_config", None) is not None:
        model.generation_config = module.generation_config
    return save_hylo(model.to(dtype), out_dir, tokenizer_from=tokenizer_from)
