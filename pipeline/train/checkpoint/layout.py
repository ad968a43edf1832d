"""The format of a checkpoint directory (the layout: `hylo.pipeline.train.checkpoint`), its manifest, and a
run's set of checkpoints.

Design choices:
* A checkpoint is complete only when `manifest.json` exists and every file it lists is present with
  the recorded size, and no other file is (`checkpoint_problem`; `is_complete`). Before anything is
  loaded, every file is also checked against its sha256 (`deep=True`). The manifest is written by
  rank 0 after all ranks' files are in place, so a write that died half-way (ENOSPC, a killed worker,
  a failed upload) never looks complete. Ranks hash in parallel: under Ray each worker hashes its own
  scratch directory (Ray merges them into storage on `report`); under torchrun the ranks share
  `.tmp-step_N` and each hashes every W-th file; rank 0 merges the lists, checks sizes in storage and
  writes the manifest (torchrun: then renames the directory into place).
* A checkpoint is one step's: the step in its directory's name (`step_00000009`), its manifest's and its
  trainer state's must agree, and every file its manifest lists is inside its directory (no `..`, no absolute
  path, no link out of it: `hylo.manifest_paths.confined_paths`). One that fails is skipped with the reason, never
  resumed from, and never makes the real newest one look like another line of checkpoints.
* Our own state is JSON + safetensors, written atomically (temp + rename).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hylo import atomic, json_files, manifest_paths
from hylo.pipeline.train.storage import Loc

STEP_DIR = re.compile(r"^step_(\d{8})$")
ZERO_DIR = "zero"
ZERO_TAG = "state"
STATE_FILE = "trainer_state.json"
CHECKPOINT_MANIFEST = "manifest.json"
RANK_FILES = re.compile(r"^ranks/rank_\d+\.files\.json$")
FORMAT_VERSION = 2


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the file and the reason."""


# ------------------------------------------------------------------------------------ atomic files
def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.atomic_write(path, json.dumps(obj, indent=1, sort_keys=True, default=str))


def save_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))


def read_json(path: Path | Loc) -> Any:
    loc = Loc.of(path)
    try:
        return json_files.read_json(loc, CheckpointError)
    except FileNotFoundError as e:
        raise CheckpointError(f"{loc}: missing") from e


# ------------------------------------------------------------------------------------ names
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


SCRATCH_PREFIX = ".tmp-"


def sweep_scratch(run_dir: Path | Loc) -> list[str]:
    """Remove the scratch directories `.tmp-step_N` of a local run directory (torchrun ranks write a checkpoint
    there and rank 0 renames it into place): what a write killed half-way left, never resumed from. Called by the
    driver under the run's lock, before any rank writes (`driver.prepare_run`); a failed write removes its own
    (`deepspeed_io.save_checkpoint`, `Session.discard`). Returns the names removed."""
    loc = Loc.of(run_dir)
    if not loc.is_local or not loc.local().is_dir():
        return []
    removed = []
    for p in sorted(loc.local().iterdir()):
        if p.name.startswith(SCRATCH_PREFIX) and STEP_DIR.match(p.name.removeprefix(SCRATCH_PREFIX)) \
                and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


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
        if p.is_file() and rel != CHECKPOINT_MANIFEST and not RANK_FILES.match(rel) and ".tmp-" not in p.name:
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
    (loc / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def finalize_local(tmp: Path, final: Path, step: int, world_size: int, launch_id: str | None = None) -> None:
    """torchrun mode, rank 0 after a barrier: write the manifest of a finished `.tmp-step_N`, move it into place."""
    finalize_checkpoint(tmp, step, world_size, launch_id)
    atomic.replace_dir(tmp, final)


def _compare(files: dict[str, dict[str, Any]], present: dict[str, int]) -> str | None:
    for rel in sorted(files):
        if rel not in present:
            return f"{rel}: missing"
        if present[rel] != files[rel]["size"]:
            return (f"{rel}: {present[rel]:,} bytes, the manifest records {files[rel]['size']:,} "
                    f"(truncated or rewritten)")
    extra = sorted(set(present) - set(files) - {CHECKPOINT_MANIFEST})
    if extra:
        return f"{extra[0]}: not in the manifest (not written by this checkpoint's ranks)"
    return None


def manifest_or_reason(loc: Loc) -> tuple[dict[str, Any] | None, str | None]:
    try:
        if loc.is_local:  # its own manifest, not another checkpoint's through a link, nor a pipe
            manifest_paths.own_file(loc.local(), CHECKPOINT_MANIFEST, CheckpointError)
        m = json_files.read_json(loc / CHECKPOINT_MANIFEST, CheckpointError)
    except FileNotFoundError:
        return None, (f"no {CHECKPOINT_MANIFEST}: its write never finished (or it was not written by this "
                      f"project's training)")
    except CheckpointError as e:  # not valid JSON, not a regular file, too large, a link out of it
        return None, str(e)
    if not isinstance(m, dict) or m.get("format_version") != FORMAT_VERSION or not isinstance(m.get("files"), dict):
        return None, f"{CHECKPOINT_MANIFEST} is not a format-{FORMAT_VERSION} manifest of this project"
    step = m.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None, f"{CHECKPOINT_MANIFEST} has no integer 'step' (got {step!r})"
    named = step_of(loc)
    if named is not None and named != step:
        return None, (f"its name says step {named}, its {CHECKPOINT_MANIFEST} says step {step}: a copy of another "
                      f"checkpoint under this name? It is never resumed from (rename or remove it)")
    # every file it lists is one of its own directory's (no '..', no absolute path, no link out of it)
    try:
        manifest_paths.confined_paths(loc.local() if loc.is_local else loc.path, list(m["files"]),
                             loc / CHECKPOINT_MANIFEST, "files", CheckpointError, links=loc.is_local)
    except CheckpointError as e:
        return None, str(e)
    return m, None


def state_step_problem(loc: Loc, m: dict[str, Any]) -> str | None:
    """Why the step its trainer state records is not its manifest's (None: they agree, or its manifest lists no
    trainer state: nothing to compare; a listed one that is missing is `_compare`'s to report)."""
    if STATE_FILE not in m["files"]:
        return None
    try:
        state = json.loads((loc / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{STATE_FILE} cannot be read ({e})"
    step = state.get("step") if isinstance(state, dict) else None
    if step != m["step"]:
        return (f"{STATE_FILE} says step {step!r}, its {CHECKPOINT_MANIFEST} step {m['step']}: its files are not of "
                f"one checkpoint; it is never resumed from")
    return None


def read_manifest(ckpt: Path | Loc) -> dict[str, Any]:
    loc = Loc.of(ckpt)
    m, reason = manifest_or_reason(loc)
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
    m, reason = manifest_or_reason(loc)
    if m is None:
        return reason
    files = m["files"]
    problem = _compare(files, loc.files()) or state_step_problem(loc, m)
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


# ------------------------------------------------------------------------------------ a run's checkpoints
def list_checkpoints(run_dir: Path | Loc) -> list[tuple[int, Loc]]:
    """Complete checkpoints of a run, oldest first."""
    return [(s, p) for s, p in step_dirs(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: Path | Loc) -> Loc | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def describe_skips(run_dir: Path | Loc) -> list[str]:
    """One line per checkpoint directory of a run that is not complete, with the reason."""
    out = []
    for _, p in reversed(step_dirs(run_dir)):
        problem = checkpoint_problem(p)
        if problem:
            out.append(f"{p.name}: {problem}")
    return out


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


def delete_checkpoints(run_dir: Path | Loc) -> tuple[int, int]:
    """Remove every checkpoint of a run (complete, partial and scratch `.tmp-step_*`): (count, bytes freed)."""
    count = freed = 0
    for p in Loc.of(run_dir).children():
        if STEP_DIR.match(p.name.removeprefix(".tmp-")) and p.is_dir():
            freed += sum(p.files().values())
            p.rmtree()
            count += 1
    return count, freed
