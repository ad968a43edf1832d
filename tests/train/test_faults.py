"""Faults without a cluster: a storage outage in the middle of a checkpoint upload (a local S3 server
that stops itself when the upload reaches a chosen file), with the retries `checkpoint.upload_retries`
/ `upload_backoff_s` configure. (pyarrow's S3 client retries each request for ~6 s by itself before
an error reaches our retries, so the outage tests take 10-20 s and are marked slow.) The same upload function is Ray Train's `checkpoint_upload_fn` in the
training loop; test_faults_cluster.py runs it inside a real run.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hylo.outputs import OutputConflictError, atomic_dir
from hylo.ownership import ForeignOutputError
from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.checkpoint.layout import (
    checkpoint_problem,
    finalize_checkpoint,
    latest_checkpoint,
    prune,
    step_dir_name,
    step_dirs,
    write_rank_files,
)
from hylo.pipeline.train.checkpoint.resume import set_aside_other_lines
from hylo.pipeline.train.config import load_stage_config
from hylo.pipeline.train.storage import CheckpointUploadError, Loc, upload_with_retries

from tests.helpers.logs import messages
from tests.helpers.train import s3_server


# moto keeps its buckets per process, across servers: each test (here and in test_faults_cluster.py)
# uses keys of its own
def scratch(tmp: Path, step: int, files: int = 6) -> Path:
    """One rank's scratch directory of a checkpoint, with its list of files (as a Ray worker writes it)."""
    d = tmp / f"scratch-{step}"
    for i in range(files):
        (d / "zero" / "state").mkdir(parents=True, exist_ok=True)
        (d / "zero" / "state" / f"part_{i}.pt").write_bytes(bytes([step, i]) * (1000 + 37 * i))
    write_rank_files(d, 0, 1, shared=False)
    return d


def upload_checkpoint(tmp: Path, run: Loc, step: int, **kw) -> Loc:
    target = run / step_dir_name(step)
    upload_with_retries(scratch(tmp, step), target, **kw)
    finalize_checkpoint(target, step, 1)
    return target


@pytest.mark.slow
def test_outage_mid_upload_fails_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    with s3_server() as s3:
        run = Loc.of(s3.uri("unit/outage"))
        previous = upload_checkpoint(tmp_path, run, 3, retries=0, backoff_s=0)
        # two of its files go up whole (however pyarrow interleaves its concurrent uploads), then it stops
        s3.outage_on("step_00000006/", whole=2)
        with pytest.raises(CheckpointUploadError) as e:
            upload_checkpoint(tmp_path, run, 6, retries=0, backoff_s=0)
        assert s3.stopped.is_set()
        msg = str(e.value)
        assert "\n" not in msg and "uploading checkpoint s3://bucket/unit/outage/step_00000006 failed" in msg
        assert "failed 1 time(s) (checkpoint.upload_retries=0)" in msg and "--resume" in msg
        assert "AWS Error" not in msg  # Ray Train would retry it 3 more times on its own
        s3.start()
        # the storage is back: the previous checkpoint is whole, the cut one is never taken for whole
        assert checkpoint_problem(previous, deep=True) is None
        partial = run / "step_00000006"
        # (an output stream pyarrow abandoned may still complete its file once the server is back: at least two)
        assert 2 <= len(partial.files()) < 7 and "no manifest.json" in checkpoint_problem(partial)
        assert latest_checkpoint(run) == previous


@pytest.mark.slow
def test_outage_shorter_than_the_retries_is_ridden_out(tmp_path, capsys):
    with s3_server() as s3:
        run = Loc.of(s3.uri("unit/retry"))
        s3.outage_on("step_00000006/", after=1)

        def storage_returns():
            s3.stopped.wait(30)
            # longer than pyarrow's own retries of one request (~6 s): our retry loop has to step in
            threading.Event().wait(7)
            s3.start()

        back = threading.Thread(target=storage_returns)
        back.start()
        try:
            ckpt = upload_checkpoint(tmp_path, run, 6, retries=4, backoff_s=0.5, who="rank 0: ")
        finally:
            back.join()
        (retry, *_) = messages(capsys.readouterr().err, "WARNING")
        assert retry.startswith("[checkpoint] rank 0: uploading step_00000006 failed"), retry
        assert "retry 1 of 4 in 0.5 s" in retry
        assert checkpoint_problem(ckpt, deep=True) is None


def test_upload_retries_are_configurable_with_ranges(tmp_path):
    cfg = load_stage_config(2, None, ["checkpoint.upload_retries=0", "checkpoint.upload_backoff_s=0.5"])
    assert (cfg.checkpoint.upload_retries, cfg.checkpoint.upload_backoff_s) == (0, 0.5)
    assert load_stage_config(2).checkpoint.upload_retries == 3
    with pytest.raises(ConfigError, match="upload_retries"):
        load_stage_config(2, None, ["checkpoint.upload_retries=-1"])
    with pytest.raises(ConfigError, match="upload_backoff_s"):
        load_stage_config(2, None, ["checkpoint.upload_backoff_s=-2"])


# ------------------------------------------------------------------------------------ preemption
@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo group and a torchrun session of a default stage-2 config on a local run directory."""
    import socket

    import torch
    import torch.distributed as dist

    from hylo.pipeline.train.session import TorchrunSession
    from hylo.pipeline.train.worker import WorkerContext

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        run = tmp_path / "run"
        cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=run", "ray.num_workers=1",
                                          "metrics.tensorboard=false", "ray.launcher=torchrun"])
        ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                            run_dir=run, grad_accum=1, run_loc=Loc.of(run))
        yield TorchrunSession(ctx, {"run_loc": Loc.of(run)}, 10), run
    finally:
        # TorchrunSession.close() tears the group down itself
        if dist.is_initialized():
            dist.destroy_process_group()


def test_driver_sigterm_asks_for_a_final_checkpoint_only_when_it_fits(one_rank):
    import json
    import time

    from hylo.pipeline.train.session import PREEMPT_FILE

    session, run = one_rank
    run.mkdir(parents=True, exist_ok=True)
    assert session.preemption(ckpt_seconds=3.0) is None
    (run / PREEMPT_FILE).write_text(json.dumps({"signal": "SIGTERM", "deadline": time.time() + 60}))
    notice = session.preemption(ckpt_seconds=3.0)
    assert notice["stop"] and notice["final"] and notice["source"] == "preempted (SIGTERM to the driver)"
    # no checkpoint measured yet in this process: try one
    assert session.preemption(ckpt_seconds=None)["final"]
    (run / PREEMPT_FILE).write_text(json.dumps({"signal": "SIGTERM", "deadline": time.time() + 2}))
    notice = session.preemption(ckpt_seconds=30.0)
    assert notice["stop"] and not notice["final"]
    assert notice["why"].startswith("no time for a final checkpoint (2 s left, the last one took 30 s)")
    session.close()


def test_driver_sigterm_handler_records_the_request_and_names_the_checkpoint_to_resume(tmp_path, capsys):
    import os
    import signal

    from hylo.pipeline.train.driver import Preempted, preemption_handler
    from hylo.pipeline.train.session import PREEMPT_FILE, read_preempt_request

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "checkpoint.preempt_grace_s=40"])
    run = Loc.of(tmp_path / "run")
    (tmp_path / "run").mkdir()
    upload_checkpoint(tmp_path, run, 3, retries=0, backoff_s=0)
    (tmp_path / "run" / PREEMPT_FILE).write_text("{}")  # left by an earlier, preempted start: not this one's
    with pytest.raises(Preempted) as e:
        with preemption_handler(cfg, run):
            assert read_preempt_request(run) is None
            os.kill(os.getpid(), signal.SIGTERM)
            request = read_preempt_request(run)
            assert request["signal"] == "SIGTERM" and 39 < request["deadline"] - __import__("time").time() <= 40
    assert str(e.value) == ("preempted (SIGTERM): run the same command with --resume to continue from "
                            "step_00000003, its newest intact checkpoint")
    assert "checkpoint.preempt_grace_s=40 s" in capsys.readouterr().err
    assert read_preempt_request(run) is None and signal.getsignal(signal.SIGTERM) is not None
    # a second SIGTERM does not wait for the workers
    with pytest.raises(Preempted, match="a second SIGTERM: stopping now"):
        with preemption_handler(cfg, run):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_run_lock_left_in_storage_by_an_outage_is_reported_and_taken_back_by_its_process(tmp_path, capsys):
    from hylo.pipeline.train.runlock import LOCK_FILE, RunLockError, run_lock

    with s3_server() as s3:
        run = Loc.of(s3.uri("unit/locked"))
        with run_lock(run):
            # the storage goes away before the run ends: its lock cannot be removed
            s3.stop()
        assert "could not remove s3://bucket/unit/locked/run.lock" in capsys.readouterr().err
        s3.start()
        assert (run / LOCK_FILE).is_file()
        with run_lock(run):
            assert "left by an earlier run of this process" in capsys.readouterr().err
            # while this process holds it, the lock is not a leftover: a second run is refused
            with pytest.raises(RunLockError, match="in use by another run"):
                with run_lock(run):
                    pass
        assert not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("stage", [1, 2])
def test_the_stage_jobs_exit_143_with_one_line_when_preempted_and_one_line_when_training_fails(stage, monkeypatch,
                                                                                              capsys, tmp_path):
    """What `python jobs/stage<N>.py` (and `hylo stage<N>`) does with what the driver raises: a preemption
    is exit status 143 and its one resume line, the last of the output (before, jobs/stage*.py wrapped the
    driver's run() in the generic handler: a traceback and exit status 1); a run Ray Train gave up on is
    one `error: training failed: ...` line, exit status 1; a worker's input error one line, exit status 2."""
    import importlib

    from hylo.pipeline.data.rowfile import DataFormatError
    from hylo.pipeline.train import driver

    job = importlib.import_module(f"hylo.jobs.stage{stage}")
    # the job reads its config before it imports the driver: an empty file is the defaults
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("")
    resume = "preempted (SIGTERM): run the same command with --resume to continue from step_00000006, its " \
             "newest intact checkpoint"
    raised: list[BaseException] = []

    def fake_run(n: int, argv: list[str] | None = None) -> dict:
        assert n == stage and argv == ["--config", "c.yaml"]
        print("[train] step 6 ...")
        raise raised[0]

    monkeypatch.setattr(driver, "run", fake_run)
    monkeypatch.setattr(job, "run", fake_run, raising=False)  # where a job called the driver's run() itself
    raised[:] = [driver.Preempted(resume)]
    assert job.main(["--config", "c.yaml"]) == 143
    cap = capsys.readouterr()
    assert cap.err == f"[train] {resume}\n" and cap.out == "[train] step 6 ...\n"

    worker = RuntimeError("Traceback (most recent call last):\n  File ...\nRuntimeError: NCCL watchdog timeout")
    try:
        raise driver.TrainingError(worker) from worker
    except driver.TrainingError as e:
        raised[:] = [e]
    assert job.main(["--config", "c.yaml"]) == 1
    assert capsys.readouterr().err == "error: training failed: RuntimeError: NCCL watchdog timeout\n"

    bad = DataFormatError("d/shard-00001.parquet: row group 0 (rows 0..3 of the shard) is unreadable")
    try:
        raise driver.TrainingError(bad) from bad
    except driver.TrainingError as e:
        raised[:] = [e]
    assert job.main(["--config", "c.yaml"]) == 2
    assert capsys.readouterr().err == f"error: {bad}\n"


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_resume_from_an_older_step_sets_the_other_line_aside_once(tmp_path, where):
    """`resume.set_aside_other_lines` (the session calls it after a resume): the checkpoints after
    the resumed step go to `<run>/abandoned/<time>-after-step_N/` with a copy of the metrics file, whole
    (an object store has no directory rename: copied, then deleted); pruning and "the latest" see only the
    line the run is on; an incomplete newer one is left for the line to overwrite."""
    import contextlib

    server = s3_server() if where == "s3" else contextlib.nullcontext()
    with server as s3:
        run = Loc.of(s3.uri("unit/lines")) if s3 is not None else Loc.of(tmp_path / "run")
        for step in (3, 6, 9, 12):
            upload_checkpoint(tmp_path, run, step, retries=0, backoff_s=0)
        upload_with_retries(scratch(tmp_path, 15), run / "step_00000015", retries=0, backoff_s=0)  # no manifest
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 13)))
        assert set_aside_other_lines(run, run / "step_00000012", 12) is None
        folder, names = set_aside_other_lines(run, run / "step_00000003", 3, copies=("metrics.jsonl",))
        assert names == ["step_00000006", "step_00000009", "step_00000012"]
        assert folder.parent == run / "abandoned" and folder.name.endswith("-after-step_00000003")
        assert sorted(c.name for c in folder.children()) == ["metrics.jsonl", *names]
        assert checkpoint_problem(folder / "step_00000012", deep=True) is None
        assert (folder / "metrics.jsonl").read_text().count("step") == 12
        assert [s for s, _ in step_dirs(run)] == [3, 15]
        assert latest_checkpoint(run) == run / "step_00000003"
        # the new line's step 6: keep=2 keeps 3 and 6 (before: 3, 6, 9, 12 counted, and 3 and 6 went)
        upload_checkpoint(tmp_path / "new", run, 6, retries=0, backoff_s=0)
        assert prune(run, 2) == []
        # from a checkpoint of another run, every checkpoint of this one is on another line
        other = Loc.of(tmp_path / "elsewhere")
        upload_checkpoint(tmp_path / "other", other, 6, retries=0, backoff_s=0)
        folder2, names2 = set_aside_other_lines(run, other / "step_00000006", 6)
        assert names2 == ["step_00000003", "step_00000006"] and folder2 != folder


def test_a_users_file_in_the_runs_model_directory_stops_the_run_before_training(tmp_path):
    """The consolidated model replaces `<run>/model` at the end of training: a directory there holding anything
    this project did not write is refused before Ray starts (not after the training, and never deleted)."""
    from hylo.pipeline.train.driver import check_outputs

    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=r"])
    check_outputs(cfg)
    (tmp_path / "r" / "model").mkdir(parents=True)
    check_outputs(cfg)  # empty: fine
    (tmp_path / "r" / "model" / "eval.md").write_text("my notes")
    with pytest.raises(ForeignOutputError, match=r"the run's model directory \(checkpoint.consolidate\) .*model "
                                                 r"holds 1 entry this project did not write \(eval.md;"):
        check_outputs(cfg)
    check_outputs(load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=r",
                                              "checkpoint.consolidate=false"]))
    assert (tmp_path / "r" / "model" / "eval.md").read_text() == "my notes"


def test_a_run_whose_model_directory_is_its_student_stops_before_training(tmp_path):
    """Stage 2 starting from `<run>/model` (model.student) would replace its own student with the consolidated
    model: refused before Ray starts, naming both."""
    from hylo.pipeline.train.driver import check_outputs

    with atomic_dir(tmp_path / "r" / "model") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x")
    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=r",
                                      f"model.student={tmp_path / 'r' / 'model'}"])
    with pytest.raises(OutputConflictError, match=r"the run's model directory \(checkpoint.consolidate\) .*/r/model "
                                                  r"is the input model.student"):
        check_outputs(cfg)
    check_outputs(load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=r2",
                                              f"model.student={tmp_path / 'r' / 'model'}"]))


@pytest.mark.parametrize("where", ["is_data", "inside_data", "holds_student"])
def test_a_run_directory_over_an_input_stops_before_the_run_directory_is_made(tmp_path, where):
    """The run directory (checkpoints, metrics) is no input of the run, nor inside or around one: refused
    before it is made or locked, naming both."""
    from hylo.pipeline.train.driver import check_run_output

    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    student = tmp_path / "runs" / "r" / "student"
    student.mkdir(parents=True)
    storage, name = {"is_data": (tmp_path, "data"), "inside_data": (data, "r"),
                     "holds_student": (tmp_path / "runs", "r")}[where]
    cfg = load_stage_config(2, None, [f"ray.storage_path={storage}", f"ray.name={name}", f"data.path={data}",
                                      f"model.student={student}"])
    with pytest.raises(OutputConflictError, match=r"the run directory \(ray.storage_path/ray.name\) .* (is|lies "
                                                  r"inside|holds) the input (data.path|model.student)"):
        check_run_output(cfg)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == sorted(
        [Path("data"), Path("data/manifest.json"), Path("runs"), Path("runs/r"), Path("runs/r/student")])


def test_a_run_directory_of_the_user_is_refused_and_our_own_resumed(tmp_path):
    """An existing directory holding files but no record of ours is not a run directory: refused before anything
    is written, also when it holds what a run writes (a config_stage1.json, a run.lock, a step_* folder: never a
    run directory by its names). One the run claimed (and an empty one) passes."""
    from hylo.pipeline.train.driver import check_run_output, claim_run_dir

    cfg = load_stage_config(1, None, [f"ray.storage_path={tmp_path}", "ray.name=home"])
    check_run_output(cfg)  # missing: fine
    (tmp_path / "home").mkdir()
    check_run_output(cfg)  # empty: fine
    (tmp_path / "home" / "thesis.tex").write_text("mine")
    with pytest.raises(ForeignOutputError, match=r"the run directory \(ray.storage_path/ray.name\) .*/home holds 1 "
                                                 r"entry and no .hylo-output.json \(thesis.tex\)"):
        check_run_output(cfg)
    (tmp_path / "home" / "thesis.tex").unlink()
    claim_run_dir(cfg)
    (tmp_path / "home" / "step_00000001").mkdir()
    check_run_output(cfg)  # ours: a resume continues it
    old = tmp_path / "old"
    (old / "step_00000002").mkdir(parents=True)
    (old / "config_stage1.json").write_text("{}")  # looks like a run directory: no record, refused
    (old / "run.lock").write_text("{}")
    with pytest.raises(ForeignOutputError, match=r"/old holds 3 entries and no .hylo-output.json \(config_stage1.json, "
                                                 r"run.lock, step_00000002\): this project did not make it"):
        check_run_output(load_stage_config(1, None, [f"ray.storage_path={tmp_path}", "ray.name=old"]))
    assert sorted(p.name for p in old.iterdir()) == ["config_stage1.json", "run.lock", "step_00000002"]


def test_stage_job_refuses_a_run_directory_inside_its_data_in_one_line(tmp_path, capsys, monkeypatch):
    """Through the job's main: one `error:` line, exit 2, before the run directory is locked or the run starts."""
    from hylo.jobs import stage2
    from hylo.pipeline.train import driver

    started = []
    monkeypatch.setattr(driver, "prepare_run", lambda *a, **k: started.append(a) or {})
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    rc = stage2.main(["--set", f"ray.storage_path={data}", "--set", "ray.name=r", "--set", f"data.path={data}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "lies inside the input data.path" in err[0]
    assert not started and sorted(p.name for p in data.iterdir()) == ["manifest.json"]
