"""Output ownership, proven by a record: only what this project wrote, as it wrote it, is ever replaced.

* Every directory this project writes carries the record `.hylo-output.json` (`OUTPUT_RECORD`): its entries,
  and below them every file with its size (and its sha256 when it is at most `HASH_MAX_BYTES`: cheap to read
  again) and every folder (`write_record`; `atomic_dir` of hylo/outputs.py writes it into each directory it
  makes). An entry is ours (`unproven` finds none of it) only when the record lists it and what it holds is what
  the record says: the same files, of the recorded size (and hash), and no file or folder the record does not
  list. A file the record lists that is gone is no objection: nothing of the user's would be lost.
* `check_replaceable` refuses to replace a directory holding anything not proven ours (a user's notes.txt in
  `--out`, a file of ours the user edited, a logo dropped into a built site's assets/), naming it
  (`ForeignOutputError`). Without a record nothing is ours: a directory is never taken for an earlier output
  by the names it holds. A record of an older version (entries without sizes) proves no content either.
* A job that adds files to a directory instead of replacing it (eval's results.json / results.md) overwrites
  only files the record proves ours (`check_own_files`) and records what it wrote (`record_files`).
* A resumable store a job adds to (a training run's directory, a teacher cache) must be missing, empty or carry
  our record (`check_own_directory`): nothing is written into a directory of the user's.
* `is_own_file`: a file its directory's record proves ours, or a JSON object that says so itself
  (`"written_by": "hylo-pipeline"`: a `--json` report written beside a user's files).
* A symbolic link given as an output is followed (`output_target`), dangling or not: the checks apply to
  what it points to, the link stays (`shown_path` names both: "(a link to ...)"). This is the one rule for
  links of every command that writes a path the user named (docs/troubleshooting.md, "Outputs").
* Records are read bounded like every JSON file (`hylo.json_files.read_json`); one that cannot be read is none.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hylo.atomic import atomic_write
from hylo.json_files import read_json

# the record of the entries of an output directory this project wrote (what it may later replace)
OUTPUT_RECORD = ".hylo-output.json"
WRITTEN_BY = "hylo-pipeline"
# a file at most this large is recorded with its sha256 (read again to prove it unchanged); a larger one by size
HASH_MAX_BYTES = 1 << 20
# a record is read only up to this (a built site's: about 300 files, 60 KB)
RECORD_MAX_BYTES = 16 << 20


class ForeignOutputError(FileExistsError):
    """An output directory holds entries this project did not write; the message names them."""


def real_path(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def output_target(path: str | Path) -> Path:
    """Where output `path` is written: what a symbolic link points to (followed to the end, dangling or not;
    the link itself is kept), else `path` (`~` expanded). The one rule for links of every output."""
    p = Path(path).expanduser()
    return real_path(p) if p.is_symlink() else p


def shown_path(path: str | Path) -> str:
    """`path` as given, plus "(a link to TARGET)" for a symbolic link."""
    p = Path(path).expanduser()
    return f"{path} (a link to {real_path(p)})" if p.is_symlink() else f"{path}"


# ------------------------------------------------------------------------------------ the record
def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_stamp(p: Path, st: os.stat_result) -> dict[str, Any]:
    stamp: dict[str, Any] = {"size": st.st_size}
    if st.st_size <= HASH_MAX_BYTES:
        stamp["sha256"] = _sha256(p)
    return stamp


def _inventory(d: Path, names: Iterable[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(files: relative path -> stamp, folders) of entries `names` of directory `d`, links not followed (a link
    is recorded as one, with where it points)."""
    files: dict[str, dict[str, Any]] = {}
    dirs: list[str] = []
    todo = [n for n in names if os.path.lexists(d / n)]
    while todo:
        rel = todo.pop()
        p = d / rel
        st = p.lstat()
        if stat.S_ISDIR(st.st_mode):
            dirs.append(rel)
            todo += [f"{rel}/{c}" for c in sorted(os.listdir(p))]
        elif stat.S_ISLNK(st.st_mode):
            files[rel] = {"link": os.readlink(p)}
        else:
            files[rel] = _file_stamp(p, st)
    return files, sorted(dirs)


def read_record(path: str | Path) -> dict[str, Any] | None:
    """The record of directory `path` (`OUTPUT_RECORD`), None when it has none of ours that can be read (also one
    that is not a regular file, or over `RECORD_MAX_BYTES`)."""
    try:
        data = read_json(Path(path) / OUTPUT_RECORD, ValueError, max_bytes=RECORD_MAX_BYTES)
    except (OSError, ValueError):
        return None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        return None
    return data


def recorded_entries(path: str | Path) -> set[str] | None:
    """The entries the record of directory `path` lists (None: it has no readable record of ours)."""
    rec = read_record(path)
    return None if rec is None else set(rec["entries"])


def write_record(directory: str | Path, names: Iterable[str], extra: dict[str, Any] | None = None) -> None:
    """Write the record of `directory`: entries `names` with every file (size, sha256 when small) and folder
    below them, as they are now. `extra`: more fields (kept by `record_files`)."""
    d = Path(directory)
    names = sorted(set(names) - {OUTPUT_RECORD})
    files, dirs = _inventory(d, names)
    atomic_write(d / OUTPUT_RECORD, json.dumps({**(extra or {}), "written_by": WRITTEN_BY, "entries": names,
                                                "files": dict(sorted(files.items())), "dirs": dirs}, indent=1) + "\n")


def record_files(directory: str | Path, names: Iterable[str]) -> None:
    """Add `names` (files or folders this project just wrote in `directory`) to its record, made when missing,
    each with what it holds now: the job may later overwrite (`check_own_files`) or replace them with the
    directory (`check_replaceable`)."""
    d = output_target(directory)
    names = set(names)
    rec = read_record(d)
    if rec is None:
        rec = {"entries": []}
    keep = {k: v for k, v in rec.items() if k not in ("written_by", "entries", "files", "dirs")}
    files, dirs = _inventory(d, names)
    old_files = {k: v for k, v in (rec.get("files") or {}).items() if k.split("/")[0] not in names}
    old_dirs = [x for x in (rec.get("dirs") or []) if x.split("/")[0] not in names]
    body = {**keep, "written_by": WRITTEN_BY, "entries": sorted(set(rec["entries"]) | names),
            # an entry of an older record (names only) stays unproven: its files are not listed here
            "files": dict(sorted({**old_files, **files}.items())), "dirs": sorted({*old_dirs, *dirs})}
    atomic_write(d / OUTPUT_RECORD, json.dumps(body, indent=1) + "\n")


def _stamp_problem(p: Path, want: Any) -> str | None:
    """Why the file or link at `p` is not what its record's stamp `want` says, else None."""
    if not isinstance(want, dict):
        return "not in its record"
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return None if want.get("link") == os.readlink(p) else "a link its record does not list"
    if not stat.S_ISREG(st.st_mode) or "size" not in want:
        return "not in its record"
    if st.st_size != want["size"]:
        return f"changed since this project wrote it: {st.st_size:,} bytes, its record says {want['size']:,}"
    if "sha256" in want and (st.st_size > HASH_MAX_BYTES or _sha256(p) != want["sha256"]):
        return "changed since this project wrote it: its sha256 is not the recorded one"
    return None


def unproven(path: str | Path, names: Iterable[str] | None = None) -> list[tuple[str, str]]:
    """(relative path, why) of what in directory `path` (its entries `names`, default all but the record) no
    record of ours proves this project wrote as it is: an entry the record does not list, a file or folder below
    one that it does not list, a file whose size or sha256 is not the recorded one. An entry of an older record
    (names only, no sizes) is proven by nothing. Empty: all of it is ours."""
    d = Path(path)
    if names is None:
        names = sorted(p.name for p in d.iterdir() if p.name != OUTPUT_RECORD)
    rec = read_record(d)
    if rec is None:
        return [(n, "no record") for n in names]
    listed = set(rec["entries"])
    files = rec.get("files") if isinstance(rec.get("files"), dict) else None
    dirs = set(rec.get("dirs") or [])
    out: list[tuple[str, str]] = []
    for name in names:
        if not os.path.lexists(d / name):
            continue
        if name not in listed:
            out.append((name, "not in its record"))
            continue
        if files is None:
            out.append((name, "recorded by an older version, without sizes"))
            continue
        todo = [name]
        while todo:
            rel = todo.pop()
            p = d / rel
            if p.is_dir() and not p.is_symlink():
                if rel not in dirs:
                    out.append((rel, "not in its record"))
                    continue
                todo += [f"{rel}/{c}" for c in sorted(os.listdir(p))]
            else:
                why = _stamp_problem(p, files.get(rel))
                if why is not None:
                    out.append((rel, why))
    return out


def _describe(found: list[tuple[str, str]]) -> str:
    """"a, b (not in its record); c (changed ...)": at most 5 named, the reason after each group."""
    shown = found[:5]
    groups: list[tuple[str, list[str]]] = []
    for rel, why in shown:
        if groups and groups[-1][0] == why:
            groups[-1][1].append(rel)
        else:
            groups.append((why, [rel]))
    text = "; ".join(f"{', '.join(rels)} ({why})" for why, rels in groups)
    return text + (f" and {len(found) - 5} more" if len(found) > 5 else "")


# ------------------------------------------------------------------------------------ the checks
def check_replaceable(path: str | Path, what: str = "output directory") -> None:
    """Refuse to replace `path` unless it is missing, an empty directory, or a directory whose every entry a
    record of ours proves ours (`unproven`); `what` names the option in the message. A symbolic link is
    followed (`output_target`): what it points to is checked."""
    shown = shown_path(path)
    p = output_target(path)
    if not (p.exists() or p.is_symlink()):
        return
    if not p.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory; it is never replaced: remove it or "
                                 f"choose another {what}")
    found = unproven(p)
    if not found:
        return
    if read_record(p) is None:
        n = len(found)
        raise ForeignOutputError(
            f"{what} {shown} holds {n} entr{'y' if n == 1 else 'ies'} this project did not write "
            f"({', '.join(r for r, _ in found[:5])}{f' and {n - 5} more' if n > 5 else ''}; it has no {OUTPUT_RECORD}, "
            f"and a directory is never taken for an earlier output by the names it holds); it only ever replaces its "
            f"own outputs: move them away (an output of a version before the record: delete it yourself), or choose "
            f"another {what}")
    raise ForeignOutputError(
        f"{what} {shown} holds {len(found)} entr{'y' if len(found) == 1 else 'ies'} this project did not write "
        f"as {'it is' if len(found) == 1 else 'they are'}: {_describe(found)}; it only ever replaces its own "
        f"outputs, unchanged (its record {OUTPUT_RECORD} lists every file it wrote, with its size): move them away, "
        f"or choose another {what}")


def check_own_files(directory: str | Path, names: Iterable[str], what: str = "output directory") -> None:
    """Refuse to write files `names` into existing `directory` (a job that adds files to a directory rather
    than replacing it: eval's results.json) when one of them is there and the record does not prove it ours
    (`unproven`): a file of the user's of the same name, or one of ours the user edited, is never overwritten."""
    shown = shown_path(directory)
    d = output_target(directory)
    if not (d.exists() or d.is_symlink()):
        return
    if not d.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory: choose another {what}")
    found = unproven(d, [n for n in names if os.path.lexists(d / n)])
    if not found:
        return
    one = len(found) == 1
    if read_record(d) is None:
        raise ForeignOutputError(f"{what} {shown} holds {', '.join(r for r, _ in found)}, which this project did not "
                                 f"write (it has no {OUTPUT_RECORD}); it never overwrites a file it did not write: move "
                                 f"{'it' if one else 'them'} away, or choose another {what}")
    raise ForeignOutputError(f"{what} {shown} holds {_describe(found)}, which this project did not write as "
                             f"{'it is' if one else 'they are'} (its record {OUTPUT_RECORD} lists every file it wrote, "
                             f"with its size); it never overwrites a file it did not write: move {'it' if one else 'them'}"
                             f" away, or choose another {what}")


# a JSON file larger than this is never one of our small reports (`is_own_file` does not read it)
_OWN_JSON_MAX_BYTES = 64 << 20


def is_own_file(path: str | Path) -> bool:
    """Whether this project wrote file `path` as it is: the record of its directory proves it (`unproven`), or it
    is a JSON object that says so itself (`"written_by": "hylo-pipeline"`, as a `--json` report beside a user's
    files is marked). Links are the caller's (`output_target`); a link itself is never ours."""
    p = Path(path).expanduser()
    if p.is_symlink() or not p.is_file():
        return False
    if p.name in (recorded_entries(p.parent) or set()) and not unproven(p.parent, [p.name]):
        return True
    try:
        data = read_json(p, ValueError, max_bytes=_OWN_JSON_MAX_BYTES)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == WRITTEN_BY


def check_own_directory(path: str | Path, what: str, choose: str = "", listed_only: bool = False) -> None:
    """Refuse to work in existing directory `path` (a resumable store a job adds to: a training run's or a
    multi-step run's directory, a teacher cache) unless it is empty or carries our record (`OUTPUT_RECORD`):
    nothing is written into a directory of the user's, and none is taken for ours by the names it holds. With
    `listed_only` (a store whose entries are all recorded: a teacher cache), an entry its record does not list
    is refused too; what a store's entries hold changes as it grows, so their content is not checked. `what`
    names the option, `choose` what to change instead."""
    shown = shown_path(path)
    d = output_target(path)
    if not (d.exists() or d.is_symlink()):
        return
    if not d.is_dir():
        raise ForeignOutputError(f"{what} {shown} exists and is not a directory: choose another {choose or what}")
    rec = read_record(d)
    if rec is not None:
        foreign = sorted(p.name for p in d.iterdir() if p.name not in {*rec["entries"], OUTPUT_RECORD})
        if listed_only and foreign:
            raise ForeignOutputError(
                f"{what} {shown} holds {_describe([(n, 'not in its record') for n in foreign])}, which this project "
                f"did not write; it writes only into directories of its own: move {'it' if len(foreign) == 1 else 'them'}"
                f" away, or choose another {choose or what}")
        return
    found = sorted(p.name for p in d.iterdir())
    if found:
        names = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ForeignOutputError(
            f"{what} {shown} holds {len(found)} entr{'y' if len(found) == 1 else 'ies'} and no {OUTPUT_RECORD} "
            f"({names}): this project did not make it, and writes only into directories of its own: move them "
            f"away, or choose another {choose or what}")
