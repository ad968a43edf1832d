"""What the processes of a Ray session printed (Ray Train workers and controller, actors, Serve replicas), read from
the session's log files, for a test that checks a line such a process prints.

The driver's captured output is the wrong place to look: a worker's line reaches it through Ray's log forwarding
(each node's log monitor tails the worker's file and publishes the new lines; the driver prints what it gets),
which runs on its own time. Under load it lags, and a line can miss the driver altogether (a node marked dead for
missed heartbeats, a driver that disconnected first): a fresh-clone `make test` once failed so although the line
had been printed. The worker's own file (`<session>/logs/worker-*.out` for stdout, `.err` for stderr: Ray points
the worker's output at them) holds the line once `print(..., flush=True)` returns. Every node of a local or
simulated cluster writes to the same session directory on this machine.

    logs = RayLogs.of_connected()        # before the run: reads see only what is printed after this
    run(...)
    text = logs.wait_for("sending it again")   # every needle, within a deadline; all that was printed since

A job run as a subprocess with a Ray of its own: give it a Ray temp root of its own (`RAY_TMPDIR`, short: Ray's
socket paths live below it) and read its sessions there, `RayLogs.of_temp_root(root, from_start=True)`.
"""

from __future__ import annotations

import time
from pathlib import Path

# the files of user code's output (what Ray's log monitor forwards of a worker, ray/_private/log_monitor.py)
PATTERNS = ("worker-*.out", "worker-*.err")


class RayLogs:
    def __init__(self, logs_dir: str | Path, from_start: bool = False, sessions: str = "") -> None:
        """`logs_dir`: a Ray session's `logs` directory (with `sessions`, a glob of session folders: the Ray temp
        root's `ray` folder). What its worker files hold now is left out of every read, unless `from_start`."""
        self.logs_dir = Path(logs_dir)
        assert self.logs_dir.is_dir(), f"{self.logs_dir}: no Ray logs directory"
        self._patterns = [f"{sessions}/logs/{p}" if sessions else p for p in PATTERNS]
        self._start = {} if from_start else {p: p.stat().st_size for p in self._files()}

    @classmethod
    def of_connected(cls) -> RayLogs:
        """The logs of the Ray session this process is connected to (`ray.init`)."""
        import ray

        assert ray.is_initialized(), "not connected to Ray: no session to read the logs of"
        return cls(ray._private.worker._global_node.get_logs_dir_path())

    @classmethod
    def of_temp_root(cls, root: str | Path, from_start: bool = False) -> RayLogs:
        """The logs of every Ray session under Ray temp root `root` (what `RAY_TMPDIR` names), also of those that
        start later (not `session_latest`, a link to one of them)."""
        (Path(root) / "ray").mkdir(parents=True, exist_ok=True)
        return cls(Path(root) / "ray", from_start, sessions="session_[0-9]*")

    def _files(self) -> list[Path]:
        return sorted(p for pattern in self._patterns for p in self.logs_dir.glob(pattern))

    def text(self) -> str:
        """What the workers printed since this object was made (all of it: `from_start`), file by file (one file:
        one process's stdout or stderr)."""
        parts = []
        for p in self._files():
            try:
                with p.open("rb") as f:
                    f.seek(self._start.get(p, 0))
                    data = f.read()
            except FileNotFoundError:
                continue
            if data:
                parts.append(data.decode("utf-8", errors="replace"))
        return "".join(part if part.endswith("\n") else part + "\n" for part in parts)

    def wait_for(self, *needles: str, timeout_s: float = 120.0) -> str:
        """Polls until what the workers printed (`text()`) holds every one of `needles`; returns it. Fails after
        `timeout_s` naming what is missing and showing the end of what was seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            missing = [n for n in needles if n not in text]
            if not missing:
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"no {missing} in what the Ray workers printed within {timeout_s:g} s "
                                     f"({self.logs_dir}/{{{','.join(self._patterns)}}}); the last 3000 characters "
                                     f"of it:\n{text[-3000:]}")
            time.sleep(0.2)
