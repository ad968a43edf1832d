"""Output ownership: only what this project wrote is ever replaced or overwritten.

* `atomic_dir` (hylo/outputs.py) writes the record `.hylo-output.json` (`OUTPUT_RECORD`: the entries it wrote)
  into each directory it makes; `check_replaceable` refuses to replace an existing directory holding anything
  its record does not list: a user's notes.txt in `--out`, or a directory this project never wrote, is named
  and left alone (`ForeignOutputError`).
* A job that adds files to a directory instead of replacing it (eval's results.json / results.md) overwrites
  only files the directory's record lists (`check_own_files`) and adds what it wrote to it (`record_files`).
* A resumable store a job adds to (a training run's directory) must be empty, ours, or hold one of our
  markers (`check_own_directory`).
* `is_own_file`: a file its directory's record lists, or a JSON object with `"written_by": "hylo-pipeline"`.
* A symbolic link given as an output directory is followed (`output_target`): the checks apply to the
  directory it points to, the link stays; messages name the path as given ("(a link to ...)", `shown_path`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from hylo.atomic import atomic_write

# the record of the entries of an output directory this project wrote (what it may later replace)
OUTPUT_RECORD = ".hylo-output.json"
WRITTEN_BY = "hylo-pipeline"


class ForeignOutputError(FileExistsError):
    """An output directory holds entries this project did not write; the message names them."""


def real_path(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def output_target(path: str | Path) -> Path:
    """Where output `path` is written: the directory a symbolic link points to (followed to the end, the
    link itself is kept), else `path` (`~` expanded)."""
    p = Path(path).expanduser()
    return real_path(p) if p.is_symlink() else p


def shown_path(path: str | Path) -> str:
    """`path` as given, plus "(a link to TARGET)" for a symbolic link."""
    p = Path(path).expanduser()
    return f"{path} (a link to {real_path(p)})" if p.is_symlink() else f"{path}"


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
    shown = shown_path(path)
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
    shown = shown_path(directory)
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


def check_own_directory(path: str | Path, what: str, markers: Iterable[str] = (), choose: str = "") -> None:
    """Refuse to work in existing directory `path` (a resumable store a job adds to: a training run's or a
    multi-step run's directory) unless it is empty, carries our record (`OUTPUT_RECORD`) or holds one of
    `markers` (entries only this project writes there, for a directory made before the record): nothing is
    written into a directory of the user's. `what` names the option, `choose` what to change instead."""
    shown = shown_path(path)
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
