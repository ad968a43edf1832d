"""The files a manifest names, each confined to the manifest's own directory before anything is read.

`confined_paths(root, entries, manifest, field)`: the files a manifest, a checkpoint index or a run's record
names, each resolved and confined to its own directory `root`. No absolute path, no `..`, no symbolic link
that leads out of `root`, no file named twice (a link to another entry included). The error names the
manifest, the entry and why. A leaf: it imports nothing of the project.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


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
