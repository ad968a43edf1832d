"""Training end to end on a tiny HyLo (1 MLA + 1 GDN layer), 2 workers, ZeRO-3 over gloo:

* exact resume (torchrun): 12 steps uninterrupted vs killed (SIGKILL) after step 6 and resumed with
  --resume: identical per-step losses and rows, after walking back past a truncated shard of the
  newest checkpoint and repairing a torn last line of metrics.jsonl; a planted pickle payload whose
  manifest was forged to match is refused by DeepSpeed's (weights-only) load and never runs;
* a worker SIGKILLed mid-step under Ray Train recovers by itself (FailureConfig) from the last
  checkpoint, and its losses equal the uninterrupted run's;
* a Ray Train run on s3:// storage (a local S3 server): checkpoints, manifests, metrics and the model
  in the bucket; after the newest checkpoint is deleted (Ray's own record still points at it),
  `--resume` continues from the newest intact one, downloaded from the bucket;
* ZeRO-3 partitions (~1/2 of the parameters per rank), the consolidated HF checkpoint (equal to
  DeepSpeed's own zero_to_fp32 reconstruction, loadable by `HyLoForCausalLM.from_pretrained`);
* stage 1 (Enhanced-ILD) in bf16 trains only the mixers; the consolidated model holds the fp32 master
  weights of the mixers and the starting checkpoint's exact values of everything else.

One reference run is shared by the module; every run is a few seconds of compute (most of the time is
process start-up: torchrun ~20 s, Ray Train ~60-90 s on 2 cores).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hylo.pipeline.ray_init import ray_running
from hylo.pipeline.train.checkpoint.layout import (
    CHECKPOINT_MANIFEST,
    checkpoint_problem,
    is_complete,
    list_checkpoints,
    sha256_file,
)
from hylo.pipeline.train.metrics import read_metrics

from tests.helpers.train import (
    assert_ok,
    assert_same_steps,
    job_env,
    make_tiny_models,
    tiny_config,
    torchrun,
    write_config,
)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, make_tiny_models(root / "models")


@pytest.fixture(scope="module")
def reference(tiny):
    """Stage 2, 12 steps, uninterrupted (checkpoint every 3 steps)."""
    root, models = tiny
    cfg = write_config(tiny_config(models, root / "runs", "reference"), root / "reference.yaml")
    assert_ok(torchrun(2, cfg))
    return root / "runs" / "reference"


def _plant_payload(ckpt: Path, marker: Path) -> None:
    """Replace both ranks' model-state shards with a pickle that creates `marker` when unpickled, and
    forge the manifest to match (sizes and checksums)."""
    import json

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "pwned"))

    manifest = json.loads((ckpt / CHECKPOINT_MANIFEST).read_text())
    for shard in sorted((ckpt / "zero" / "state").glob("*model_states.pt")):
        torch.save({"module": Payload(), "param_shapes": []}, shard)
        manifest["files"][shard.relative_to(ckpt).as_posix()] = {
            "size": shard.stat().st_size, "sha256": sha256_file(shard)}
    (ckpt / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))


def test_exact_resume_after_sigkill(tiny, reference):
    import shutil

    from hylo.pipeline.config import ConfigError
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.driver import check_run_dir

    root, models = tiny
    cfg_path = write_config(tiny_config(models, root / "runs", "killed"), root / "killed.yaml")
    killed = torchrun(2, cfg_path, "--set", "fault.kill_at_step=6", "--set", "fault.kill_when=after_checkpoint",
                      "--set", "fault.kill_rank=1")
    assert killed.returncode != 0 and "SIGKILL at step 6" in killed.stdout
    run = root / "runs" / "killed"
    assert max(read_metrics(run)) == 6 and is_complete(run / "step_00000006")
    assert checkpoint_problem(run / "step_00000003", deep=True) is None
    # Restarting without --resume is refused with a clear message.
    with pytest.raises(ConfigError, match="pass --resume"):
        check_run_dir(load_stage_config(2, cfg_path), None)

    # The newest checkpoint loses half of a ZeRO optimiser shard (a disk that filled up).
    shard = run / "step_00000006" / "zero" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    # A crafted step 3 whose manifest matches: resume refuses it and the payload never runs.
    backup = root / "step3-backup"
    shutil.copytree(run / "step_00000003", backup)
    marker = root / "pwned"
    _plant_payload(run / "step_00000003", marker)
    refused = torchrun(2, cfg_path, "--resume")
    assert refused.returncode != 0 and not marker.exists()
    assert "refused to load a DeepSpeed file" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    shutil.rmtree(run / "step_00000003")
    shutil.copytree(backup, run / "step_00000003")

    # The driver was killed while appending a metrics line.
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"loss": 1.23, "step": 7, "ro')
    resumed = torchrun(2, cfg_path, "--resume")
    assert_ok(resumed)
    out = resumed.stdout
    assert "[resume] skipping step_00000006" in out and "zero_pp_rank_1_mp_rank_00_optim_states.pt: " in out
    assert "resuming from step_00000003, the newest intact checkpoint" in out
    assert "dropped a torn or unreadable line" in out
    ref, got = read_metrics(reference), read_metrics(run)
    assert list(got) == list(range(1, 13)) and all(got[s]["resumed_from"] == 3 for s in range(4, 13))
    assert_same_steps(ref, got, range(1, 13))
    # the file holds one record per step: the repaired run dropped the records it recomputed
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 12


def test_resume_from_an_older_checkpoint_starts_a_new_line_of_checkpoints(tiny, reference):
    """A resume from an older checkpoint starts a new line of checkpoints: with checkpoints 3, 6, 9, 12 and
    checkpoint.keep=2, `--resume step_00000003` sets 6, 9, 12 (and a copy of the metrics) aside, saying so
    once, and prunes neither step 3 nor the step 6 it writes (the two oldest of 3, 6, 9, 12); after a worker
    is killed at step 8, `--resume` continues from the new line's step 6, never from the abandoned step 12,
    and the line ends with the losses, rows and data positions of an uninterrupted run."""
    import shutil

    root, models = tiny
    # a copy of the reference run (ray.name is part of what a resume checks)
    run = root / "runs-older" / "reference"
    shutil.copytree(reference, run)
    cfg_path = write_config(tiny_config(models, root / "runs-older", "reference",
                                        checkpoint={"every_steps": 3, "keep": 2}), root / "older.yaml")
    killed = torchrun(2, cfg_path, "--resume", "step_00000003", "--set", "fault.kill_at_step=8",
                      "--set", "fault.kill_when=mid_step", "--set", "fault.kill_rank=1")
    out = killed.stdout
    assert killed.returncode != 0 and "SIGKILL at step 8" in out, out[-3000:] + killed.stderr[-3000:]
    assert out.count("starts a new line of checkpoints") == 1, out[-3000:]
    assert "checkpoint.keep=2: removed" not in out  # 3 and 6 are the new line's two checkpoints
    (aside,) = (run / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl", "step_00000006", "step_00000009",
                                                       "step_00000012"]
    assert checkpoint_problem(aside / "step_00000012", deep=True) is None
    assert list(read_metrics(aside)) == list(range(1, 13))
    assert [s for s, _ in list_checkpoints(run)] == [3, 6]

    resumed = torchrun(2, cfg_path, "--resume")
    assert_ok(resumed)
    assert f"resumed from {run / 'step_00000006'} at step 6" in resumed.stdout
    assert "starts a new line" not in resumed.stdout
    assert [s for s, _ in list_checkpoints(run)] == [9, 12]
    got = read_metrics(run)
    assert list(got) == list(range(1, 13)) and len((run / "metrics.jsonl").read_text().splitlines()) == 12
    assert [got[s]["resumed_from"] for s in range(4, 13)] == [3] * 3 + [6] * 6
    assert_same_steps(read_metrics(reference), got, range(1, 13))


def test_resume_with_a_student_of_another_width_is_refused_before_ray_starts(tiny, reference):
    """`--resume` with a model.student of another width (model.student may change across a resume): the
    driver compares the student with the shapes the checkpoint holds before Ray starts: one line, rc 2,
    nothing retried (not DeepSpeed's `The size of tensor a ... must match` in every worker, retried, rc 1)."""
    import shutil

    root, models = tiny
    wide = make_tiny_models(root / "wide", hidden_size=48)
    run = root / "runs-wide" / "reference"
    shutil.copytree(reference, run)
    cfg_path = write_config(tiny_config(models, root / "runs-wide", "reference", ray={"launcher": "ray"}),
                            root / "wide.yaml")
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "stage2.py"), "--config", str(cfg_path), "--resume",
                           "--set", f"model.student={wide['student']}"], cwd=REPO, env=job_env(), capture_output=True,
                          text=True, timeout=600)
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert err.startswith(f"error: cannot resume from {run / 'step_00000012'}: model.student='{wide['student']}' "
                          "is not the model it trained ("), err
    assert "first lm_head.weight: (96, 32) in the checkpoint, (96, 48) in the student" in err, err
    assert f"(model.student='{models['student']}')" in err
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_two_runs_with_the_same_storage_and_name_cannot_overwrite_each_other(tiny, reference):
    """Two runs of one run directory started together (both pass the "already holds checkpoints" check,
    neither has written one yet): one of them stops at once naming the other (the run lock), which ends as
    an uninterrupted run would; neither replaces the other's metrics, checkpoints or model."""
    root, models = tiny
    cfg_path = write_config(tiny_config(models, root / "runs", "shared"), root / "shared.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "jobs" / "stage2.py"), "--config", str(cfg_path)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(c == 0 for c in codes) == [False, True], [(c, e[-2000:]) for c, (_, e) in zip(codes, outs)]
    rd = root / "runs" / "shared"
    _, loser_err = outs[codes.index(next(c for c in codes if c != 0))]
    assert f"run directory {rd} is in use by another run (pid " in loser_err, loser_err[-3000:]
    assert not (rd / "run.lock").exists()
    got = read_metrics(rd)
    assert list(got) == list(range(1, 13)) and all(got[s]["resumed_from"] == 0 for s in got)
    assert_same_steps(read_metrics(reference), got, range(1, 13))
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 12


def test_ray_worker_killed_mid_step_recovers_by_itself(tiny, reference):
    from hylo.pipeline.train.driver import run

    root, models = tiny
    # a nested run name (as jobs/place_layers.py uses): Ray's checkpoints must land in the run directory
    cfg = tiny_config(models, root / "runs", "ray/recover", ray={"launcher": "ray", "max_failures": 1},
                      train={"max_steps": 8}, fault={"kill_at_step": 5, "kill_rank": 1, "kill_when": "mid_step"})
    cfg_path = write_config(cfg, root / "ray.yaml")
    with ray_running(None, 2):
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


def test_ray_worker_killed_right_after_a_checkpoint_resumes_from_it(tiny, reference):
    """A worker SIGKILLed just after step 6's manifest, before Ray Train has registered that checkpoint:
    the relaunched group resumes from step 6 (found in storage), not from Ray's record (step 3, or none
    at all: it restarted from step 0)."""
    from hylo.pipeline.train.driver import run

    root, models = tiny
    cfg = tiny_config(models, root / "runs", "ray-after-ckpt", ray={"launcher": "ray", "max_failures": 1},
                      train={"max_steps": 8}, fault={"kill_at_step": 6, "kill_rank": 1,
                                                     "kill_when": "after_checkpoint"})
    with ray_running(None, 2):
        summary = run(2, ["--config", str(write_config(cfg, root / "ray-after-ckpt.yaml"))])
    rd = root / "runs" / "ray-after-ckpt"
    got = read_metrics(rd)
    assert (rd / ".fault-step6-after_checkpoint-rank1").exists() and summary["last_step"] == 8
    assert list(got) == list(range(1, 9))
    assert [got[s]["resumed_from"] for s in (7, 8)] == [6, 6], [got[s]["resumed_from"] for s in got]
    assert_same_steps(read_metrics(reference), got, range(1, 9))


def test_an_input_error_inside_a_worker_is_not_retried(tiny, capfd, monkeypatch):
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
    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")  # every worker's failure printed, to count the attempts
    capfd.readouterr()
    with ray_running(None, 2):
        with pytest.raises(TrainingError, match="ConfigError: teacher vocabulary 128 != student vocabulary 96"):
            run(2, ["--config", str(write_config(cfg, root / "ray-input-error.yaml"))])
    out = capfd.readouterr()
    text = out.out + out.err
    assert "not retrying: the input is wrong" in text, text[-3000:]
    # one attempt: each of the 2 workers failed once at most (Ray logs every failed training function);
    # with Ray's own policy 3 attempts (max_failures=2) print it 3 times or more
    assert 1 <= text.count("Error in training function") <= 2, text.count("Error in training function")


def test_ray_run_on_s3_saves_resumes_and_survives_a_deleted_checkpoint(tiny, reference, capfd):
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
        with ray_running(None, 2):
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
                out = capfd.readouterr().out
            finally:
                shutil.rmtree(local_mirror(Loc.of(s3("runs/ray/s3"))), ignore_errors=True)
        assert "points at step_00000006, which is missing" in out, out[-3000:]
        got = read_metrics(rd)
        assert second["last_step"] == 8 and list(got) == list(range(1, 9))
        assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
        assert_same_steps(read_metrics(reference), got, range(1, 9))
        assert [s for s, _ in list_checkpoints(rd)] == [3, 6, 8]
    assert not list(REPO.glob("s3:*")) and not list(Path.cwd().glob("s3:*"))


def test_zero3_partitions_each_rank_holds_half(reference):
    import json

    part = json.loads((reference / "zero_partition.json").read_text())
    print("ZeRO-3 partition fractions per rank:", part["fractions"])
    assert part["world_size"] == 2 and part["zero_stage"] == 3
    for f in part["fractions"]:
        assert f == pytest.approx(0.5, abs=0.01)
    assert sum(r["held"] for r in part["ranks"]) >= part["ranks"][0]["total"]


def test_consolidated_checkpoint_equals_zero_to_fp32(reference):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from hylo.modeling import HyLoForCausalLM

    model = HyLoForCausalLM.from_pretrained(reference / "model")
    zero = get_fp32_state_dict_from_zero_checkpoint(str(reference / "step_00000012" / "zero"), tag="state")
    ours = model.state_dict()
    for key, value in zero.items():
        name = key.removeprefix("student.")
        assert torch.equal(ours[name], value.float()), name
    initial = HyLoForCausalLM.from_pretrained(reference.parent.parent / "models" / "student")
    # the tokenizer travels from the starting checkpoint into the consolidated model (eval needs it)
    assert (reference / "model" / "tokenizer.json").read_bytes() == \
        (reference.parent.parent / "models" / "student" / "tokenizer.json").read_bytes()
    assert not torch.equal(initial.model.layers[0].mixer.o_proj.weight, model.model.layers[0].mixer.o_proj.weight)


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
    assert "removed 2 checkpoint(s)" in proc.stdout, proc.stdout[-2000:]
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


def test_the_run_says_where_its_start_up_went(reference):
    """Rank 0 writes its start-up clock (pipeline/train/startup.py) after the first step: every phase, DeepSpeed's
    set-up apart from the model load, and no Ray start under torchrun."""
    import json

    from hylo.pipeline.train.startup import PHASES, STARTUP_FILE

    got = json.loads((reference / STARTUP_FILE).read_text())
    phases = got["phases"]
    assert set(phases) == set(PHASES) and got["world_size"] == 2 and got["stage"] == 2
    assert phases["ray start"] == 0.0
    assert all(phases[p] > 0 for p in ("import", "process group", "model load", "deepspeed init", "first step"))
