"""One run at a time per run directory: `<run dir>/run.lock`, taken by the driver before Ray starts.

    with run_lock(run_loc(cfg), break_lock=args.break_lock, owner=launch):
        ...   # check the directory, convert, start Ray, fit

Design choices:
* The lock is a small JSON file naming its holder: host, pid, process start time, command and owner. The
  start time tells a reused pid apart. A torchrun rendezvous is an owner: its relaunched ranks take the lock
  back.
* On local storage the file is created with O_CREAT | O_EXCL. It is removed when the driver ends, also on
  an exception, Ctrl-C or SIGTERM.
* A lock of a dead holder is reported, never taken silently. `--break-lock` takes it over. A lock held by a
  live process of this host is never broken.
* Object stores have no create-if-absent through pyarrow. At a URI the lock is two parts: an atomic local
  lock beside the local mirror, and `run.lock` in the bucket, checked and read back. Two drivers on two
  machines that start within the same second can both pass; every other overlap is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.ownership import read_record, record_files
from hylo.pipeline.train.storage import Loc, StorageError, local_mirror

logger = get_logger(__name__)

LOCK_FILE = "run.lock"


class RunLockError(StorageError):
    """The run directory is owned by another run (or a stale lock of a dead one is in the way)."""


def _proc_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None when unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) may hold spaces: split after its closing parenthesis
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def holder_record(owner: str | None = None) -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "proc_start": _proc_start(pid),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "owner": owner,
            "command": " ".join(sys.argv)}


def holder_alive(h: dict[str, Any]) -> bool | None:
    """True / False when the holder is (not) a live process of this host; None when it is on another host."""
    if h.get("host") != socket.gethostname():
        return None
    pid = h.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start = _proc_start(pid)
    return start is None or h.get("proc_start") in (None, start)


def describe(h: dict[str, Any]) -> str:
    return (f"pid {h.get('pid')} on host {h.get('host')}, since {h.get('started')}"
            + (f" ({h['command']})" if h.get("command") else ""))


def _read(loc: Loc) -> dict[str, Any] | None:
    try:
        h = read_json(loc)
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        return {"host": "?", "pid": None, "started": "? (unreadable lock file)"}
    return h if isinstance(h, dict) else {"host": "?", "pid": None, "started": "? (unreadable lock file)"}


# The records of the locks this process holds now. A lock naming this very process (host, pid, start
# time) that is not among them was left by one of its earlier runs whose release failed (the storage
# was unreachable when that run stopped): this process may take it back.
_HELD: list[dict[str, Any]] = []


def _left_by_this_process(h: dict[str, Any]) -> bool:
    me = holder_record()
    return (all(h.get(k) == me[k] for k in ("host", "pid", "proc_start"))
            and not any(h == held for held in _HELD))


def _refuse_or_break(lock: Loc, h: dict[str, Any], run: Loc, break_lock: bool, owner: str | None,
                     say: bool = True) -> None:
    """An existing lock `h`: return when it may be replaced (this launch's own, this process's leftover,
    or --break-lock of a dead or unverifiable holder), else raise. `say`: print what is taken over."""
    if owner is not None and h.get("owner") == owner:
        return  # a torchrun relaunch of the same rendezvous: its own lock
    if _left_by_this_process(h):
        if say:
            logger.info(f"[train] {lock} was left by an earlier run of this process (its release failed); "
                        "taking it back")
        return
    alive = holder_alive(h)
    if alive:
        raise RunLockError(
            f"run directory {run} is in use by another run ({describe(h)}): two runs with the same "
            f"ray.storage_path and ray.name would overwrite each other's checkpoints, metrics and model; "
            f"wait for it to finish, or choose another ray.name")
    if break_lock:
        if say:
            logger.warning(f"[train] --break-lock: taking over {lock} from {describe(h)}")
        return
    if alive is False:
        raise RunLockError(
            f"run directory {run} holds a stale lock: its holder ({describe(h)}) is no longer running (killed "
            f"before it could release {lock.name}?). If no other run uses this directory, pass --break-lock "
            f"(or delete {lock}) and run the same command again")
    raise RunLockError(
        f"run directory {run} is locked by a run on another host ({describe(h)}); this machine cannot tell "
        f"whether it still runs. If it does not, pass --break-lock (or delete {lock})")


def check_unlocked(run: Loc, break_lock: bool = False, owner: str | None = None) -> None:
    """Before a run makes anything: a lock that `run_lock` would refuse (another live run's, a stale one without
    --break-lock) refuses the run now, with the same RunLockError, without taking or making anything. The lock
    itself is taken once every check passed (and judged again then)."""
    locks = [run / LOCK_FILE] if run.is_local else [Loc.of(local_mirror(run) / LOCK_FILE), run / LOCK_FILE]
    for lock in locks:
        h = _read(lock)
        if h is not None:
            _refuse_or_break(lock, h, run, break_lock, owner, say=False)


def _acquire_local(lock: Loc, run: Loc, record: dict[str, Any], break_lock: bool, owner: str | None) -> None:
    path = lock.local()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(record, indent=1).encode()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            h = _read(lock)
            if h is None:
                continue  # released meanwhile
            _refuse_or_break(lock, h, run, break_lock, owner)
            path.unlink(missing_ok=True)
            continue
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    raise RunLockError(f"{lock}: could not take the lock (another run keeps taking it)")


def _acquire_remote(lock: Loc, run: Loc, record: dict[str, Any], break_lock: bool, owner: str | None) -> None:
    h = _read(lock)
    if h is not None:
        _refuse_or_break(lock, h, run, break_lock, owner)
    lock.write_text(json.dumps(record, indent=1))
    back = _read(lock)
    if back != record:
        raise RunLockError(f"run directory {run}: another run took {lock} at the same time "
                           f"({describe(back or {})}); choose another ray.name or wait for it")


def _release(lock: Loc, record: dict[str, Any]) -> None:
    try:
        try:
            current = read_json(lock)
        except FileNotFoundError:
            return
        except ValueError:
            return  # not a lock this process wrote
        if current == record:
            lock.rmtree()
    except OSError as e:
        # e.g. the storage went away (the outage that stopped the run): the lock stays behind, and the
        # next start of this run reports it as stale
        first = (str(e).strip().splitlines() or [""])[0]
        logger.warning(f"[train] warning: could not remove {lock} ({type(e).__name__}: {first}); once no run "
                       "uses the directory, the next start needs --break-lock")


def _claim_new(d: Any) -> None:
    """A run directory the lock just made (it holds the lock alone, and no record): recorded as this project's at
    once (`hylo.ownership.record_files`), so that another run started now is told the directory is in use, not
    that it is someone else's, and a lock left by a killed run is reported as a stale lock."""
    if read_record(d) is None and {p.name for p in d.iterdir()} == {LOCK_FILE}:
        record_files(d, [LOCK_FILE])


@contextlib.contextmanager
def run_lock(run: Loc, break_lock: bool = False, owner: str | None = None) -> Iterator[dict[str, Any]]:
    """Hold `<run>/run.lock` for the block (see the module docstring); yields the holder record."""
    record = holder_record(owner)
    if run.is_local:
        locks = [run / LOCK_FILE]
        _acquire_local(locks[0], run, record, break_lock, owner)
        _claim_new(run.local())
    else:
        local = Loc.of(local_mirror(run) / LOCK_FILE)
        _acquire_local(local, run, record, break_lock, owner)
        locks = [local, run / LOCK_FILE]
        try:
            _acquire_remote(locks[1], run, record, break_lock, owner)
        except BaseException:
            _release(local, record)
            raise
    _HELD.append(record)
    try:
        yield record
    finally:
        _HELD.remove(record)
        for lock in reversed(locks):
            _release(lock, record)
