"""A failed checkpoint write or upload, told the way a user can act on it: which checkpoint, which file,
why (a full disk or quota is named as such, whatever layer reported it), and how much space is left.

A partial checkpoint is never resumed from (its manifest is missing: `layout.checkpoint_problem`), so
each message ends with what to do: free space (or lower checkpoint.keep) and `--resume`.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from hylo.pipeline.train.checkpoint.layout import CheckpointError, step_dir_name
from hylo.pipeline.train.storage import Loc


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
