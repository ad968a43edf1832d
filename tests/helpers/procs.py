"""Processes of a command a test started and signals: `start_job` (a job as a user runs it, output captured),
`wait_for_child` (the first child it starts), `running` (a PID that has not ended; Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_job(args: list[str], cwd: Path, tmpdir: Path | None = None) -> subprocess.Popen:
    """`python ARGS` with this checkout on the path (TMPDIR = `tmpdir` when given: the job's temporary files
    go there), its stdout and stderr to pipes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the fields after the command name (which may hold spaces) in parentheses: state, ppid, ...
    return text[text.rindex(")") + 2:].split()


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                found.append(int(entry.name))
    return found


def wait_for_child(proc: subprocess.Popen, timeout: float = 300) -> int:
    """The PID of the first child process of `proc` (fails if `proc` ends or none appears in `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = children(proc.pid)
        if found:
            return found[0]
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before starting a child: " \
                                    f"{proc.communicate()[1][-2000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no child of {proc.args} within {timeout} s")


def running(pid: int, timeout: float = 10) -> bool:
    """Whether `pid` still runs after waiting up to `timeout` s for it to end (a zombie has ended)."""
    deadline = time.monotonic() + timeout
    while True:
        fields = _stat(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
