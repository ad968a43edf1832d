"""One run per run directory (pipeline/train/runlock.py): a second run with the same storage and name is
refused naming the holder; a stale lock of a dead driver is reported, never silently taken over
(`--break-lock` takes it); URI storage gets a local lock plus a lock object in the bucket."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from hylo.pipeline.train.runlock import LOCK_FILE, RunLockError, holder_record, run_lock
from hylo.pipeline.train.storage import Loc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_is_refused_while_the_first_holds_the_directory(tmp_path):
    run = Loc.of(tmp_path / "run")
    with run_lock(run) as held:
        h = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert h["pid"] == held["pid"] and h["host"] == socket.gethostname() and h["started"]
        with pytest.raises(RunLockError, match=r"is in use by another run \(pid \d+ on host .*, since "):
            with run_lock(run):
                pass
        # a live holder of this host is never broken, not even with --break-lock
        with pytest.raises(RunLockError, match="in use by another run"):
            with run_lock(run, break_lock=True):
                pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # released at the end
    with run_lock(run):
        pass


@pytest.mark.slow
def test_a_stale_lock_is_reported_and_taken_only_with_break_lock(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    stale = {**holder_record(), "pid": _dead_pid(), "proc_start": "1"}
    (run / LOCK_FILE).write_text(json.dumps(stale))
    with pytest.raises(RunLockError, match=rf"stale lock: its holder \(pid {stale['pid']} on host .*\) is no longer "
                                           r"running.*pass --break-lock \(or delete .*run.lock\)"):
        with run_lock(Loc.of(run)):
            pass
    assert json.loads((run / LOCK_FILE).read_text()) == stale  # untouched
    with run_lock(Loc.of(run), break_lock=True) as mine:
        assert json.loads((run / LOCK_FILE).read_text()) == mine
    assert f"--break-lock: taking over {run / LOCK_FILE} from pid {stale['pid']}" in capsys.readouterr().err


def test_a_lock_from_another_host_cannot_be_checked_and_needs_break_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({**holder_record(), "host": "node-7.cluster"}))
    with pytest.raises(RunLockError, match="locked by a run on another host .*node-7.cluster.*--break-lock"):
        with run_lock(Loc.of(run)):
            pass
    with run_lock(Loc.of(run), break_lock=True):
        pass


@pytest.mark.slow
def test_a_torchrun_relaunch_takes_its_own_lock_back(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({**holder_record("torchrun:abc"), "pid": _dead_pid()}))
    with run_lock(Loc.of(run), owner="torchrun:abc"):
        pass
    with pytest.raises(RunLockError):
        (run / LOCK_FILE).write_text(json.dumps({**holder_record("torchrun:abc"), "pid": _dead_pid()}))
        with run_lock(Loc.of(run), owner="torchrun:other"):
            pass


def test_uri_storage_locks_locally_and_in_the_bucket(tmp_path, monkeypatch):
    """A non-local filesystem (fsspec's memory://, standing in for a bucket): the lock object is written,
    a second run (from this machine, or another one whose lock object is there) is refused."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    run = Loc.of("memory://bucket/runs/r1")
    assert not run.is_local
    with run_lock(run) as mine:
        assert json.loads((run / LOCK_FILE).read_text()) == mine
        with pytest.raises(RunLockError, match="in use by another run"):
            with run_lock(run):
                pass
    assert not (run / LOCK_FILE).exists()
    # another machine's driver holds the bucket's lock object
    (run / LOCK_FILE).write_text(json.dumps({**holder_record(), "host": "other-machine"}))
    with pytest.raises(RunLockError, match="another host .*other-machine"):
        with run_lock(run):
            pass
    assert not list((tmp_path / "tmp").rglob(LOCK_FILE))  # the local part was released again


def test_the_driver_refuses_a_second_run_before_starting_anything(tmp_path, monkeypatch):
    """driver.run while another run holds the directory: the lock error, before the run directory's
    checks, conversion or Ray (the first run's directory is left as it was)."""
    import hylo.pipeline.train.driver as driver
    from hylo.pipeline.train.driver import run

    def must_not_run(*a, **k):
        raise AssertionError("the second run got past the lock")

    monkeypatch.setattr(driver, "check_run_dir", must_not_run)
    args = ["--set", f"ray.storage_path={tmp_path}", "--set", "ray.name=shared", "--set", "data.source=synthetic"]
    with run_lock(Loc.of(tmp_path / "shared")):
        with pytest.raises(RunLockError, match=f"run directory {tmp_path / 'shared'} is in use by another run"):
            run(2, args)


@pytest.mark.slow
def test_a_driver_stopped_with_sigterm_releases_its_lock(tmp_path):
    """A scheduler (or torchrun, stopping the other ranks) sends SIGTERM: the driver exits through Python
    and removes run.lock, so the next `--resume` is not refused for a stale lock."""
    import os
    import signal

    code = ("import sys, time\nfrom hylo.pipeline.train.driver import exit_on_sigterm\n"
            "from hylo.pipeline.train.runlock import run_lock\nfrom hylo.pipeline.train.storage import Loc\n"
            "with exit_on_sigterm(), run_lock(Loc.of(sys.argv[1])):\n    print('locked', flush=True)\n"
            "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "locked"
    assert (tmp_path / "run" / LOCK_FILE).is_file()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not (tmp_path / "run" / LOCK_FILE).exists()
