"""Leftovers of killed jobs: found and removed on the next run of the same output, and only those.

* `sweep_stale` (also `hylo clean OUT`): a staging directory `.<name>.tmp-<pid>-<hex>` carries our record
  from its creation (`"staging": true`, pid and host). Only one with that record, made on this host by a
  process that is gone, is removed.
* A `.<name>.old-<pid>-<hex>` (a crash between the two renames of a swap) goes back in place when the
  output is missing, else is removed if its record proves all it holds ours, as written (`unproven`).
* `sweep_temp_files` does the same for the temporary files of `atomic_path`.
* Nothing else beside the output is touched. Leftovers are matched by the output's name literally (`o[1]`
  is no glob pattern).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hylo.json_files import read_json
from hylo.ownership import OUTPUT_RECORD, RECORD_MAX_BYTES, WRITTEN_BY, output_target, unproven


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _staging_record(d: Path) -> dict[str, Any] | None:
    try:
        data = read_json(d / OUTPUT_RECORD, ValueError, max_bytes=RECORD_MAX_BYTES)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY else None


def stale_leftovers(path: str | Path) -> tuple[list[Path], list[Path]]:
    """What killed jobs left beside output `path`: (ours to remove, others of the same name pattern that are
    not provably ours and are left alone). A staging directory is ours when it carries our staging record,
    made on this host by a process that is gone; an `.old-` one when its process is gone and its record
    proves all it holds ours."""
    p = output_target(path)
    ours: list[Path] = []
    others: list[Path] = []
    if not p.parent.is_dir():
        return ours, others
    host = socket.gethostname()
    for kind in ("tmp", "old"):
        # the name literally: an output named o[1] or a*b is no glob pattern
        for d in sorted(p.parent.glob(f".{glob.escape(p.name)}.{kind}-*")):
            pid_text, _, tail = d.name.removeprefix(f".{p.name}.{kind}-").partition("-")
            if not (pid_text.isdigit() and tail and d.is_dir() and not d.is_symlink()):
                continue
            rec = _staging_record(d)
            if kind == "tmp":
                mine = (rec is not None and rec.get("staging") is True and rec.get("pid") == int(pid_text)
                        and rec.get("host") == host and not _pid_alive(int(pid_text)))
            else:
                mine = not _pid_alive(int(pid_text)) and (not any(d.iterdir()) or (
                    rec is not None and not unproven(d)))
            (ours if mine else others).append(d)
    return ours, others


def sweep_stale(path: str | Path) -> list[tuple[Path, str]]:
    """Remove what killed jobs left beside output `path` (`stale_leftovers`); an `.old-` directory goes back
    in place when the output itself is missing. Returns (directory, "removed" or "put back") pairs."""
    p = output_target(path)
    done = []
    for d in stale_leftovers(path)[0]:
        if ".old-" in d.name and not (p.exists() or p.is_symlink()):
            os.replace(d, p)
            done.append((d, "put back"))
        else:
            shutil.rmtree(d, ignore_errors=True)
            done.append((d, "removed"))
    return done


def sweep_temp_files(directory: str | Path, names: Iterable[str]) -> list[Path]:
    """Remove the temporary files killed writers left in `directory` for files `names` (`atomic_path`'s
    `.<name>.tmp-<pid>-<hex>`), and only those: a plain file of that exact pattern for a listed name whose
    process is gone on this host. A job's own store (a teacher cache's shards) sweeps its leftovers this way
    on the next run. Returns what was removed."""
    d = Path(directory)
    done: list[Path] = []
    if not d.is_dir():
        return done
    for name in names:
        for f in d.glob(f".{glob.escape(name)}.tmp-*"):
            pid_text, _, tail = f.name.removeprefix(f".{name}.tmp-").partition("-")
            if (pid_text.isdigit() and re.fullmatch(r"[0-9a-f]{8}", tail) and f.is_file() and not f.is_symlink()
                    and not _pid_alive(int(pid_text))):
                f.unlink(missing_ok=True)
                done.append(f)
    return done
