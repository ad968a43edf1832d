"""tests/helpers/ray_logs.py, on log folders laid out as Ray lays them out (no Ray started): what a test reads of a
Ray worker's printed lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.ray_logs import RayLogs


def _print(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text)


def test_reads_only_what_the_workers_printed_after_it_was_made(tmp_path):
    logs_dir = tmp_path / "session_2026-12-06_03-00-00_000000_1" / "logs"
    old = logs_dir / "worker-aa-01000000-11.out"
    _print(old, "[teacher] teacher row 3: sending it again\n")
    _print(logs_dir / "raylet.out", "not a worker's output\n")
    logs = RayLogs(logs_dir)
    assert logs.text() == ""
    _print(old, "[train] step 4\n")
    _print(logs_dir / "worker-bb-01000000-12.err", "Error in training function")
    _print(logs_dir / "python-core-worker-bb_12.log", "Ray's own log, not printed\n")
    assert logs.text() == "[train] step 4\nError in training function\n"
    assert RayLogs(logs_dir, from_start=True).text().count("\n") == 3


def test_a_temp_root_covers_its_sessions_also_those_that_start_later(tmp_path):
    first = tmp_path / "ray" / "session_2026-12-06_03-00-00_000000_1" / "logs"
    _print(first / "worker-aa-01000000-11.out", "before\n")
    (tmp_path / "ray" / "session_latest").symlink_to(first.parent)
    logs = RayLogs.of_temp_root(tmp_path)
    _print(first / "worker-aa-01000000-11.out", "[stage1] step 1/1\n")
    _print(tmp_path / "ray" / "session_2026-12-06_03-05-00_000000_2" / "logs" / "worker-cc-02000000-13.out",
           "[stage2] step 1/1\n")
    # each line once (session_latest is a link to a session already read)
    assert logs.wait_for("[stage1] step 1/1", "[stage2] step 1/1", timeout_s=1).count("step 1/1") == 2


def test_waiting_for_a_line_never_printed_fails_in_time_showing_what_was_seen(tmp_path):
    logs = RayLogs(tmp_path)
    _print(tmp_path / "worker-aa-01000000-11.out", "[train] step 6\n")
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"no \['sending it again'\] in what the Ray workers printed within "
                                             r"0\.5 s .*\n\[train\] step 6"):
        logs.wait_for("[train] step", "sending it again", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
