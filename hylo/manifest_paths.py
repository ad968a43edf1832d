"""The files a manifest names, each confined to the manifest's own directory before anything is read.

`confined_paths(root, entries, manifest, field)`: the files a manifest, a checkpoint index or a run's record
names, each resolved and confined to its own directory `root`. No absolute path, no `..`, no `.` or empty
part (`shard/.` is not the shard), no symbolic link that leads out of `root`, no file named twice (a link to
another entry included), nothing that is not a regular file (a directory or a FIFO where a shard should be is
named as what it is, never as "missing"). The error names the manifest, the entry and why.

`own_file(root, name, error, what)`: the manifest itself (`root/manifest.json`), refused when it is a link that
leads out of `root` (another dataset's manifest read as this one's) or not a regular file.

A leaf: it imports only the leaf hylo/bounded_read.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hylo.bounded_read import not_regular


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
    if any(part in ("", ".") for part in entry.split("/")):
        return "has a '.' or an empty part (name the file itself: 'shard-00000.parquet', not 'shard-00000.parquet/.')"
    if not real.is_relative_to(root_real):
        return f"is a symbolic link to {real}, outside {root}"
    if real in seen:
        return f"is the same file as entry {seen[real]!r} (listed twice)"
    if links and (kind := not_regular(root / entry)) is not None:
        return f"is {kind}, not a file"
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


def own_file(root: str | Path, name: str, error: type[Exception] = ValueError, what: str = "manifest") -> Path:
    """`root / name`, the file of directory `root` that describes it (a dataset's or a cache's manifest.json),
    checked before it is read: a symbolic link that leads out of `root` (another dataset's manifest, read as this
    one's) or something that is not a regular file raises `error` naming it. A missing file is the caller's."""
    root = Path(root)
    p = root / name
    real, root_real = Path(os.path.realpath(p)), Path(os.path.realpath(root))
    if os.path.lexists(p) and not real.is_relative_to(root_real):
        raise error(f"{p}: the {what} is a symbolic link to {real}, outside {root}: a directory's {what} is its own "
                    f"file; nothing was read from it (copy the {what} in, or point at the directory it belongs to)")
    if (kind := not_regular(p)) is not None:
        raise error(f"{p}: the {what} is {kind}, not a file; nothing was read from it")
    return p
