"""Where a stage run's start-up goes: one line, `[train] start-up: ...`, printed by rank 0 after its first step,
and `startup.json` in the run directory (read by bench/stage_startup.py).

Phases, each measured where it happens (wall-clock seconds):

* import: from the process's start to the stage's `run`, when the process is the job's own;
* ray start: joining or starting Ray;
* worker group: from handing the trainer to Ray Train until a worker runs (torchrun: 0);
* process group: the collective backend's set-up;
* model load: the student, and what the stage loads beside it (stage 1's base, stage 2's in-process teacher);
* deepspeed init: `deepspeed.initialize`;
* first step: the first training step.

The clock is a plain dict: the driver's phases ride in the launch dict to the workers.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PHASES = ("import", "ray start", "worker group", "process group", "model load", "deepspeed init", "first step")
STARTUP_FILE = "startup.json"


def process_start_time() -> float:
    """The Unix time this process started (psutil, a Ray dependency; now, where it cannot tell)."""
    try:
        import psutil  # lazy: psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - a clock is not worth failing a run over
        return time.time()


def is_job_process(stage: int) -> bool:
    """Whether this process was started to run stage `stage`: its __main__ is jobs/stageN.py or the `hylo`
    command (whose start-up is then the job's)."""
    main = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "").name
    return main in (f"stage{stage}.py", "hylo", "hylo.exe")


class StartupClock:
    """Phase -> seconds, in the order measured; `since` marks when the next phase began."""

    def __init__(self, phases: dict[str, float] | None = None, since: float | None = None) -> None:
        self.phases: dict[str, float] = dict(phases or {})
        self.since = time.time() if since is None else since
        self.inner = 0.0  # seconds `add` counted since the previous lap

    def lap(self, phase: str) -> float:
        """End `phase` now (it began at the previous lap); returns its seconds."""
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + max(0.0, now - self.since - self.inner)
        self.since, self.inner = now, 0.0
        return self.phases[phase]

    def add(self, phase: str, seconds: float) -> None:
        """Count `seconds` as `phase` (a part measured inside another phase, which `lap` then leaves out)."""
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.inner += seconds

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time a block as `phase` (what ran since the previous lap is not counted in it)."""
        self.since, self.inner = time.time(), 0.0
        try:
            yield
        finally:
            self.lap(phase)

    def to_dict(self) -> dict[str, Any]:
        return {"phases": dict(self.phases), "since": self.since}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StartupClock:
        d = d or {}
        return cls(d.get("phases"), d.get("since"))

    def line(self) -> str:
        known = [p for p in PHASES if p in self.phases] + [p for p in self.phases if p not in PHASES]
        total = sum(self.phases.values())
        return "[train] start-up: " + " | ".join(f"{p} {self.phases[p]:.1f} s" for p in known) + f" | total {total:.1f} s"
