"""Which checkpoint a run resumes from, and whether it may.

Design choices:
* Resume (`resume_candidates` + the session's collective check, `session.Session.resume_checkpoint`)
  walks back from the newest checkpoint to the newest intact one and prints every one it skipped and
  why (the file and the reason). The manifest names the launch (driver invocation) that wrote it: a
  worker group relaunched after a failure resumes from that launch's newest intact checkpoint in
  storage (`launch_checkpoints`), not from what Ray Train registered, which lags behind the manifests.
* Resume refuses, with the list of keys, a config whose breaking keys changed (model, data, optimiser,
  schedule, batch, world size ...; see `config.NON_BREAKING` for what may change), another world size,
  other training data, and a student of other parameter shapes (`check_student_fits`, before Ray starts).
* A resume from an older checkpoint starts a new line of checkpoints: the ones after it are set aside
  (`set_aside_other_lines`), never deleted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.checkpoint.deepspeed_io import stored_param_shapes
from hylo.pipeline.train.checkpoint.layout import (
    FORMAT_VERSION,
    STATE_FILE,
    CheckpointError,
    is_complete,
    manifest_or_reason,
    read_json,
    step_dirs,
    step_of,
)
from hylo.pipeline.train.config import (
    StageConfig,
    breaking_diff,
    breaking_hash,
    config_from_dict,
    config_to_dict,
)
from hylo.pipeline.train.storage import Loc

# where a resume from an older checkpoint puts the run's checkpoints of the line it leaves (set_aside_other_lines)
ABANDONED_DIR = "abandoned"


# ------------------------------------------------------------------------------------ candidates
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
        m, _ = manifest_or_reason(p)
        if m is not None and m.get("launch_id") == launch_id:
            out.append(p)
    return out


# ------------------------------------------------------------------------------------ compatibility
def _stored_config(state: dict[str, Any]) -> StageConfig | None:
    """A checkpoint's config as this version reads it (a key added since takes its default), so a resume compares
    meanings, not spellings; None when it no longer loads (a key this version does not know)."""
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


def check_student_fits(ckpt: Path | Loc, student: Path, prefix: str = "student.") -> None:
    """Refuse a resume whose student (model.student, a local HyLo checkpoint) has other parameter shapes than
    the ones checkpoint `ckpt` holds (DeepSpeed would fail deep inside its load, in every worker and every
    retry: `The size of tensor a (26912) must match ...`). Cheap: config files, a meta-device model and
    rank 0's small model-states file."""
    stored = stored_param_shapes(ckpt)
    if not stored:
        return
    from hylo.config import HybridConfig  # lazy: transformers
    from hylo.modeling import HyLoForCausalLM  # lazy: transformers

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


# ------------------------------------------------------------------------------------ a new line of checkpoints
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
