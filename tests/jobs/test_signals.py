"""The signal rule (hylo/stopping.py): a command that starts children or writes temporary files, stopped by
SIGTERM or Ctrl-C (SIGINT), ends its children, removes its temporary files and an --out it made and left
empty, prints one line and exits 143 / 130.

The slow tests run the commands as a user does, in a process of their own, and signal them part way: `hylo
kernels-check` once its compile child exists; `hylo convert --to-released` while its export is in its
staging directory (held there: the read-back of the export sleeps, so the signal falls inside it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap

import pytest

from tests.helpers.procs import running, start_job, wait_for_child

SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def _shown(sig: int) -> str:
    return "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, list[str], str]:
    """Send `sig` to the job; its exit status, its stderr's non-empty lines and all of it."""
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, [line for line in err.splitlines() if line.strip()], err


def test_a_signal_ends_the_block_with_one_line_and_128_plus_the_signal(tmp_path, capsys):
    """In this process: the handler raises Stopped where the block is, the registered temporary file and the
    directory `make_dir` made (empty) are removed, a directory that was there before stays."""
    from hylo.stopping import Stopped, make_dir, stopping, track_temp

    before = tmp_path / "there"
    before.mkdir()
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, stopping("hylo test"):
        out = make_dir(tmp_path / "new" / "out")
        make_dir(before)
        temp = track_temp(tmp_path / "scratch.bin")
        temp.write_bytes(b"x")
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the signal did not stop the block")
    assert e.value.code == 143
    assert capsys.readouterr().err == f"hylo test: stopped by SIGTERM; removed {temp}, {out}, {out.parent}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]
    # the handler the block replaced is back
    assert signal.getsignal(signal.SIGTERM) is handler
    assert isinstance(Stopped(signal.SIGINT), KeyboardInterrupt)


def test_a_signal_that_comes_while_a_finalizer_runs_still_stops_the_block(capsys):
    """Python drops an exception raised in a `__del__` (the garbage collector runs them anywhere): a signal
    handled there is sent again once it returned. Seen: SIGTERM to kernels-check while a regex finalizer ran
    was lost, and the command went on to start its child."""
    import time

    from hylo.stopping import stopping

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)

    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e, stopping("hylo test"):
        obj = Finalized()
        del obj
        time.sleep(10)
    # stopped in the sleep, not after it
    assert time.monotonic() - t0 < 5
    assert e.value.code == 143
    assert capsys.readouterr().err == "hylo test: stopped by SIGTERM\n"


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_to_kernels_check_ends_its_compile_child_and_removes_what_it_made(tmp_path, sig):
    """Before: SIGTERM killed the parent only (exit -15, no message), its compile child ran on as an orphan,
    its work directory and an empty --out stayed; Ctrl-C left the child running too."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    proc = start_job(["-m", "hylo.jobs.kernels_check", "--config", "llama-3.2-1b-8mla8gdn-64k.yaml",
                      "--targets", "sm_90", "--tokens", "16", "--out", str(out)], tmp_path, tmp)
    child = wait_for_child(proc)
    try:
        rc, lines, err = _stop(proc, sig)
        assert rc == 128 + sig, err[-3000:]
        assert not running(child), f"the compile child {child} still runs"
    finally:
        if running(child, timeout=0):
            os.kill(child, signal.SIGKILL)
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in lines if "stopped by" in line] == [lines[-1]]
    assert re.fullmatch(rf"hylo kernels-check: stopped by {re.escape(_shown(sig))}; ended 1 child, removed "
                        rf"{re.escape(str(tmp))}/kernels-check-\w+, {re.escape(str(out))}", lines[-1]), lines[-1]
    assert list(tmp.iterdir()) == [] and not out.exists()


@pytest.mark.slow
def test_sigterm_during_convert_to_released_leaves_no_temporary_export(tmp_path):
    """Before: exit -15 with no message, and the staging directory `.rel.tmp-<pid>-<hex>` (the whole export)
    stayed beside --out until the next run of that output."""
    import torch

    from hylo.io import save_hylo
    from hylo.modeling import HyLoForCausalLM

    from tests.helpers.models import tiny_student

    torch.manual_seed(0)
    cfg = tiny_student()
    # what AMD's layout requires of an export (a query latent, its MLA latent-norm eps)
    cfg.q_lora_rank, cfg.mla_latent_norm_eps = 32, 1e-6
    save_hylo(HyLoForCausalLM(cfg), tmp_path / "ours")
    rel = tmp_path / "rel"
    script = textwrap.dedent(f"""
        import sys, time
        import hylo.released.export as export
        check = export.check_released_dir
        def held(d):
            check(d)
            print("held", flush=True)
            time.sleep(300)
        export.check_released_dir = held
        from hylo.jobs.convert import main
        sys.exit(main(["--to-released", {str(tmp_path / 'ours')!r}, "--out", {str(rel)!r}]))
    """)
    proc = start_job(["-c", script], tmp_path)
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) and line.strip() != "held":
        pass
    assert line.strip() == "held", proc.communicate()[1][-3000:]
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".rel.tmp-")]
    assert len(staging) == 1 and (staging[0] / "model.safetensors").is_file()
    rc, lines, err = _stop(proc, signal.SIGTERM)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert lines[-1] == f"hylo convert: stopped by SIGTERM; removed {staging[0]}", lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours"]
