"""The lines a job logged (hylo/logs.py), read back from its output for a test: each line's time, level, rank
and message. A line the logger did not write (a report, Ray's or torch's own) is not one of them.

    for line in logged(proc.stderr):
        line.level, line.rank, line.message   # "INFO", "rank 1/2" (or None), "[zero] rank 1: holds ..."
    messages(proc.stderr, "WARNING")          # the messages alone, of one level
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from hylo import logs
from hylo.logs import LINE
from hylo.pipeline.job_output import RAY_PREFIX, strip_ansi


@dataclass(frozen=True)
class Logged:
    time: datetime
    level: str
    rank: str | None
    message: str


def logged(text: str) -> list[Logged]:
    """Every line of `text` the logger wrote, in order (a Ray worker's, forwarded to its driver with its
    "(RayTrainWorker pid=N)" prefix, too)."""
    out = []
    for raw in strip_ansi(text).splitlines():
        found = LINE.fullmatch(RAY_PREFIX.sub("", raw, count=1))
        if found:
            out.append(Logged(datetime.strptime(found["time"], "%Y-%m-%d %H:%M:%S.%f"), found["level"],
                              found["rank"], found["message"]))
    return out


def messages(text: str, level: str | None = None) -> list[str]:
    """The messages of the lines of `text` the logger wrote (of `level` only, when given)."""
    return [line.message for line in logged(text) if level is None or line.level == level]


@contextlib.contextmanager
def level_kept(*more: str) -> Iterator[None]:
    """A block that may set the log level (`logs.set_level`, `--log-level`): HYLO_LOG_LEVEL and the variables
    the setup writes (and `more`) are unset in it and put back after it, then the logger is set up again."""
    names = (logs.ENV, logs.TRANSFORMERS_ENV, *more)
    saved = {k: os.environ.pop(k, None) for k in names}
    try:
        logs.setup()
        yield
    finally:
        restore_environ(saved)
        logs.setup()


def restore_environ(saved: dict[str, str | None]) -> None:
    """Each variable of `saved` back to its value, or unset where it was None (absent)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
