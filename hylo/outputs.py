"""A job's output at a path the user named: never one of its inputs, written whole or not at all.

* An output is never one of the job's inputs (`check_not_an_input`, the one check every job that writes a path
  the user named calls, with what the job reads: its config file, model folders, data, caches, teacher; for a
  job with a config, `hylo.pipeline.paths.job_inputs` lists them from the config's path fields): `--out` equal
  to an input, inside one (a file of a model folder the job reads), or holding one is refused
  (`OutputConflictError`) before any work, `--force` or not, as `convert --to-released M --out M` would
  otherwise replace M with its own export.
* `atomic_dir(path)`: an output directory built under a temporary name and swapped in (hylo/atomic.py's
  `replace_dir`). The ownership check of hylo/ownership.py (a record proves every entry ours, as written)
  runs before the work and again at the swap. What a killed run of the same output left is removed first
  (hylo/leftovers.py). A job stopped by SIGTERM or Ctrl-C removes its staging directory itself (registered
  with the signal rule of hylo/stopping.py); any other error removes it on the way out.
* A file written at a path the user named (`hylo estimate --json`, kernels-check's reports in `--out`,
  `hylo configs cp`) follows the same rule, checked before the work (`check_output_file`). It is never one of
  the command's inputs, never a directory or another kind of non-regular file, never over a file this project
  did not write (`is_own_file`) unless the command's `--force`. An unwritable location fails then, named as
  given.
* A symbolic link at the output path, dangling or not, is followed (`hylo.ownership.output_target`): what it
  points to is the output, checked by the rules above, and the link stays. The one rule for links.
* Errors name the path the user gave, not the internal temporary name (an unwritable parent, a full disk, an
  I/O error inside a Rust extension).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hylo.atomic import TEMP_FILE_MODE, atomic_write, honour_umask, rename_in_error, replace_dir, temp_name
from hylo.bounded_read import file_kind
from hylo.leftovers import sweep_stale, sweep_temp_files
from hylo.ownership import (
    OUTPUT_RECORD,
    WRITTEN_BY,
    ForeignOutputError,
    check_replaceable,
    is_own_file,
    output_target,
    real_path,
    shown_path,
    write_record,
)


class OutputConflictError(ValueError):
    """An output path is one of the job's inputs, lies inside one or holds one; the message names both."""


Inputs = Iterable[tuple[str, "str | os.PathLike[str] | None"]]


def check_not_an_input(out: str | Path, inputs: Inputs, what: str = "--out",
                       own: Iterable[str | Path] = ()) -> None:
    """The one check of an output against what the job reads: refuse output `out` when it is, lies inside, or
    holds one of `inputs` ((option, path) pairs; None or a path that does not exist skipped), links followed:
    writing it would replace or change the input the job reads. `--force` never lifts it. `own`: inputs that are
    the job's own earlier output inside `out` (a stage-1 run's `<run>/converted`), not a conflict."""
    o = real_path(out)
    mine = {real_path(p) for p in own}
    for option, src in inputs:
        if src is None or os.fspath(src) == "" or not Path(src).expanduser().exists():
            # a missing input is the reader's error to report, not a conflict
            continue
        i = real_path(src)
        if i in mine:
            continue
        if o == i:
            how, why = "is the input", "the job would replace its own input with its output"
        elif o.is_relative_to(i):
            how, why = "lies inside the input", "the job would write its output into its own input"
        elif i.is_relative_to(o):
            how, why = "holds the input", "replacing it would delete the input the job reads"
        else:
            continue
        linked = o != Path(out).expanduser().absolute() or i != Path(src).expanduser().absolute()
        same = f" ({o} and {i}, links followed)" if linked else ""
        raise OutputConflictError(f"{what} {out} {how} {option} {src}{same}: {why}; choose another {what} "
                                  f"(--force never lets an output replace an input)")


def check_output_file(path: str | Path, what: str, inputs: Inputs = (), force: bool = False,
                      force_flag: str = "--force") -> Path:
    """The one rule for a file a command writes at a path the user named (`--json FILE`, a report in `--out`,
    `hylo configs cp`), checked before any work; returns the file to write. It is never one of the command's
    `inputs` ((option, path) pairs, `check_not_an_input`), never a directory or another file that is not a
    regular one, and an existing file this project did not write (`is_own_file`) is refused unless `force` (the
    command's `force_flag`). A symbolic link, dangling or not, is followed: what it points to is checked and
    written, the link stays (`output_target`). Its directory is made and a file is created in it and removed, so
    that an unwritable location fails now; errors name the path as given (`what`: the option). What a killed
    writer of it left (`.<name>.tmp-<pid>-<hex>`) is removed (`sweep_temp_files`)."""
    shown = shown_path(path)
    p = output_target(path)
    check_not_an_input(p, inputs, what)
    if p.exists() and not p.is_file():
        kind = "a directory" if p.is_dir() else file_kind(p.stat().st_mode)
        raise ForeignOutputError(f"{what} {shown} is {kind}: give the name of a file to write")
    if p.exists() and not force and not is_own_file(p):
        raise ForeignOutputError(f"{what} {shown} exists and this project did not write it (no {OUTPUT_RECORD} "
                                 f"beside it proves it, and it carries no \"written_by\": \"{WRITTEN_BY}\"); it "
                                 f"never overwrites a file it did not write: move it away, choose another {what}, "
                                 f"or pass {force_flag} to replace it")
    _writable_parent(p, shown, what)
    probe = temp_name(p)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, TEMP_FILE_MODE))
    except OSError as e:
        raise OSError(e.errno, f"cannot write it ({e.strerror or e})", f"{what} {shown}") from None
    probe.unlink(missing_ok=True)
    sweep_temp_files(p.parent, [p.name])
    return p


def write_output_file(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to the file a user named, checked before by `check_output_file`: atomically (temp + rename),
    through a symbolic link to what it points to (the link stays: the one rule for links). Returns the file."""
    p = output_target(path)
    atomic_write(p, data)
    return p


def _writable_parent(path: Path, shown: str, what: str) -> None:
    """Create the parent of output `path`; an error names the output as given, not a temporary name. Under the
    signal rule (hylo/stopping.py, looked up: only a job run under it has loaded it) the folders made are
    removed on a signal while still empty."""
    rule = sys.modules.get("hylo.stopping")
    try:
        if rule is not None:
            rule.make_dir(path.parent)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create its directory {path.parent} ({e.strerror or e})",
                      f"{what} {shown}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(path.parent).f_flag & os.ST_RDONLY else errno.EACCES
        raise OSError(code, f"cannot write it: its directory {path.parent} is not writable ({os.strerror(code)})",
                      f"{what} {shown}")


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


def _rust_os_error(e: BaseException) -> int | None:
    m = _RUST_OS_ERROR.search(str(e))
    return int(m.group(1) or m.group(2)) if m else None


# Local names under which the frames of a failed write usually hold the file they write.
_PATH_LOCALS = ("path", "filename", "file", "tmp", "save_directory", "out", "out_dir", "directory")


def _file_in(value: Any, tmp: Path) -> str | None:
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    return text if text and (text == os.fspath(tmp) or text.startswith(os.fspath(tmp) + os.sep)) else None


def _file_under(tb: Any, tmp: Path) -> str | None:
    """The file below `tmp` a failed write was working on, from the innermost frame of traceback `tb` that holds
    one (a temporary `.<name>.tmp-...` of `atomic_path` given as its `<name>`)."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        scopes = [frame.f_locals, *([vars(owner)] if owner is not None and hasattr(owner, "__dict__") else [])]
        for name in _PATH_LOCALS:
            found = next((f for f in (_file_in(scope.get(name), tmp) for scope in scopes) if f), None)
            if found:
                return re.sub(r"/\.([^/]+)\.tmp-\d+-[0-9a-f]{8}$", r"/\1", found)
    return None


@contextlib.contextmanager
def atomic_dir(path: str | Path, what: str = "output directory", inputs: Inputs = ()) -> Iterator[Path]:
    """Yield a new empty directory beside `path` to fill; when the block ends normally it replaces
    `path` (`replace_dir`), when it raises it is deleted and `path` is untouched. The new directory gets
    the record of what it holds (`OUTPUT_RECORD`: every file with its size, `write_record`); an existing `path`
    holding anything no record of ours proves ours is refused before the block runs and again before the swap
    (`check_replaceable`; `what`: the option, for the message), as is a `path` that is, is inside or holds one of
    the job's `inputs` (`check_not_an_input`). A link is followed (`output_target`); what a killed run of the same
    output left is removed first (`sweep_stale`)."""
    shown = shown_path(path)
    given = Path(path).expanduser()
    path = output_target(path)
    check_not_an_input(path, inputs, what)
    check_replaceable(given, what)
    _writable_parent(path, shown, what)
    sweep_stale(path)
    tmp = temp_name(path)
    # removed should a signal stop the job (the `finally` below does it on the way out): the signal rule,
    # hylo/stopping.py, is loaded when a job runs under it (looked up, not imported)
    rule = sys.modules.get("hylo.stopping")
    if rule is not None:
        rule.track_temp(tmp)
    try:
        tmp.mkdir()
        # the staging record: says whose this directory is should the process be killed (`stale_leftovers`)
        atomic_write(tmp / OUTPUT_RECORD, json.dumps({"written_by": WRITTEN_BY, "staging": True, "pid": os.getpid(),
                                                      "host": socket.gethostname(), "output": str(path),
                                                      "entries": []}, indent=1) + "\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(e.errno, f"cannot write it ({e.strerror or e})", f"{what} {shown}") from None
    try:
        yield tmp
        write_record(tmp, [p.name for p in tmp.iterdir()])
        check_replaceable(given, what)
        honour_umask(tmp)
        replace_dir(tmp, path)
    except OSError as e:
        rename_in_error(e, tmp, path)
        if e.filename is None and e.errno is not None:
            # a write that names no file (a full disk while writing an open file): the file it was writing, by
            # the output's name, never the temporary one a reader of the traceback would find
            inner = _file_under(e.__traceback__, tmp)
            e.filename = os.fspath(given) + inner[len(os.fspath(tmp)):] if inner else f"{what} {shown}"
        raise
    except Exception as e:
        # an I/O error inside a Rust extension (safetensors) names no file: it is the output's
        code = _rust_os_error(e)
        if code is None:
            raise
        inner = _file_under(e.__traceback__, tmp)
        raise OSError(code, os.strerror(code), os.fspath(given) + inner[len(os.fspath(tmp)):] if inner
                      else f"{what} {shown}") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if rule is not None:
            rule.forget(tmp)
