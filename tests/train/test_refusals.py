"""Refusals before side effects, and start-up faults named in bounded time (issue 61, part B).

* Every check that can refuse a stage run runs before its directory is made, Ray starts or anything is converted
  (driver.check_run); a run stopped after it made its directory but before its training began (Ray did not start,
  the teacher pool's port is taken) removes that directory again (driver.remove_unstarted_run_dir).
* `--print-config` runs the run's checks of its inputs when they are on this machine.
* Advice in an error message is checked: the group size it suggests divides the workers and the heads and splits
  the rows (train/config.py largest_group).
* `hylo estimate` and `hylo kernels-check` refuse a named student that does not exist, as the stages do, unless it
  is the model the config's stage 1 writes (estimate/shapes.py conversion_for_student).

The tries of the issue are the regression tests here; each failed on fa63c8a. They run the commands in this
process on the shared tiny models (tests/helpers/runs.py); none starts Ray but the one slow test at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import largest_group

from tests.helpers.cli import run_hylo_split
from tests.helpers.train import tiny_config, write_config

REPO = Path(__file__).resolve().parents[2]
# the try of the issue: Ulysses over the tiny teacher's 4 heads at a group of 3 (3 workers, 66-token rows)
ULYSSES_3 = ["ray.num_workers=3", "train.sequence_parallel=3", "train.sequence_parallel_teacher=ulysses",
             "data.seq_len=66", "train.global_batch_sequences=1"]
# rows of 8 tokens over 4 ranks: shards of 2, shorter than the tiny student's conv window (3)
SHORT_SHARDS = ["ray.num_workers=4", "train.sequence_parallel=4", "data.seq_len=8", "train.global_batch_sequences=1"]


@pytest.fixture
def stage2(tiny, tmp_path) -> Path:
    """A stage-2 config of the tiny models under the Ray launcher, its runs in tmp_path/runs."""
    _, models = tiny
    cfg = tiny_config(models, tmp_path / "runs", "s2", stage=2, ray={"launcher": "ray", "num_workers": 1})
    return write_config(cfg, tmp_path / "s2.yaml")


def error_line(rc: int, out: str, err: str) -> str:
    """The one `error:` line of a refused command (exit status 2): the last line of stderr, no traceback."""
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    return errors[0]


# ------------------------------------------------------------------------------ no run directory left by a refusal
@pytest.mark.parametrize("sets,needle", [
    (["data.source=parquet", "data.path={tmp}/nodata"], "no manifest.json"),
    (ULYSSES_3, "the largest group size that works is 1"),
    (SHORT_SHARDS, "shorter than the linear blocks' conv window"),
], ids=["no-manifest", "ulysses-heads", "short-shards"])
def test_a_refused_run_leaves_no_run_directory(stage2, tmp_path, sets, needle):
    """Before: each of these was refused, under the Ray launcher after the run directory was made (the lock made
    it), and an empty run directory stayed behind."""
    (tmp_path / "nodata").mkdir()
    argv = ["stage2", "--config", str(stage2)] + [x for s in sets for x in ("--set", s.format(tmp=tmp_path))]
    line = error_line(*run_hylo_split(argv))
    assert needle in line, line
    assert not (tmp_path / "runs").exists()


def test_a_run_stopped_before_its_training_began_removes_the_directory_it_made(stage2, tmp_path, monkeypatch):
    """Ray's start fails after the run made its directory and wrote its config: the directory goes with the
    run. One that existed before the run (a run of ours) stays, with what it held."""
    from hylo.pipeline.ray_init import RayStartupError
    from hylo.pipeline.train import driver

    def no_ray(*args, **kwargs):
        assert (tmp_path / "runs" / "s2" / "config_stage2.json").is_file()  # the run got that far
        raise RayStartupError("a local Ray could not start: (a stand-in for Ray's failure)")

    monkeypatch.setattr(driver, "init_ray", no_ray)
    line = error_line(*run_hylo_split(["stage2", "--config", str(stage2)]))
    assert line == "error: a local Ray could not start: (a stand-in for Ray's failure)"
    assert not (tmp_path / "runs" / "s2").exists()
    # an existing run directory of ours (its record, an earlier run's metrics): kept
    run = tmp_path / "runs" / "s2"
    run.mkdir(parents=True)
    from hylo.ownership import record_files

    (run / "metrics.jsonl").write_text("{}\n")
    record_files(run, ["metrics.jsonl"])
    error_line(*run_hylo_split(["stage2", "--config", str(stage2)]))
    assert (run / "metrics.jsonl").read_text() == "{}\n"


def test_remove_unstarted_run_dir_removes_only_what_the_run_wrote(tmp_path):
    from hylo.ownership import OUTPUT_RECORD
    from hylo.pipeline.train.driver import remove_unstarted_run_dir

    run = tmp_path / "run"
    (run / "empty").mkdir(parents=True)
    for name in ("config_stage2.json", OUTPUT_RECORD, "run.lock"):
        (run / name).write_text("{}")
    (run / "notes.txt").write_text("mine")
    remove_unstarted_run_dir(run, 2)
    assert sorted(p.name for p in run.iterdir()) == sorted(["empty", "config_stage2.json", OUTPUT_RECORD, "run.lock",
                                                            "notes.txt"])
    (run / "notes.txt").unlink()
    os.symlink(tmp_path / "elsewhere", run / "empty" / "link")
    remove_unstarted_run_dir(run, 2)
    assert (run / "empty" / "link").is_symlink()  # a link is not the run's: everything stays
    (run / "empty" / "link").unlink()
    remove_unstarted_run_dir(run, 2)
    assert not run.exists()


def test_a_stale_ray_address_is_named_before_the_run_directory_is_made(stage2, tmp_path, monkeypatch):
    """Before: `RAY_ADDRESS` naming a closed port was still running after 300 s (Ray's `Failed to connect to GCS`
    every ~41 s), not one line from the project. Now: one line naming the variable, before anything is made."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    line = error_line(*run_hylo_split(["stage2", "--config", str(stage2)]))
    assert line.startswith(f"error: RAY_ADDRESS=127.0.0.1:{port}: nothing accepts connections at 127.0.0.1:{port}")
    assert "unset RAY_ADDRESS to start a local Ray" in line
    monkeypatch.delenv("RAY_ADDRESS")
    line = error_line(*run_hylo_split(["stage2", "--config", str(stage2), "--set", f"ray.address=127.0.0.1:{port}"]))
    assert line.startswith(f"error: ray.address=127.0.0.1:{port}: nothing accepts connections") and \
        "leave ray.address unset (null)" in line
    assert not (tmp_path / "runs").exists()


def test_a_taken_pool_port_is_named_before_ray_starts(stage2, tmp_path):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    with held:
        line = error_line(*run_hylo_split(["stage2", "--config", str(stage2), "--set", "teacher.source=serve",
                                           "--set", f"teacher.pool.port={port}"]))
    assert line.startswith(f"error: teacher.pool.port={port}: the teacher pool's HTTP proxy cannot listen on "
                           f"127.0.0.1:{port} (another process listens there)"), line
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------ --print-config checks as the run does
def test_print_config_runs_the_runs_checks_of_its_inputs(stage2, tmp_path):
    """Before: a row shard shorter than the conv window was accepted by --print-config (exit 0) while each rank
    of the run exited 2. Now --print-config refuses it with the run's own line, and prints nothing."""
    sets = [x for s in SHORT_SHARDS for x in ("--set", s)]
    rc, out, err = run_hylo_split(["stage2", "--config", str(stage2), *sets, "--print-config"])
    line = error_line(rc, out, err)
    assert "data.seq_len=8 (model.student=" in line and "shorter than the linear blocks' conv window" in line
    assert out == ""
    # the same for Ulysses over heads the group does not divide
    rc, out, err = run_hylo_split(["stage2", "--config", str(stage2), *[x for s in ULYSSES_3 for x in ("--set", s)],
                                   "--print-config"])
    assert "the largest group size that works is 1" in error_line(rc, out, err)
    # inputs not on this machine (a recipe printed before its models exist): printed unchecked, as before
    later = tmp_path / "later"
    rc, out, err = run_hylo_split(["stage2", "--config", str(stage2), *sets, "--set", f"model.student={later}",
                                   "--print-config"])
    assert rc == 0 and "train:" in out and err == "", err
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.inputs import check_inputs_for_print

    cfg = load_stage_config(2, str(stage2), [*SHORT_SHARDS, f"model.student={later}", "data.source=parquet",
                                             "data.path=null"])
    assert check_inputs_for_print(cfg) == [f"model.student={later} (not here)", "data.path (not set)"]
    # a config that passes prints as before
    rc, out, err = run_hylo_split(["stage2", "--config", str(stage2), "--print-config"])
    assert rc == 0 and "sequence_parallel: 1" in out and err == "", err


# ------------------------------------------------------------------------------ advice is checked
def test_the_suggested_group_size_divides_the_workers_and_the_heads_and_splits_the_rows():
    assert largest_group(3, workers=3, heads=4) == 1  # the try: 2 divides the heads, not the 3 workers
    assert largest_group(8, workers=8, heads=12) == 4
    assert largest_group(8, workers=16, heads=24, tokens=[64], conv_size=4) == 8
    assert largest_group(8, workers=8, heads=24, tokens=[12], conv_size=4) == 4  # 12 / 6 = 2 tokens < conv 3
    assert largest_group(16, workers=16, heads=24, tokens=[48], conv_size=4) == 8
    # whatever the inputs, the advice holds every rule it was given
    for limit in range(1, 17):
        for workers in range(1, 17):
            for heads in (4, 6, 12, 24):
                n = largest_group(limit, workers=workers, heads=heads, tokens=[96], conv_size=4)
                assert 1 <= n <= limit and workers % n == 0 and heads % n == 0 and 96 % n == 0 and 96 // n >= 3 or n == 1


def test_hylo_estimate_advises_a_group_size_the_run_takes(stage2):
    """Before: `hylo estimate` advised a group size of 2, which does not divide the config's 3 workers (`hylo
    stage2` said 1). Both now say 1."""
    sets = [x for s in ULYSSES_3 for x in ("--set", s)]
    line = error_line(*run_hylo_split(["estimate", "--config", str(stage2), *sets, "--cpu"]))
    assert "the largest N that works is 1," in line, line
    line = error_line(*run_hylo_split(["stage2", "--config", str(stage2), *sets]))
    assert "the largest group size that works is 1)" in line, line


# ------------------------------------------------------------------------------ a named student that does not exist
def test_estimate_and_kernels_check_refuse_a_missing_student_as_the_stages_do(stage2, tmp_path):
    """Before: `hylo estimate` with model.student=<missing> exited 0, pricing the base's default conversion, and
    `hylo kernels-check` compiled it (4.7 min here). Both now refuse it with the stages' line, before any work."""
    missing = tmp_path / "missing"
    for argv in (["estimate", "--config", str(stage2), "--cpu"],
                 ["kernels-check", "--config", str(stage2), "--out", str(tmp_path / "kc"), "--tokens", "64"],
                 ["stage2", "--config", str(stage2)]):
        line = error_line(*run_hylo_split([*argv, "--set", f"model.student={missing}"]))
        assert line.startswith(f"error: model.student='{missing}': does not exist; it must be a HyLo checkpoint "
                               "directory"), (argv, line)
    assert not (tmp_path / "kc").exists() and not (tmp_path / "runs").exists()
    # a folder that is not a HyLo checkpoint: the same line as the stage's
    (tmp_path / "plain").mkdir()
    line = error_line(*run_hylo_split(["estimate", "--config", str(stage2), "--cpu", "--set",
                                       f"model.student={tmp_path / 'plain'}"]))
    assert line.startswith(f"error: model.student='{tmp_path / 'plain'}': has no config.json; it must be a HyLo "
                           "checkpoint directory"), line


def test_the_model_stage_1_writes_is_priced_from_its_conversion_with_a_line_saying_so(tiny, tmp_path):
    """A recipe is estimated before its stage 1 ran: its stage-2 student is stage 1's output, which does not exist
    yet. That one (and only that one) is priced from stage 1's conversion, and the report says so."""
    from hylo.pipeline.estimate.shapes import conversion_for_student, conversion_note
    from hylo.pipeline.paths import resolve_paths
    from hylo.pipeline.train.config import load_stage_config

    _, models = tiny
    path = tmp_path / "recipe.yaml"
    write_config({"model": {"base": str(models["base"])}, "ray": {"storage_path": str(tmp_path / "runs")},
                  "stage1": {"model": {"convert": {"mla_layers": "even", "kv_lora_rank": 16}}, "ray": {"name": "one"}},
                  "stage2": {"model": {"student": str(tmp_path / "runs" / "one" / "model")}, "ray": {"name": "two"},
                             "teacher": {"model": {"path": str(models["base"])}}}}, path)
    cfg = resolve_paths(load_stage_config(2, str(path), []))
    stage1 = conversion_for_student(cfg, str(path), [])
    assert stage1 is not None and stage1.model.convert.kv_lora_rank == 16
    assert conversion_note(cfg, stage1).startswith(f"model.student={tmp_path / 'runs' / 'one' / 'model'} does not "
                                                   "exist yet: it is the model stage 1 of this config writes, priced "
                                                   "as stage 1's conversion")
    # another missing path is refused, with the way to price stage 1's conversion
    with pytest.raises(ConfigError, match=r"does not exist; it must be a HyLo checkpoint directory .*set it to the "
                                          r"model stage 1 writes \(.*/runs/one/model\)"):
        conversion_for_student(resolve_paths(load_stage_config(2, str(path), [f"model.student={tmp_path}/x"])),
                               str(path), [])
    # --set ray.storage_path moves both stages' runs: stage 1's output moves with it
    with pytest.raises(ConfigError, match="does not exist"):
        conversion_for_student(cfg, str(path), [f"ray.storage_path={tmp_path}/elsewhere"])
    # a student that exists is its own shape
    ok = resolve_paths(load_stage_config(2, str(path), [f"model.student={models['student']}"]))
    assert conversion_for_student(ok, str(path), []) is None and conversion_note(ok, None) is None


# ------------------------------------------------------------------------------ the real pool, the real Ray
@pytest.mark.slow
def test_a_pool_port_taken_on_a_joined_local_ray_is_one_line_and_leaves_no_run_directory(tiny, tmp_path):
    """Before: a taken teacher.pool.port exited 1 after 14 s with Ray Serve's raw `Failed to bind to address
    '127.0.0.1:<port>'` traceback, nothing naming the key, and the run directory left behind. Here the run joins a
    local Ray (RAY_ADDRESS, as the demo's steps do), so the port can only be checked once Ray is up: the job checks
    it there, before Serve starts, names the key in one line, and removes the run directory it made."""
    from hylo.pipeline.ray_init import gcs_address, ray_running

    _, models = tiny
    cfg = write_config(tiny_config(models, tmp_path / "runs", "pool", stage=2,
                                   ray={"launcher": "ray", "num_workers": 1},
                                   teacher={"source": "serve", "pool": {"num_cpus": 0.5}}), tmp_path / "pool.yaml")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    with held, ray_running(None, 2, log_to_driver=False):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": gcs_address()}
        proc = subprocess.run([sys.executable, "-m", "hylo.jobs.stage2", "--config", str(cfg), "--set",
                               f"teacher.pool.port={port}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
    line = error_line(proc.returncode, proc.stdout, proc.stderr)
    assert line.startswith(f"error: teacher.pool.port={port}: the teacher pool's HTTP proxy cannot listen on "
                           f"127.0.0.1:{port} (another process listens there)"), line
    assert not (tmp_path / "runs" / "pool").exists()
