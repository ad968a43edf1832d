"""Training end to end under Ray Train, and stage 1 in bf16, on a tiny HyLo (1 MLA + 1 GDN layer), 2 workers,
ZeRO-3 over gloo (the torchrun runs: tests/e2e/test_train_e2e.py):

* a worker SIGKILLed mid-step under Ray Train recovers by itself (FailureConfig) from the last
  checkpoint, and its losses equal the uninterrupted (torchrun) reference run's; an input error inside a worker
  is not retried. A worker killed right after a checkpoint, before Ray Train registered it, resumes from it
  (found in storage, not Ray's record): tests/e2e/test_faults_cluster.py's node loss `stage2-after_checkpoint`
  (the worker dies with its node, a superset of this file's SIGKILL of the worker alone; the same stage, step,
  checks and losses), and the candidates' order in tests/train/test_train_checkpoint.py;
* a Ray Train run on s3:// storage (a local S3 server): checkpoints, manifests, metrics and the model
  in the bucket; after the newest checkpoint is deleted (Ray's own record still points at it),
  `--resume` continues from the newest intact one, downloaded from the bucket;
* stage 1 (Enhanced-ILD) in bf16 trains only the mixers; the consolidated model holds the fp32 master
  weights of the mixers and the starting checkpoint's exact values of everything else.

The reference run and the tiny models are the whole `make test`'s (tests/helpers/runs.py), the local Ray is this module's
(`module_ray`: started once, not once a test); most of the time is process start-up: Ray Train ~30-60 s a run on
2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hylo.pipeline.ray_init import ray_running
from hylo.pipeline.train.checkpoint.layout import (
    checkpoint_problem,
    list_checkpoints,
)
from hylo.pipeline.train.metrics import read_metrics

from tests.helpers.ray_logs import RayLogs
from tests.helpers.train import (
    S3_ENV,
    assert_ok,
    assert_same_steps,
    tiny_config,
    torchrun,
    write_config,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def module_ray():
    """One local Ray (2 CPUs) for the module's Ray Train runs. What a test needs of the processes Ray starts is
    in their environment from the start: the local S3 server's dummy credentials (the S3 test)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in S3_ENV.items():
            mp.setenv(key, value)
        with ray_running(None, 2) as started:
            assert started, "a Ray was already running in this process"
            yield


def test_ray_worker_killed_mid_step_recovers_by_itself(tiny, reference, module_ray):
    from hylo.pipeline.train.driver import run

    root, models = tiny
    # a nested run name (as jobs/place_layers.py uses): Ray's checkpoints must land in the run directory
    cfg = tiny_config(models, root / "runs", "ray/recover", ray={"launcher": "ray", "max_failures": 1},
                      train={"max_steps": 8}, fault={"kill_at_step": 5, "kill_rank": 1, "kill_when": "mid_step"})
    cfg_path = write_config(cfg, root / "ray.yaml")
    summary = run(2, ["--config", str(cfg_path)])
    rd = root / "runs" / "ray" / "recover"
    got = read_metrics(rd)
    assert (rd / ".fault-step5-mid_step-rank1").exists()
    assert list(got) == list(range(1, 9)) and summary["last_step"] == 8
    # Steps after the kill were recomputed from the step-3 checkpoint, and match the clean run exactly.
    assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
    assert_same_steps(read_metrics(reference), got, range(1, 9))
    assert (rd / "step_00000006").is_dir() and (rd / "model" / "hybrid_config.json").is_file()
    assert checkpoint_problem(rd / "step_00000006", deep=True) is None
    assert list((rd / "tensorboard").glob("events.out.tfevents.*"))


def test_an_input_error_inside_a_worker_is_not_retried(tiny, monkeypatch, module_ray):
    """A teacher of another vocabulary that got past the driver's checks (here: switched off) fails
    inside the workers with a ConfigError: the run stops after the first attempt, not after
    ray.max_failures more attempts that load both models again."""
    import hylo.pipeline.train.driver as driver
    from hylo.pipeline.train.driver import TrainingError, run

    from tests.helpers.teacher import save_tiny_llama

    root, models = tiny
    teacher = save_tiny_llama(root / "teacher-v128", vocab_size=128)
    cfg = tiny_config(models, root / "runs", "ray-input-error", ray={"launcher": "ray", "max_failures": 2},
                      teacher={"model": {"path": str(teacher)}})
    monkeypatch.setattr(driver, "check_stage_inputs", lambda cfg: None)
    logs = RayLogs.of_connected()
    with pytest.raises(TrainingError, match="ConfigError: teacher vocabulary 128 != student vocabulary 96"):
        run(2, ["--config", str(write_config(cfg, root / "ray-input-error.yaml"))])
    # Ray Train's controller said why, and the workers' own output counts the attempts
    text = logs.wait_for("not retrying: the input is wrong")
    # one attempt: each of the 2 workers failed once at most (Ray logs every failed training function);
    # with Ray's own policy 3 attempts (max_failures=2) print it 3 times or more
    assert 1 <= text.count("Error in training function") <= 2, text.count("Error in training function")


def test_ray_run_on_s3_saves_resumes_and_survives_a_deleted_checkpoint(tiny, reference, capfd, module_ray):
    """s3:// storage through a local S3 server: Ray Train uploads the checkpoints, rank 0 the manifest,
    metrics, TensorBoard files and the model; after the user deletes the newest checkpoint (Ray's
    record of the run still points at it), --resume continues from the newest intact one, downloaded
    from the bucket."""
    import shutil

    from hylo.pipeline.train.driver import run
    from hylo.pipeline.train.storage import Loc, local_mirror

    from tests.helpers.train import fake_s3

    root, models = tiny
    with fake_s3() as s3:
        cfg = tiny_config(models, s3("runs"), "ray/s3", ray={"launcher": "ray"}, train={"max_steps": 6})
        cfg_path = write_config(cfg, root / "s3.yaml")
        try:
            first = run(2, ["--config", str(cfg_path)])
            rd = Loc.of(s3("runs/ray/s3"))
            assert first["run_dir"] == str(rd) and [s for s, _ in list_checkpoints(rd)] == [3, 6]
            assert (rd / "model" / "hybrid_config.json").is_file() and (rd / "config_stage2.json").is_file()
            assert (rd / "checkpoint_manager_snapshot.json").is_file() and (rd / "tensorboard").files()
            assert list(read_metrics(rd)) == list(range(1, 7))
            (rd / "step_00000006").rmtree()
            capfd.readouterr()
            second = run(2, ["--config", str(cfg_path), "--resume", "--set", "train.max_steps=8"])
            out = capfd.readouterr().err  # the driver's log lines
        finally:
            shutil.rmtree(local_mirror(Loc.of(s3("runs/ray/s3"))), ignore_errors=True)
        assert "points at step_00000006, which is missing" in out, out[-3000:]
        got = read_metrics(rd)
        assert second["last_step"] == 8 and list(got) == list(range(1, 9))
        assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
        assert_same_steps(read_metrics(reference), got, range(1, 9))
        assert [s for s, _ in list_checkpoints(rd)] == [3, 6, 8]
    assert not list(REPO.glob("s3:*")) and not list(Path.cwd().glob("s3:*"))


# ild.trainable: what stage 1 trains (all: every parameter of every decoder layer; mixers: the new mixers)
STAGE1_TRAINED = {"all": lambda n: n.startswith("model.layers."), "mixers": lambda n: ".mixer." in n}


@pytest.mark.parametrize("trainable", ["mixers", "all"])
def test_stage1_bf16_keeps_master_weights_and_frozen_originals(tiny, trainable):
    from hylo.modeling import HyLoForCausalLM

    root, models = tiny
    cfg = write_config(tiny_config(models, root / "runs", f"stage1-{trainable}", stage=1, train={"max_steps": 4},
                                   optim={"lr": 3e-3, "warmup_ratio": 0.0}, model={"dtype": "bfloat16"},
                                   ild={"trainable": trainable}),
                       root / f"stage1-{trainable}.yaml")
    proc = torchrun(1, cfg, "--set", "checkpoint.delete_after_consolidate=true")
    assert_ok(proc)
    run = root / "runs" / f"stage1-{trainable}"
    # the run checkpointed (every 3 steps and at the end), then removed its checkpoints after consolidating
    assert "removed 2 checkpoint(s)" in proc.stderr, proc.stderr[-2000:]
    assert not [p.name for p in run.iterdir() if "step_" in p.name]
    assert (run / "model" / "hybrid_config.json").is_file()
    got = read_metrics(run)
    assert list(got) == [1, 2, 3, 4] and got[4]["loss"] < got[1]["loss"]
    assert got[1]["loss"] == pytest.approx(got[1]["ild_output"] + got[1]["ild_mixer"], rel=1e-3)
    before = HyLoForCausalLM.from_pretrained(models["student"])
    after = HyLoForCausalLM.from_pretrained(run / "model")
    assert next(after.parameters()).dtype == torch.float32
    is_trained = STAGE1_TRAINED[trainable]
    pairs = list(zip(before.named_parameters(), after.named_parameters()))
    for (name, p0), (_, p1) in pairs:
        if not is_trained(name):
            # frozen: the starting checkpoint's exact fp32 values, not their bf16 working copies
            assert torch.equal(p0, p1), f"{name} changed but ild.trainable={trainable} does not train it"
    trained = [(n, p0, p1) for (n, p0), (_, p1) in pairs if is_trained(n)]
    for part in (".mixer.",) + ((".mlp.", "layernorm.") if trainable == "all" else ()):
        assert any(not torch.equal(p0, p1) for n, p0, p1 in trained if part in n), f"no {part} parameter was trained"
    # trained: the optimiser's fp32 masters, which bf16 cannot represent (bf16 working weights could)
    off_grid = sum(int((p1 != p1.bfloat16().float()).sum()) for _, _, p1 in trained)
    assert off_grid > 0.5 * sum(p1.numel() for _, _, p1 in trained), off_grid
