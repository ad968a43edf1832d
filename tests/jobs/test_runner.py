"""The step runner shared by the demo and the placement search (pipeline/demo.py, pipeline/placement/)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

from hylo.outputs import OutputConflictError
from hylo.ownership import ForeignOutputError, recorded_entries
from hylo.pipeline.ray_init import RayInitSection
from hylo.pipeline.runner import StepRunner, last_json_object, train_cmd
from hylo.pipeline.train.checkpoint.layout import STATE_FILE, finalize_checkpoint, write_rank_files

# The interpreter that runs the tests (a virtualenv's, say), never whatever `python` is first on PATH.
PY = sys.executable


@pytest.fixture(autouse=True)
def foreign_python_on_path(tmp_path, monkeypatch):
    """A `python` first on PATH that is not this interpreter (a system Python without the project's
    packages): a test that ran "python" from PATH would get it and fail."""
    fake = tmp_path / "foreign-bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'not the interpreter running the tests' >&2\nexit 97\n")
    (fake / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ.get('PATH', '')}")


def test_step_runs_once_and_reruns_when_outputs_are_missing(tmp_path):
    calls = []
    out = tmp_path / "out.txt"

    def work():
        calls.append(1)
        out.write_text("x")
        return {"value": 7}

    r = StepRunner(tmp_path / "run", quiet=True)
    assert r.step("a", [out], work) == {"value": 7}
    assert StepRunner(tmp_path / "run", quiet=True).step("a", [out], work)["value"] == 7
    assert len(calls) == 1  # reused
    out.unlink()
    StepRunner(tmp_path / "run", quiet=True).step("a", [out], work)
    assert len(calls) == 2  # its output went missing: run again
    StepRunner(tmp_path / "run", quiet=True, force=True).step("a", [out], work)
    assert len(calls) == 3
    assert json.loads((tmp_path / "run" / "done" / "a.json").read_text())["value"] == 7


@pytest.mark.slow
def test_failed_job_names_its_log(tmp_path):
    r = StepRunner(tmp_path / "run", quiet=True)
    assert r.sh("ok", [PY, "-c", "print('hi')"]) == "hi\n"
    with pytest.raises(SystemExit, match=r"boom failed \(exit 3\); full log: .*boom.log"):
        r.sh("boom", [PY, "-c", "import sys; print('bad'); sys.exit(3)"])
    assert (tmp_path / "run" / "logs" / "boom.log").read_text() == "bad\n"
    # a step named after an output path ("cmp_even/converted") logs to a flat file name
    r.sh("cmp_even/converted", [PY, "-c", "print('x')"])
    assert (tmp_path / "run" / "logs" / "cmp_even_converted.log").read_text() == "x\n"


@pytest.mark.slow
def test_a_jobs_known_noise_goes_to_its_log_only_and_the_log_has_no_ansi_codes(tmp_path, capsys):
    noise = ("\x1b[36m(PlacementGroupCleaner pid=7)\x1b[0m Failed to query Ray Train Controller actor state. "
             "State API may be temporarily unavailable. Continuing to monitor.")
    code = f"import sys; print({noise!r}); print('[stage1] step 1/1'); sys.stdout.write('bar 0%\\rbar 100%\\n')"
    assert StepRunner(tmp_path / "run").sh("job", [PY, "-c", code]).endswith("[stage1] step 1/1\nbar 0%\nbar 100%\n")
    cap = capsys.readouterr()
    assert cap.out == ""  # the job's lines and the runner's are log lines: on stderr
    out = cap.err.split("\n", 2)[2]  # after the step's command line
    assert "  | [stage1] step 1/1\n  | bar 100%\n" in out and "1 line of known Ray/torch notices are in" in out
    assert "PlacementGroupCleaner" not in out and "bar 0%" not in out and "\x1b" not in out
    log = (tmp_path / "run" / "logs" / "job.log").read_text()
    assert log == f"{noise[5:34]}{noise[38:]}\n[stage1] step 1/1\nbar 0%\nbar 100%\n"


def test_last_json_object_skips_log_lines():
    assert last_json_object('{"a": 1}\n') == {"a": 1}
    assert last_json_object('[notice] accelerator cpu\n{\n "a": 2\n}\n') == {"a": 2}


def test_interrupted_training_step_resumes(tmp_path):
    args = (1, "configs/demo-smollm2.yaml", tmp_path, "stage1", tmp_path / "student", tmp_path / "data", 512, 8)
    assert "--resume" not in train_cmd(*args)
    ckpt = tmp_path / "stage1" / "step_00000004"
    (ckpt / "ranks").mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"world_size": 2, "step": 4}))
    (ckpt / "ranks" / "rank_0.json").write_text("{}")
    assert "--resume" not in train_cmd(*args)  # incomplete: rank 1 never wrote its state
    (ckpt / "ranks" / "rank_1.json").write_text("{}")
    assert "--resume" not in train_cmd(*args)  # every file there, but no manifest: the write never finished
    for rank in (0, 1):
        write_rank_files(ckpt, rank, 2, shared=True)
    finalize_checkpoint(ckpt, 4, 2)
    cmd = train_cmd(*args)
    assert cmd[-1] == "--resume" and "train.total_steps=8" in cmd and "checkpoint.every_steps=4" in cmd
    assert "checkpoint.delete_after_consolidate=true" in cmd


@pytest.mark.slow
def test_steps_that_use_ray_join_one_ray_started_once_on_first_use(tmp_path, monkeypatch):
    import hylo.pipeline.runner as runner

    calls = []
    monkeypatch.setattr(runner, "init_ray", lambda address, num_cpus, **kw: calls.append((address, num_cpus)) or True)
    monkeypatch.setattr(runner, "gcs_address", lambda: "127.0.0.1:6379")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    show = [PY, "-c", "import os; print(os.environ.get('RAY_ADDRESS'))"]
    with StepRunner(tmp_path / "run", quiet=True, ray=RayInitSection(num_cpus=2)) as r:
        assert r.sh("plain", show) == "None\n" and calls == []  # a job without Ray starts none
        assert r.sh("a", show, ray=True) == "127.0.0.1:6379\n"
        assert r.sh("b", show, ray=True) == "127.0.0.1:6379\n"
        assert calls == [(None, 2)]
        monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(shutdown=lambda: calls.append("shutdown")))
    assert calls[-1] == "shutdown"


@pytest.mark.slow
def test_the_jobs_of_a_run_join_its_ray(tmp_path):
    import ray

    job = [PY, "-c", "import ray; from hylo.pipeline.ray_init import init_ray; started = init_ray(None, 1); "
           "print(started, ray.get_runtime_context().gcs_address, ray.cluster_resources()['CPU'])"]
    with StepRunner(tmp_path / "run", quiet=True, ray=RayInitSection(num_cpus=2)) as r:
        first, second = r.sh("a", job, ray=True).split()[-3:], r.sh("b", job, ray=True).split()[-3:]
        assert first == second == ["False", r.ray_address(), "2.0"]
        assert ray.is_initialized()
    assert not ray.is_initialized()


def test_train_cmd_leaves_the_length_to_the_data_unless_asked_to_check_it(tmp_path):
    # the rows' length is the prepared data's (its manifest): the demo sets it once, as packing.max_len
    args = (2, "configs/demo-smollm2.yaml", tmp_path, "stage2", tmp_path / "student", tmp_path / "data")
    assert not any("data.seq_len" in a for a in train_cmd(*args, None, 8))
    assert "data.seq_len=512" in train_cmd(*args, 512, 8)


def test_a_run_directory_of_the_user_or_over_an_input_is_refused_before_anything_is_made(tmp_path):
    """A multi-step run writes logs/ and done/ into its run_dir: a directory of the user's (files and no record,
    whatever their names) or one that is, lies inside or holds an input is refused, and left as it was."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("mine")
    with pytest.raises(ForeignOutputError, match=r"run_dir .*/home holds 1 entry and no .hylo-output.json "
                                                 r"\(thesis.tex\)"):
        StepRunner(home, quiet=True)
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"]
    data = tmp_path / "rows"
    data.mkdir()
    with pytest.raises(OutputConflictError, match=r"run_dir .*/rows/run lies inside the input stage1_data"):
        StepRunner(data / "run", quiet=True, inputs=[("stage1_data", data)])
    assert not (data / "run").exists()
    StepRunner(tmp_path / "run", quiet=True)
    assert recorded_entries(tmp_path / "run") == {"logs", "done"}
    (tmp_path / "run" / "notes.txt").write_text("mine")
    StepRunner(tmp_path / "run", quiet=True)  # ours: resumed
    old = tmp_path / "old"
    (old / "done").mkdir(parents=True)  # what a run writes, but no record: never a run directory by its names
    with pytest.raises(ForeignOutputError, match=r"run_dir .*/old holds 1 entry and no .hylo-output.json \(done\)"):
        StepRunner(old, quiet=True)
    assert sorted(p.name for p in old.iterdir()) == ["done"]


def test_placement_run_dir_holding_its_rows_is_refused(tmp_path):
    from hylo.pipeline.placement import PlaceLayers, placement_config

    for split in ("stage1", "heldout"):
        (tmp_path / "demo" / "data" / split).mkdir(parents=True)
        (tmp_path / "demo" / "data" / split / "manifest.json").write_text("{}")
    with pytest.raises(OutputConflictError, match=r"run_dir .*/demo holds the input (stage1|heldout)_data"):
        PlaceLayers(placement_config(["--n-mla", "2", "--data-from", str(tmp_path / "demo"),
                                      "--run-dir", str(tmp_path / "demo"), "--quiet"]))
    assert not (tmp_path / "demo" / "logs").exists()
