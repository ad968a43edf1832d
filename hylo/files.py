"""Files: atomic writes, JSON reading with errors that name the file, cheap checks of weight files.

Used by `hylo/` and `pipeline/` alike (this module imports neither torch nor Ray):
* `atomic_path(path)` / `atomic_write(path, data)`: a file is written under a temporary name in its own
  directory (`.<name>.tmp-<pid>-<hex>`) and renamed over `path` only when complete (`fsync=True` also
  flushes it to disk first), so a reader or a crash sees the old file or the new one, never a part;
  on an error the temporary file is removed and `path` is left as it was.
* `atomic_dir(path)` / `replace_dir(staging, path)`: the same for a directory, built under a temporary
  name and swapped in; a previous one is renamed aside (`.<name>.old-<pid>-<hex>`) and deleted only
  once the new one is in place (put back if that fails).
* Only our own outputs are ever replaced: `atomic_dir` writes the record `.hylo-output.json` (the
  entries it wrote) into each directory it makes, and refuses to replace an existing directory holding
  anything its record does not list (`check_replaceable`, before the work and again at the swap): a
  user's notes.txt in `--out`, or a directory this project never wrote, is named and left alone.
* An output is never one of the job's inputs (`check_not_an_input`): `--out` equal to an input, inside one, or
  holding one is refused (`OutputConflictError`) before any work, as `convert --to-released M --out M` would
  otherwise replace M with its own export.
* A symbolic link given as an output directory is followed (`output_target`): the ownership check and the swap
  apply to the directory it points to, the link stays; messages name the path as given ("(a link to ...)").
* A job that adds files to a directory instead of replacing it (eval's results.json / results.md) overwrites
  only files the directory's record lists (`check_own_files`) and adds what it wrote to it (`record_files`).
* What a killed job left is found and removed on the next run of that output (`sweep_stale`, also `hylo clean
  OUT`): a staging directory `.<name>.tmp-<pid>-<hex>` carries our record from its creation (`"staging": true`,
  pid and host), and only one with that record, made on this host by a process that is gone, is removed; a
  `.<name>.old-<pid>-<hex>` (a crash between the two renames of a swap) goes back in place when the output is
  missing, else is removed if its record lists all it holds. Nothing else beside the output is touched.
  A job stopped by SIGTERM or Ctrl-C removes its staging directory itself (`atomic_dir` registers it with
  the signal rule of hylo/stopping.py).
* Errors name the path the user gave, not the internal temporary name (an unwritable parent, a full disk).
* A file written at a path the user named (`hylo estimate --json`, kernels-check's reports in `--out`) follows the
  same rule, checked before the work (`check_output_file`): never one of the command's inputs, never a directory,
  never over a file this project did not write (`is_own_file`: its directory's record lists it, or it is a JSON
  object with `"written_by": "hylo-pipeline"`) unless the command's `--force`; an unwritable location fails then,
  named as given. Leftovers beside an output are matched by its name literally (`o[1]` is no glob pattern).
* `file_lock(root, name)`: processes that make the same thing take turns (an `fcntl` lock on root/.<name>.lock).
* Files get the mode the umask gives (`honour_umask`): safetensors >= 0.8 writes through a temporary
  file of mode 0600 and renames it (safetensors#782), so model.safetensors (also through transformers'
  save_pretrained) was unreadable to the other users of a shared machine. Every atomic write and
  directory swap here sets such a file to 0o666 & ~umask, as a plain `open()` would have.
* `read_json(path, error)`: the JSON value of a file, or `error` naming the file when it is not JSON.
* `confined_paths(root, entries, manifest, field)`: the files a manifest, a checkpoint index or a run's record
  names, each resolved and confined to its own directory `root` before anything of them is read: no absolute
  path, no `..`, no symbolic link that leads out of `root`, no file named twice (a link to another entry
  included). The error names the manifest, the entry and why.
* `check_safetensors(path)` reads only the 8-byte length and the JSON header of a .safetensors file and
  checks that the tensors it lists cover the file exactly (what safetensors itself requires, but its
  error names no file). `check_weights_dir(dir)` does it for every .safetensors file of a model directory.
* `copy_tokenizer_files(src, dst)`: the files of a Hugging Face tokenizer directory, copied as files (both
  checkpoint layouts, hylo/io.py and hylo/released/export.py, write them).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------ atomic writes


def temp_name(path: str | Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside `path`: `.<name>.<kind>-<pid>-<hex>` (same directory, so renaming it
    onto `path` is atomic; the pid says which process owns it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """This process's umask (Linux: read from /proc, so no other thread ever sees it changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


# the mode a temporary file is created with (tempfile, and the Rust tempfile crate safetensors uses)
_TEMP_FILE_MODE = 0o600


def honour_umask(path: str | Path) -> None:
    """Give a file of mode 0600 (a temporary file's), or every such file below a directory, the mode a new
    file gets from the umask (0o666 & ~umask, e.g. 0644): what `open()` would have made. Other modes are left."""
    p = Path(path)
    want = 0o666 & ~current_umask()
    if want == _TEMP_FILE_MODE:
        return
    for f in (p.rglob("*") if p.is_dir() else [p]):
        try:
            st = f.lstat()
            if f.is_file() and not f.is_symlink() and (st.st_mode & 0o777) == _TEMP_FILE_MODE:
                os.chmod(f, want)
        except OSError:
            continue


@contextlib.contextmanager
def atomic_path(path: str | Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` for the caller (or a library) to write; when the block ends
    normally it is renamed onto `path` (flushed to disk first with `fsync`), when it raises it is removed
    and `path` is untouched; an OSError naming the temporary file names `path` instead."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        if fsync:
            _fsync(tmp)
        honour_umask(tmp)
        os.replace(tmp, path)
    except OSError as e:
        # the error names the output, never the temporary name (an unwritable directory, a full disk)
        _renamed(e, tmp, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes, fsync: bool = False) -> None:
    """Write `data` (text is UTF-8) to `path` atomically (see `atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def file_lock(root: str | Path, name: str) -> Iterator[None]:
    """Hold an exclusive `fcntl` lock on root/.<name>.lock (made, with root, if missing) for the block: processes
    that ask for the same name take turns. The lock goes with the process, so a killed holder blocks no one."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_path(p: Path) -> None:
    """Delete a file, a link or a directory tree (whatever is at `p`; nothing there is fine)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def replace_dir(staging: str | Path, path: str | Path) -> None:
    """Move the finished directory `staging` to `path` (same parent directory). A previous `path` is
    renamed aside first and deleted only after; if the second rename fails it is put back."""
    staging, path = Path(staging), Path(path)
    if not (path.exists() or path.is_symlink()):
        os.replace(staging, path)
        return
    old = temp_name(path, "old")
    os.replace(path, old)
    try:
        os.replace(staging, path)
    except OSError:
        os.replace(old, path)
        raise
    remove_path(old)


# the record of the entries of an output directory this project wrote (what it may later replace)
OUTPUT_RECORD = ".hylo-output.json"
WRITTEN_BY = "hylo-pipeline"


class ForeignOutputError(FileExistsError):
    """An output directory holds entries this project did not write; the message names them."""


class OutputConflictError(ValueError):
    """An output path is one of the job's inputs, lies inside one or holds one; the message names both."""


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def check_not_an_input(out: str | Path, inputs: Iterable[tuple[str, str | Path | None]],
                       what: str = "--out") -> None:
    """Refuse output `out` when it is, lies inside, or holds one of `inputs` ((option, path) pairs; None or a
    path that does not exist skipped), links followed: writing it would replace or change the input the job
    reads."""
    o = _real(out)
    for option, src in inputs:
        if src is None or os.fspath(src) == "" or not Path(src).expanduser().exists():
            # a missing input is the reader's error to report, not a conflict
            continue
        i = _real(src)
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
        raise OutputConflictError(f"{what} {out} {how} {option} {src}{same}: {why}; choose another {what}")


def output_target(path: str | Path) -> Path:
    """Where output `path` is written: the directory a symbolic link points to (followed to the end, the
    link itself is kept), else `path` (`~` expanded)."""
    p = Path(path).expanduser()
    return _real(p) if p.is_symlink() else p


def _shown(path: str | Path) -> str:
    """`path` as given, plus "(a link to TARGET)" for a symbolic link."""
    p = Path(path).expanduser()
    return f"{path} (a link to {_real(p)})" if p.is_symlink() else f"{path}"


def recorded_entries(path: str | Path) -> set[str] | None:
    """The entries the record of directory `path` lists (None: it has no readable record of ours)."""
    try:
        data = json.loads((Path(path) / OUTPUT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        return None
    return set(entries)


def foreign_entries(path: str | Path, owned: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Entries of existing directory `path` that this project did not write: listed neither by its
    record (`OUTPUT_RECORD`) nor in `owned` (what another record of ours, e.g. a dataset manifest, lists)."""
    ours = (recorded_entries(path) or set()) | set(owned) | {OUTPUT_RECORD}
    return sorted(p.name for p in Path(path).iterdir() if p.name not in ours)


def check_replaceable(path: str | Path, what: str = "output directory",
                      owned: frozenset[str] | set[str] = frozenset()) -> None:
    """Refuse to replace `path` unless it is missing, an empty directory, or a directory whose every entry a
    record of ours lists (`foreign_entries`); `what` names the option in the message. A symbolic link is
    followed (`output_target`): what it points to is checked."""
    shown = _shown(path)
    p = output_target(path)
    if not (p.exists() or p.is_symlink()):
        return
    if not p.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory; it is never replaced: remove it or "
                                 f"choose another {what}")
    foreign = foreign_entries(p, owned)
    if not foreign:
        return
    names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    why = ("its record .hylo-output.json does not list them" if recorded_entries(p) is not None or owned else
           "it has no .hylo-output.json: this project did not write it")
    raise ForeignOutputError(f"{what} {shown} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} this "
                             f"project did not write ({names}; {why}); it only ever replaces its own outputs: "
                             f"move them away, or choose another {what}")


def check_own_files(directory: str | Path, names: Iterable[str], what: str = "output directory") -> None:
    """Refuse to write files `names` into existing `directory` (a job that adds files to a directory rather
    than replacing it: eval's results.json) when one of them is there and no record of ours lists it: a file
    of the user's of the same name is never overwritten."""
    shown = _shown(directory)
    d = output_target(directory)
    if not (d.exists() or d.is_symlink()):
        return
    if not d.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory: choose another {what}")
    ours = recorded_entries(d)
    foreign = [n for n in names if ((d / n).exists() or (d / n).is_symlink()) and n not in (ours or set())]
    if not foreign:
        return
    why = ("its record .hylo-output.json does not list " + ("it" if len(foreign) == 1 else "them") if ours is not None
           else "it has no .hylo-output.json")
    raise ForeignOutputError(f"{what} {shown} holds {', '.join(foreign)}, which this project did not write ({why}); "
                             f"it never overwrites a file it did not write: move {'it' if len(foreign) == 1 else 'them'}"
                             f" away, or choose another {what}")


def record_files(directory: str | Path, names: Iterable[str]) -> None:
    """Add `names` to the record of `directory` (`OUTPUT_RECORD`, made when missing): files this project wrote
    there, which it may later overwrite (`check_own_files`) or replace with the directory (`check_replaceable`)."""
    d = output_target(directory)
    try:
        data = json.loads((d / OUTPUT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or recorded_entries(d) is None:
        data = {"written_by": WRITTEN_BY, "entries": []}
    data["entries"] = sorted(set(data["entries"]) | set(names))
    atomic_write(d / OUTPUT_RECORD, json.dumps(data, indent=1) + "\n")


# a JSON file larger than this is never one of our small reports (`is_own_file` does not read it)
_OWN_JSON_MAX_BYTES = 64 << 20


def is_own_file(path: str | Path) -> bool:
    """Whether this project wrote file `path`: the record of its directory (`OUTPUT_RECORD`) lists it, or it is a
    JSON object that says so itself (`"written_by": "hylo-pipeline"`, as a `--json` report beside a user's
    files is marked). A symbolic link is never ours."""
    p = Path(path).expanduser()
    if p.is_symlink() or not p.is_file():
        return False
    if p.name in (recorded_entries(p.parent) or set()):
        return True
    try:
        if p.stat().st_size > _OWN_JSON_MAX_BYTES:
            return False
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == WRITTEN_BY


def check_output_file(path: str | Path, what: str, inputs: Iterable[tuple[str, str | Path | None]] = (),
                      force: bool = False, force_flag: str = "--force") -> None:
    """The one rule for a file a command writes at a path the user named (`--json FILE`, a report in `--out`),
    checked before any work: it is never one of the command's `inputs` ((option, path) pairs,
    `check_not_an_input`), never a directory, and an existing file this project did not write (`is_own_file`)
    is refused unless `force` (the command's `force_flag`). Its directory is made and a file is created in it
    and removed, so that an unwritable location fails now; errors name the path as given (`what`: the option).
    What a killed writer of it left (`.<name>.tmp-<pid>-<hex>`) is removed (`sweep_temp_files`)."""
    shown = _shown(path)
    p = Path(path).expanduser()
    check_not_an_input(p, inputs, what)
    if p.is_dir() and not p.is_symlink():
        raise ForeignOutputError(f"{what} {shown} is a directory: give the name of a file to write")
    if (p.exists() or p.is_symlink()) and not force and not is_own_file(p):
        why = ("a symbolic link" if p.is_symlink() else f"no {OUTPUT_RECORD} beside it lists it, and it carries no "
               f"\"written_by\": \"{WRITTEN_BY}\"")
        raise ForeignOutputError(f"{what} {shown} exists and this project did not write it ({why}); it never "
                                 f"overwrites a file it did not write: move it away, choose another {what}, or pass "
                                 f"{force_flag} to replace it")
    _writable_parent(p, shown, what)
    probe = temp_name(p)
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _TEMP_FILE_MODE))
    except OSError as e:
        raise OSError(e.errno, f"cannot write it ({e.strerror or e})", f"{what} {shown}") from None
    probe.unlink(missing_ok=True)
    sweep_temp_files(p.parent, [p.name])


def check_own_directory(path: str | Path, what: str, markers: Iterable[str] = (), choose: str = "") -> None:
    """Refuse to work in existing directory `path` (a resumable store a job adds to: a training run's or a
    multi-step run's directory) unless it is empty, carries our record (`OUTPUT_RECORD`) or holds one of
    `markers` (entries only this project writes there, for a directory made before the record): nothing is
    written into a directory of the user's. `what` names the option, `choose` what to change instead."""
    shown = _shown(path)
    d = output_target(path)
    if not (d.exists() or d.is_symlink()):
        return
    if not d.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory: choose another {choose or what}")
    if recorded_entries(d) is not None or any((d / m).exists() for m in markers):
        return
    found = sorted(p.name for p in d.iterdir())
    if found:
        names = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ForeignOutputError(
            f"{what} {shown} holds {len(found)} entr{'y' if len(found) == 1 else 'ies'} and no {OUTPUT_RECORD} "
            f"({names}): this project did not make it, and writes only into directories of its own: move them "
            f"away, or choose another {choose or what}")


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
        data = json.loads((d / OUTPUT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY else None


def stale_leftovers(path: str | Path) -> tuple[list[Path], list[Path]]:
    """What killed jobs left beside output `path`: (ours to remove, others of the same name pattern that are
    not provably ours and are left alone). A staging directory is ours when it carries our staging record,
    made on this host by a process that is gone; an `.old-` one when its process is gone and its record
    lists all it holds."""
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
                    rec is not None and not foreign_entries(d)))
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


def _writable_parent(path: Path, shown: str, what: str) -> None:
    """Create the parent of output `path`; an error names the output as given, not a temporary name. Under the
    signal rule (hylo/stopping.py, looked up: this module stays a leaf) the folders made are removed on a signal
    while still empty."""
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


def _renamed(e: OSError, tmp: Path, path: Path) -> OSError:
    """`e` with the temporary directory's name in its file names replaced by the output's."""
    for attr in ("filename", "filename2"):
        value = getattr(e, attr)
        if isinstance(value, str | os.PathLike) and os.fspath(value).startswith(os.fspath(tmp)):
            setattr(e, attr, os.fspath(path) + os.fspath(value)[len(os.fspath(tmp)):])
    return e


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
def atomic_dir(path: str | Path, what: str = "output directory",
               owned: frozenset[str] | set[str] = frozenset()) -> Iterator[Path]:
    """Yield a new empty directory beside `path` to fill; when the block ends normally it replaces
    `path` (`replace_dir`), when it raises it is deleted and `path` is untouched. The new directory gets
    the record of its entries (`OUTPUT_RECORD`); an existing `path` holding anything no record of ours
    lists is refused before the block runs and again before the swap (`check_replaceable`; `owned`:
    entries another record of ours lists, `what`: the option, for the message). A link is followed
    (`output_target`); what a killed run of the same output left is removed first (`sweep_stale`)."""
    shown = _shown(path)
    given = Path(path).expanduser()
    path = output_target(path)
    check_replaceable(given, what, owned)
    _writable_parent(path, shown, what)
    sweep_stale(path)
    tmp = temp_name(path)
    # removed should a signal stop the job (the `finally` below does it on the way out): the signal rule,
    # hylo/stopping.py, is loaded when a job runs under it (looked up, not imported: this module stays a leaf)
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
        entries = sorted(p.name for p in tmp.iterdir() if p.name != OUTPUT_RECORD)
        atomic_write(tmp / OUTPUT_RECORD, json.dumps({"written_by": WRITTEN_BY, "entries": entries},
                                                     indent=1) + "\n")
        check_replaceable(given, what, owned)
        honour_umask(tmp)
        replace_dir(tmp, path)
    except OSError as e:
        _renamed(e, tmp, path)
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


# ------------------------------------------------------------------------------------ JSON files


# Nesting levels of a JSON file a job reads (a model's config.json or tokenizer.json nests at most 6, a chat
# record 4); a YAML config's bound is the same (hylo/yaml_limits.py).
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_too_deep(text: str) -> int | None:
    """The line where JSON `text` nests deeper than `MAX_JSON_DEPTH` levels, else None: one scan of the brackets
    outside strings, no recursion (json.loads of a file 200,000 levels deep ends in a RecursionError)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return None
    bare = _JSON_STRING.sub('""', text)  # brackets inside strings do not nest (a string holds no newline)
    depth = 0
    for m in _JSON_BRACKET.finditer(bare):
        if m.group() in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return bare.count("\n", 0, m.start()) + 1
        else:
            depth -= 1
    return None


def loads_json(text: str | bytes, where: str, error: type[Exception] = ValueError) -> Any:
    """`json.loads(text)` of the file (or record) `where`, its depth bounded first: invalid JSON, bytes that are
    not UTF-8 or nesting past `MAX_JSON_DEPTH` raise `error("<where>...")`. Every reader of a user's JSON file
    uses it (through `read_json`)."""
    try:
        if isinstance(text, bytes | bytearray):
            text = text.decode("utf-8")
        line = json_too_deep(text)
        if line is not None:
            raise error(f"{where} line {line}: nested more than {MAX_JSON_DEPTH} levels deep")
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{where}: not valid JSON ({e})") from None


def read_json(path: str | os.PathLike | Any, error: type[Exception] = ValueError, mapping: bool = False) -> Any:
    """The JSON value of file `path` (a path, or any object with `read_text()` such as a storage
    location). A file that is not valid JSON or not UTF-8 raises `error("<path>: not valid JSON (...)")`,
    and with `mapping` one whose top level is not an object raises `error` too. A missing file raises
    FileNotFoundError: what its absence means is the caller's to say. Its depth is bounded (`loads_json`)."""
    src = path if hasattr(path, "read_text") else Path(path)
    try:
        text = src.read_bytes() if isinstance(src, Path) else src.read_text()
    except UnicodeDecodeError as e:
        raise error(f"{src}: not valid JSON ({e})") from None
    data = loads_json(text, str(src), error)
    if mapping and not isinstance(data, dict):
        raise error(f"{src}: the top level must be an object")
    return data


# ------------------------------------------------------------------------------------ files a manifest names


def _confinement_problem(entry: Any, root_real: Path, root: Path, seen: dict[Path, str], links: bool) -> str | None:
    """Why `entry` (a path a manifest of directory `root` names) may not be read as one of its files, else None.
    `links`: resolve symbolic links (a local directory), else only the names (an object store has no links)."""
    if not isinstance(entry, str) or not entry.strip():
        return "is not a relative file name"
    if "\x00" in entry:
        return "holds a NUL character"
    if os.path.isabs(entry):
        return "is an absolute path"
    if ".." in entry.split("/"):
        return "climbs out of its directory ('..')"
    real = Path(os.path.realpath(root / entry) if links else os.path.normpath(root_real / entry))
    if real == root_real:
        return "names the directory itself, not a file in it"
    if not real.is_relative_to(root_real):
        return f"is a symbolic link to {real}, outside {root}"
    if real in seen:
        return f"is the same file as entry {seen[real]!r} (listed twice)"
    seen[real] = entry
    return None


def confined_paths(root: str | Path, entries: Iterable[Any], manifest: str | Path | Any, field: str,
                   error: type[Exception] = ValueError, links: bool = True) -> list[Path]:
    """`root / entry` for each path `entries` that `manifest` (a file of directory `root`: a dataset's or a teacher
    cache's manifest, a checkpoint's) lists in its field `field`, each checked first: relative, no `..`, resolved
    (links followed) inside `root`, and no file listed twice. Raises `error` naming the manifest, the entry and
    why, before any of them is read. A missing file is the caller's to report. `links=False`: `root` is a path
    of an object store (no symbolic links there; the names alone are checked)."""
    root = Path(root)
    root_real = Path(os.path.realpath(root) if links else os.path.normpath(root))
    seen: dict[Path, str] = {}
    out = []
    for i, entry in enumerate(entries):
        why = _confinement_problem(entry, root_real, root, seen, links)
        if why is not None:
            raise error(f"{manifest}: {field}[{i}] {entry!r} {why}: a manifest may name only files inside its own "
                        f"directory {root}, each once; nothing was read from it (write it again, or restore the "
                        f"files it lists)")
        out.append(root / entry)
    return out


# ------------------------------------------------------------------------------------ weight files

# safetensors refuses headers above 100 MB; a larger length means the file is not safetensors.
# What a Hugging Face tokenizer directory may hold (copied as files; nothing is loaded or executed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "added_tokens.json")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of directory `src` into `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


MAX_HEADER_BYTES = 100_000_000


class WeightsFileError(ValueError):
    """A weights file is truncated or corrupt; the message names the file."""


def check_safetensors(path: str | Path) -> None:
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsFileError(f"{p}: truncated safetensors file ({size} bytes, no header)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise WeightsFileError(f"{p}: not a complete safetensors file (header of {n} bytes, file of {size} "
                                   "bytes): truncated or corrupt; download or convert it again")
        try:
            header = loads_json(f.read(n), "header", ValueError)
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise WeightsFileError(f"{p}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    need = 8 + n + max(ends, default=0)
    if need != size:
        what = "truncated" if need > size else "has trailing bytes"
        raise WeightsFileError(f"{p}: {what}: its tensors need {need} bytes, the file has {size}; "
                               "download or convert it again")


def check_weights_dir(directory: str | Path) -> None:
    """Check every .safetensors file of a model directory (a missing directory is left to the loader)."""
    d = Path(directory)
    if d.is_dir():
        for f in sorted(d.glob("*.safetensors")):
            check_safetensors(f)
