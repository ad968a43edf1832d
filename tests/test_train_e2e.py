"""Training end to end on a tiny HyLo (1 MLA + 1 GDN layer), 2 workers, ZeRO-3 over gloo:

* exact resume (torchrun): 12 steps uninterrupted vs killed (SIGKILL) after step 6 and resumed with
  --resume: identical per-step losses and rows;
* a worker SIGKILLed mid-step under Ray Train recovers by itself (FailureConfig) from the last
  checkpoint, and its losses equal the uninterrupted run's;
* ZeRO-3 partitions (~1/2 of the parameters per rank), the consolidated HF checkpoint (equal to
  DeepSpeed's own zero_to_fp32 reconstruction, loadable by `HyLoForCausalLM.from_pretrained`);
* stage 1 (Enhanced-ILD) trains only the mixers and writes a HyLo checkpoint.

One reference run is shared by the module; every run is a few seconds of compute (most of the time is
process start-up: torchrun ~20 s, Ray Train ~60-90 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.train.metrics import read_metrics
from pipeline.train.testing import make_tiny_models, tiny_config, write_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TOL = 1e-6


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def torchrun(stage: int, config: Path, *extra: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "jobs" / f"stage{stage}.py"), "--config", str(config), *extra]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_steps(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    for s in steps:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= TOL, (s, a[s]["loss"], b[s]["loss"])
        assert a[s]["rows"] == b[s]["rows"], s
        assert a[s]["data_position"] == b[s]["data_position"], s


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


def test_exact_resume_after_sigkill(tiny, reference):
    from pipeline.config import ConfigError
    from pipeline.train.config import load_stage_config
    from pipeline.train.driver import check_run_dir

    root, models = tiny
    cfg_path = write_config(tiny_config(models, root / "runs", "killed"), root / "killed.yaml")
    killed = torchrun(2, cfg_path, "--set", "fault.kill_at_step=6", "--set", "fault.kill_when=after_checkpoint",
                      "--set", "fault.kill_rank=1")
    assert killed.returncode != 0 and "SIGKILL at step 6" in killed.stdout
    run = root / "runs" / "killed"
    assert max(read_metrics(run)) == 6 and (run / "step_00000006").is_dir()
    # Restarting without --resume is refused with a clear message.
    with pytest.raises(ConfigError, match="pass --resume"):
        check_run_dir(load_stage_config(2, cfg_path), None)
    assert_ok(torchrun(2, cfg_path, "--resume"))
    ref, got = read_metrics(reference), read_metrics(run)
    assert list(got) == list(range(1, 13)) and all(got[s]["resumed_from"] == 6 for s in range(7, 13))
    assert_same_steps(ref, got, range(1, 13))


def test_ray_worker_killed_mid_step_recovers_by_itself(tiny, reference):
    from pipeline.train.driver import run

    root, models = tiny
    # a nested run name (as jobs/place_layers.py uses): Ray's checkpoints must land in the run directory
    cfg = tiny_config(models, root / "runs", "ray/recover", ray={"launcher": "ray", "max_failures": 1},
                      train={"max_steps": 8}, fault={"kill_at_step": 5, "kill_rank": 1, "kill_when": "mid_step"})
    cfg_path = write_config(cfg, root / "ray.yaml")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {k: _env()[k] for k in
                                                                            ("PYTHONPATH", "TORCH_EXTENSIONS_DIR")}})
    try:
        summary = run(2, ["--config", str(cfg_path)])
    finally:
        ray.shutdown()
    rd = root / "runs" / "ray" / "recover"
    got = read_metrics(rd)
    assert (rd / ".fault-step5-mid_step-rank1").exists()
    assert list(got) == list(range(1, 9)) and summary["last_step"] == 8
    # Steps after the kill were recomputed from the step-3 checkpoint, and match the clean run exactly.
    assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
    assert_same_steps(read_metrics(reference), got, range(1, 9))
    assert (rd / "step_00000006").is_dir() and (rd / "model" / "hybrid_config.json").is_file()
    assert list((rd / "tensorboard").glob("events.out.tfevents.*"))


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


def test_stage1_trains_only_the_mixers(tiny):
    from hylo.modeling import HyLoForCausalLM

    root, models = tiny
    cfg = write_config(tiny_config(models, root / "runs", "stage1", stage=1, train={"max_steps": 4},
                                   optim={"lr": 3e-3, "warmup_ratio": 0.0}), root / "stage1.yaml")
    proc = torchrun(1, cfg, "--set", "checkpoint.delete_after_consolidate=true")
    assert_ok(proc)
    run = root / "runs" / "stage1"
    # the run checkpointed (every 3 steps and at the end), then removed its checkpoints after consolidating
    assert "removed 2 checkpoint(s)" in proc.stdout, proc.stdout[-2000:]
    assert not [p.name for p in run.iterdir() if "step_" in p.name]
    assert (run / "model" / "hybrid_config.json").is_file()
    got = read_metrics(run)
    assert list(got) == [1, 2, 3, 4] and got[4]["loss"] < got[1]["loss"]
    assert got[1]["loss"] == pytest.approx(got[1]["ild_output"] + got[1]["ild_mixer"])
    before = HyLoForCausalLM.from_pretrained(models["student"])
    after = HyLoForCausalLM.from_pretrained(run / "model")
    for (name, p0), (_, p1) in zip(before.named_parameters(), after.named_parameters()):
        if ".mixer." not in name:
            assert torch.equal(p0, p1), f"{name} changed but stage 1 must train only the mixers"
    changed = [n for (n, p0), (_, p1) in zip(before.named_parameters(), after.named_parameters())
               if ".mixer." in n and not torch.equal(p0, p1)]
    assert changed, "no mixer parameter was trained"
