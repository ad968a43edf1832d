"""Atomic writes: a file or a directory is written under a temporary name beside it and renamed into place.

* `atomic_path(path)` / `atomic_write(path, data)`: a file is written under a temporary name in its own
  directory (`.<name>.tmp-<pid>-<hex>`) and renamed over `path` only when complete (`fsync=True` also
  flushes it to disk first), so a reader or a crash sees the old file or the new one, never a part;
  on an error the temporary file is removed and `path` is left as it was.
* `replace_dir(staging, path)`: a finished directory swapped in; a previous one is renamed aside
  (`.<name>.old-<pid>-<hex>`) and deleted only once the new one is in place (put back if that fails).
  hylo/outputs.py's `atomic_dir` builds such a directory for a job's output.
* Errors name the path the user gave, not the internal temporary name (`rename_in_error`).
* Files get the mode the umask gives (`honour_umask`): safetensors >= 0.8 writes through a temporary
  file of mode 0600 and renames it (safetensors#782), so model.safetensors (also through transformers'
  save_pretrained) was unreadable to the other users of a shared machine. Every atomic write and
  directory swap sets such a file to 0o666 & ~umask, as a plain `open()` would have.

A leaf: it imports nothing of the project (configs use it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


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
TEMP_FILE_MODE = 0o600


def honour_umask(path: str | Path) -> None:
    """Give a file of mode 0600 (a temporary file's), or every such file below a directory, the mode a new
    file gets from the umask (0o666 & ~umask, e.g. 0644): what `open()` would have made. Other modes are left."""
    p = Path(path)
    want = 0o666 & ~current_umask()
    if want == TEMP_FILE_MODE:
        return
    for f in (p.rglob("*") if p.is_dir() else [p]):
        try:
            st = f.lstat()
            if f.is_file() and not f.is_symlink() and (st.st_mode & 0o777) == TEMP_FILE_MODE:
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
        rename_in_error(e, tmp, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: str | bytes, fsync: bool = False) -> None:
    """Write `data` (text is UTF-8) to `path` atomically (see `atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


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


def rename_in_error(e: OSError, tmp: Path, path: Path) -> OSError:
    """`e` with the temporary directory's name in its file names replaced by the output's."""
    for attr in ("filename", "filename2"):
        value = getattr(e, attr)
        if isinstance(value, str | os.PathLike) and os.fspath(value).startswith(os.fspath(tmp)):
            setattr(e, attr, os.fspath(path) + os.fspath(value)[len(os.fspath(tmp)):])
    return e
