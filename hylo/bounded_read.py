"""The one way a file the user names is read before it is parsed: a regular file only, at most a stated size.

    data = read_bounded(path, MAX_JSON_BYTES, MyError, "config file")

* What is not a regular file is refused before a byte is read, saying what it is: a directory, a FIFO (a
  named pipe: reading one waits for a writer), a character device (`/dev/zero`, `/dev/urandom` never end),
  a block device or a socket (`file_kind`). The file is opened non-blocking and checked again on the open
  descriptor, so a file swapped for a pipe in between is caught too.
* At most `max_bytes` are read; a larger file is refused with its size and the limit, before parsing. A
  file whose size the kernel does not report (`/proc/self/environ` says 0) is still cut at the limit.
* A missing file raises FileNotFoundError, as `open` does: what its absence means is the caller's to say.

Every reader of a config (YAML), a JSON file, a manifest and an output record goes through it
(hylo/json_files.py, pipeline/config.py). A leaf: it imports nothing of the project (configs use it).
"""

from __future__ import annotations

import errno
import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symbolic link"))


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str | os.PathLike) -> str | None:
    """What `path` is (links followed) when it exists and is not a regular file, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def size_text(n: int) -> str:
    """`n` bytes in words: "16 MiB", "300,000,000 bytes"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


def read_bounded(path: str | os.PathLike, max_bytes: int, error: type[Exception] = ValueError,
                 what: str = "file") -> bytes:
    """The bytes of regular file `path`, at most `max_bytes` of them (see the module docstring); anything
    else raises `error("<what> <path> is ...")`, a missing file FileNotFoundError."""
    shown = f"{what} {os.fspath(path)}"
    kind = not_regular(path)
    if kind is not None:
        raise error(f"{shown} is {kind}, not a regular file: nothing was read from it")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a FIFO without a writer on some systems)
            raise error(f"{shown} is {not_regular(path) or 'not a regular file'}, not a regular file: nothing "
                        f"was read from it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{shown} is {file_kind(st.st_mode)}, not a regular file: nothing was read from it")
        limit = f"{what} is read only up to {size_text(max_bytes)}"
        if st.st_size > max_bytes:
            raise error(f"{shown} is {size_text(st.st_size)}; a {limit}: nothing was parsed")
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:
            raise error(f"{shown} holds more than {size_text(max_bytes)}; a {limit}: nothing was parsed")
        return b"".join(chunks)
    finally:
        os.close(fd)
