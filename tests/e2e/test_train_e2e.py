"""Training end to end on a tiny HyLo (1 MLA + 1 GDN layer), 2 workers, ZeRO-3 over gloo:

* exact resume (torchrun): 12 steps uninterrupted vs killed (SIGKILL) after step 6 and resumed with
  --resume: identical per-step losses and rows, after walking back past a truncated shard of the
  newest checkpoint and repairing a torn last line of metrics.jsonl; a planted pickle payload whose
  manifest was forged to match is refused by DeepSpeed's (weights-only) load and never runs;
* ZeRO-3 partitions (~1/2 of the parameters per rank), the consolidated HF checkpoint (equal to
  DeepSpeed's own zero_to_fp32 reconstruction, loadable by `HyLoForCausalLM.from_pretrained`);
* the run's start-up clock (startup.json).
Ray Train's runs and stage 1 in bf16 are in tests/e2e/test_train_e2e_ray.py (a file of its own, so that
`make test` runs it beside this one).

One reference run is shared by the whole `make test` (tests/helpers/runs.py); every run is a few seconds of compute (most of the time is
process start-up: torchrun ~20 s, Ray Train ~60-90 s on 2 cores).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hylo.pipeline.train.checkpoint.layout import (
    CHECKPOINT_MANIFEST,
    checkpoint_problem,
    is_complete,
    list_checkpoints,
    sha256_file,
)
from hylo.pipeline.train.metrics import read_metrics

from tests.helpers.logs import logged
from tests.helpers.runs import logged_by
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
    assert killed.returncode != 0 and "SIGKILL at step 6" in killed.stderr
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
    out = resumed.stderr  # what the ranks logged
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
    out = killed.stderr
    assert killed.returncode != 0 and "SIGKILL at step 8" in out, killed.stdout[-3000:] + out[-3000:]
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
    assert f"resumed from {run / 'step_00000006'} at step 6" in resumed.stderr
    assert "starts a new line" not in resumed.stderr
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
    # each run's exit status and the end of its output, in full (a list in the message would be cut by pytest)
    assert sorted(c == 0 for c in codes) == [False, True], "\n\n".join(
        f"run {i}: exit {c}\n{o[-3000:]}\n{e[-6000:]}" for i, (c, (o, e)) in enumerate(zip(codes, outs)))
    rd = root / "runs" / "shared"
    _, loser_err = outs[codes.index(next(c for c in codes if c != 0))]
    assert f"run directory {rd} is in use by another run (pid " in loser_err, loser_err[-3000:]
    assert not (rd / "run.lock").exists()
    got = read_metrics(rd)
    assert list(got) == list(range(1, 13)) and all(got[s]["resumed_from"] == 0 for s in got)
    assert_same_steps(read_metrics(reference), got, range(1, 13))
    assert len((rd / "metrics.jsonl").read_text().splitlines()) == 12


def test_zero3_partitions_each_rank_holds_half(reference):
    import json

    part = json.loads((reference / "zero_partition.json").read_text())
    print("ZeRO-3 partition fractions per rank:", part["fractions"])
    assert part["world_size"] == 2 and part["zero_stage"] == 3
    for f in part["fractions"]:
        assert f == pytest.approx(0.5, abs=0.01)
    # each rank counts its own elements, not the padding ZeRO-3 gives the last rank's partitions
    assert sum(r["held"] for r in part["ranks"]) == part["ranks"][0]["total"]


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


def test_each_ranks_log_lines_carry_its_rank(reference):
    """The reference run (torchrun, 2 ranks, stage 2): every line the ranks logged has its time, level and
    rank (hylo/logs.py), and the rank it names is the rank that wrote it: each rank's `[zero] rank R: holds
    ...` line is labelled `rank R/2`. One node: no node on the line. Rank 0's progress lines are so too."""
    lines = logged(logged_by(reference))
    zero = {line.rank: line.message for line in lines if line.message.startswith("[zero] rank ")}
    assert set(zero) == {"rank 0/2", "rank 1/2"}, zero
    for label, message in zero.items():
        assert message.startswith(f"[zero] {label.split('/')[0]}: holds "), (label, message)
    steps = [line for line in lines if line.message.startswith("[stage2] step ")]
    assert [line.message.split()[2] for line in steps] == [f"{s}/12" for s in range(1, 13)]
    assert {line.rank for line in steps} == {"rank 0/2"} and {line.level for line in steps} == {"INFO"}
    assert all(a.time <= b.time for a, b in zip(steps, steps[1:]))
    # no line of the ranks' own went around the logger: each [train], [zero], [stage2] line is a logged one
    tagged = re.compile(r"\[(train|zero|stage2|resume)\] ")
    printed = [ln for ln in logged_by(reference).splitlines() if tagged.match(ln)]
    assert not printed, printed[:5]


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
