"""One rule for signals: a command that starts child processes or writes temporary files stops cleanly on
SIGTERM and SIGINT (Ctrl-C).

    with stopping("hylo kernels-check"):           # job_main(stops=True) does this for a job
        work = track_temp(tempfile.mkdtemp())       # removed should a signal stop the command
        out = make_dir(args.out)                    # removed on a signal while it is still empty
        proc = popen([sys.executable, ...])         # its own process group, ended with the command

What a signal does inside the block, in this order:
* the process group of every child started with `popen` gets the same signal (a child of ours then runs
  its own cleanup: a training step checkpoints on SIGTERM), then SIGKILL after `grace_s`;
* `Stopped` (a KeyboardInterrupt) is raised in the main thread, so every `finally` and `with` on the way
  out runs: `atomic_dir` drops its staging directory, a runner stops its Ray, a run lock is released;
* at the block's end the temporary paths still there are removed, and the directories `make_dir` created
  that are still empty; then one line on stderr, `hylo kernels-check: stopped by SIGTERM; ended 1 child,
  removed /tmp/kernels-check-x1`, and exit status 128 + the signal (143, Ctrl-C 130).

Design choices:
* The children get a process group of their own: a signal to the command (a scheduler's SIGTERM, which
  reaches one process) would otherwise leave them running as orphans; the group takes their own children
  (a compile's workers) with them. Ctrl-C on a terminal reaches the command only, which forwards it.
* The children are ended inside the signal handler, before anything unwinds: `with subprocess.Popen(...)`
  waits for its child when an exception passes, which would hang on a child no one stopped.
* A second signal while the children are given their grace ends them at once (SIGKILL).
* Python prints and drops an exception raised inside a finalizer (`__del__`, run by the garbage collector
  whenever): a signal that comes there is sent again once the finalizer returned. No child starts once a
  signal came.
* No handler is installed outside the main thread or outside the block; a handler the block replaced is
  put back at its end. `ray.init` installs its own SIGTERM handler: `reclaim()` (called after it by
  `pipeline/ray_init.py` and the rehearsal's simulated cluster) puts the rule's back.
* The training jobs keep their own SIGTERM handling (a final checkpoint, pipeline/train/driver.py): they
  are not run under this rule, but as a child of a command that is, they get its signal first.
* Only what the command made is removed: temporary paths it registered (`hylo.outputs.atomic_dir` registers
  its staging directory), and directories `make_dir` created, only while empty. This module imports
  nothing of the project, nor torch or Ray.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# how long a child may take to end after the forwarded signal before it is killed: more than a training
# step's final checkpoint on SIGTERM may take (checkpoint.preempt_grace_s, 25 s by default)
GRACE_S = 30.0


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT stopped a command running under `stopping` (a KeyboardInterrupt, so that code which
    lets Ctrl-C pass lets this pass too)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signal_name(signum: int) -> str:
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


def _exited(pid: int) -> bool:
    """The child `pid` has ended (it is not reaped: its Popen still gets its exit status)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether the interrupted code runs inside a `__del__` (where a raised exception is only printed)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class Stopping:
    """The state of one command under the rule (see the module docstring); use `stopping(name)`."""

    def __init__(self, name: str, grace_s: float = GRACE_S) -> None:
        self.name, self.grace_s = name, grace_s
        self.children: list[subprocess.Popen] = []
        self.temps: list[Path] = []
        self.made: list[Path] = []
        self.signum: int | None = None
        # the temporary paths there when the signal came (their owners may remove them on the way out)
        self.present: list[Path] = []
        self.ended = 0
        self._deferred = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        self._installed = False

    # ------------------------------------------------------------------ what the command registers
    def popen(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        # no new child once a signal came
        self.check()
        proc = subprocess.Popen(cmd, process_group=0, **kwargs)
        self.children.append(proc)
        return proc

    def track_temp(self, path: Path) -> None:
        self.temps.append(path)

    def forget(self, path: Path) -> None:
        self.temps = [p for p in self.temps if p != path]
        self.made = [p for p in self.made if p != path]

    def make_dir(self, path: Path) -> None:
        missing = []
        p = path.absolute()
        while not (p.exists() or p.is_symlink()) and p != p.parent:
            missing.append(p)
            p = p.parent
        path.mkdir(parents=True, exist_ok=True)
        # deepest first: the order they are removed in
        self.made.extend(missing)

    # ------------------------------------------------------------------ the signal
    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and not self._deferred:
            # a second signal: no more grace
            for proc in self._running():
                _signal_group(proc.pid, signal.SIGKILL)
            return
        if self.signum is None:
            self.signum = signum
            self.present = [p for p in self.temps if p.exists() or p.is_symlink()]
            self.end_children(signum)
        self._deferred = _in_finalizer(frame)
        if self._deferred:
            # Python ignores an exception raised in a finalizer (a `__del__` the garbage collector ran when the
            # signal came): the signal is sent again once it returned
            self._timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            self._timer.daemon = True
            self._timer.start()
            return
        raise Stopped(signum)

    def check(self) -> None:
        """Raise `Stopped` if a signal came and its exception was lost (caught by code on the way)."""
        if self.signum is not None:
            raise Stopped(self.signum)

    def _running(self) -> list[subprocess.Popen]:
        return [p for p in self.children if p.returncode is None and not _exited(p.pid)]

    def end_children(self, signum: int) -> None:
        """Forward `signum` to every running child's process group; SIGKILL the groups after the grace."""
        running = self._running()
        for proc in running:
            _signal_group(proc.pid, signum)
        deadline = time.monotonic() + self.grace_s
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in running:
            # the whole group, also when its leader has ended: what it started goes with it
            _signal_group(proc.pid, signal.SIGKILL)
        self.ended += len(running)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            self._previous.setdefault(s, signal.getsignal(s))
            signal.signal(s, self._handler)
        self._installed = True

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._installed = False

    # ------------------------------------------------------------------ the end
    def clean_up(self) -> list[Path]:
        """Remove the temporary paths still there and the directories `make_dir` created that are empty;
        returns what is gone of them (also what an owner's `finally` removed on the way out)."""
        present = self.present + [p for p in self.temps if p not in self.present and (p.exists() or p.is_symlink())]
        for p in self.temps:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        removed = [p for p in present if not (p.exists() or p.is_symlink())]
        for p in self.made:
            with contextlib.suppress(OSError):
                p.rmdir()  # only an empty one
                removed.append(p)
        return removed

    def message(self, removed: list[Path]) -> str:
        assert self.signum is not None
        parts = []
        if self.ended:
            parts.append(f"ended {self.ended} child{'ren' if self.ended > 1 else ''}")
        if removed:
            parts.append("removed " + ", ".join(str(p) for p in removed))
        return f"{self.name}: stopped by {_signal_name(self.signum)}" + ("; " + ", ".join(parts) if parts else "")


_active: Stopping | None = None


@contextlib.contextmanager
def stopping(name: str, grace_s: float = GRACE_S) -> Iterator[Stopping]:
    """Run the block under the rule (module docstring); `name` starts the message (`hylo kernels-check`).
    A signal ends the block with SystemExit(128 + signal) after the cleanup and the one line."""
    global _active
    if _active is not None:
        # a command run by another in this process (a job's main called from a test): the outer rule holds
        yield _active
        return
    rule = _active = Stopping(name, grace_s)
    rule.install()
    try:
        yield rule
    except BaseException as e:
        if rule.signum is None and isinstance(e, KeyboardInterrupt):
            # a KeyboardInterrupt raised without the handler (a test, a library): Ctrl-C all the same
            rule.signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            rule.end_children(rule.signum)
        if rule.signum is None:
            raise
        # after a signal, whatever ended the block (the Stopped, or an error it became on the way) ends as the
        # signal's one line
    finally:
        _active = None
        if rule.signum is None:
            rule.uninstall()
    if rule.signum is None:
        return
    # (also when code in the block caught the Stopped and the block ended normally)
    _finish(rule)


def _finish(rule: Stopping) -> None:
    assert rule.signum is not None
    if rule._timer is not None:
        rule._timer.cancel()
    # a signal while cleaning up changes nothing more
    for s in SIGNALS:
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_IGN)
    try:
        if rule._running():
            rule.end_children(signal.SIGKILL)
        removed = rule.clean_up()
        sys.stdout.flush()
        print(rule.message(removed), file=sys.stderr, flush=True)
    finally:
        for s, previous in rule._previous.items():
            with contextlib.suppress(ValueError):
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
    raise SystemExit(128 + rule.signum)


# ---------------------------------------------------------------------- for code that may run under the rule
def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kwargs)`; under the rule the child gets its own process group and is ended
    with the command."""
    if _active is None:
        return subprocess.Popen(cmd, **kwargs)
    return _active.popen(cmd, **kwargs)


def end_process(proc: subprocess.Popen) -> None:
    """SIGKILL a child and, if it leads a process group of its own (`popen` under the rule), that group."""
    try:
        own_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    if own_group:
        _signal_group(proc.pid, signal.SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def track_temp(path: str | os.PathLike) -> Path:
    """Register a temporary file or directory (removed should a signal stop the command); returns it."""
    p = Path(path)
    if _active is not None:
        _active.track_temp(p)
    return p


def forget(path: str | os.PathLike) -> None:
    """`path` is no longer temporary (it was renamed into place, or its owner removed it)."""
    if _active is not None:
        _active.forget(Path(path))


def make_dir(path: str | os.PathLike) -> Path:
    """`mkdir -p path`; under the rule, the directories this made are removed on a signal while empty."""
    p = Path(path)
    if _active is None:
        p.mkdir(parents=True, exist_ok=True)
    else:
        _active.make_dir(p)
    return p


def reclaim() -> None:
    """Put the rule's handlers back after a library replaced them (`ray.init` installs its own SIGTERM one)."""
    if _active is not None and _active._installed and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _active._handler)
