"""A run whose loss or gradient norm goes NaN / inf stops at that step and saves nothing from it.

The real loop (`loop.train_worker`, torchrun session, one gloo rank, DeepSpeed ZeRO 3 on CPU) trains the tiny
HyLo of tests/helpers/train.py at `optim.lr=1e30`: step 1 is finite and overflows the weights to ~1e30, step 2's loss
is NaN. Checked: the stop names the step and what was not finite (one `error:` line through the jobs' error
contract, exit status 2), the checkpoint of step 1 stays (with `checkpoint.keep=1`), none is written for a
non-finite step, no consolidated model is written, and metrics.jsonl says why the run stopped. Stage 1 is
run with `train.nonfinite_patience=1`: one non-finite step is tolerated (its checkpoint is skipped), the
second stops. The guard's own decisions and the cross-rank agreement are unit tests without DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hylo.pipeline.train.nonfinite import NonFiniteError, NonFiniteGuard, local_weights_finite, nonfinite_keys

from tests.helpers import train as train_helpers
from tests.helpers.common import one_thread  # noqa: F401  (one_thread: autouse)

# the one-rank gloo group of the in-process loop runs (shared with the other module that runs it)
gloo = train_helpers.gloo


# ------------------------------------------------------------------------------------ the guard alone
def test_a_finite_step_is_ok_and_leaves_the_record_alone():
    guard = NonFiniteGuard(0)
    record = {"step": 1, "loss": 2.5, "grad_norm": 0.7}
    assert guard.observe(dict(record)) == "ok"
    kept = dict(record)
    guard.observe(kept)
    assert kept == record


def test_patience_counts_non_finite_steps_in_a_row_then_stops():
    guard = NonFiniteGuard(2)
    nan = {"step": 3, "loss": float("nan"), "grad_norm": 1.0, "nonfinite": ["loss"]}
    assert guard.observe(dict(nan)) == "tolerate"
    assert guard.observe({"step": 4, "loss": 1.0, "grad_norm": 1.0}) == "ok"  # a finite step resets the count
    assert guard.observe(dict(nan, step=5)) == "tolerate"
    assert guard.observe(dict(nan, step=6)) == "tolerate"
    stopped = dict(nan, step=7, grad_norm=float("inf"), nonfinite=["loss", "grad_norm"])
    assert guard.observe(stopped) == "stop"
    assert stopped["stopped"] == "nonfinite_loss" and math.isnan(stopped["stopped_value"])
    assert stopped["nonfinite_streak"] == 3
    message = guard.stop_message(stopped, "step_00000004")
    assert message.startswith("step 7: the loss is nan and the gradient norm is inf (3 non-finite steps in a row)")
    assert "train.nonfinite_patience=2" in message and "step_00000004" in message


def test_a_non_finite_last_step_stops_whatever_the_patience():
    guard = NonFiniteGuard(5)
    record = {"step": 9, "loss": 1.0, "grad_norm": float("inf"), "nonfinite": ["grad_norm"]}
    assert guard.observe(record, last=True) == "stop"
    assert record["stopped"] == "nonfinite_grad_norm" and record["stopped_value"] == float("inf")


def test_nonfinite_keys_and_weights():
    assert nonfinite_keys(1.0, 0.0) == []
    assert nonfinite_keys(float("nan"), float("inf")) == ["loss", "grad_norm"]
    assert nonfinite_keys(1.0, float("-inf")) == ["grad_norm"]
    layer = torch.nn.Linear(3, 2)
    assert local_weights_finite(layer)
    with torch.no_grad():
        layer.bias[1] = float("inf")
    assert not local_weights_finite(layer)


def test_the_padding_of_a_zero3_partition_is_not_a_weight(monkeypatch):
    """ZeRO-3 pads the partitions of a parameter the ranks do not divide to one size and leaves the padding
    uninitialised (DeepSpeed's `_partition_param`: `torch.empty`). A NaN bit pattern there is not a weight: it
    stopped a fresh-clone demo's stage 1 at step 1 ("the weights after it are not finite", 2026-12-04). A
    non-finite element of the parameter still is."""
    from hylo.pipeline.train.nonfinite import own_elements

    # 5 elements over 2 ranks: partitions of 3; rank 1 holds elements 3 and 4, then one element of padding
    p = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    p.ds_numel = 5
    p.ds_tensor = torch.tensor([3.0, 4.0, float("nan")])
    assert own_elements(p, rank=1).tolist() == [3.0, 4.0]
    assert own_elements(p, rank=0).numel() == 3
    module = torch.nn.Module()
    module.register_parameter("w", p)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert local_weights_finite(module)
    p.ds_tensor[1] = float("inf")
    assert not local_weights_finite(module)


def test_the_patience_setting_is_checked_and_a_resume_may_change_it():
    from hylo.pipeline.config import ConfigError
    from hylo.pipeline.train.config import breaking_diff, config_to_dict, load_stage_config

    assert load_stage_config(2, None, []).train.nonfinite_patience == 0
    with pytest.raises(ConfigError, match="nonfinite_patience"):
        load_stage_config(2, None, ["train.nonfinite_patience=-1"])
    old = config_to_dict(load_stage_config(2, None, []))
    new = config_to_dict(load_stage_config(2, None, ["train.nonfinite_patience=3"]))
    assert breaking_diff(old, new) == []


def test_the_stop_is_one_error_line_with_exit_status_2(capsys):
    from hylo.pipeline.cli import input_error_message, job_main

    message = NonFiniteGuard(0).stop_message({"step": 2, "loss": float("nan"), "nonfinite": ["loss"]}, None)

    @job_main
    def main(argv=None) -> int:
        raise NonFiniteError(message)

    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {message}"]
    wrapped = RuntimeError("training failed")
    wrapped.__cause__ = NonFiniteError(message)
    assert input_error_message(wrapped) == message


# ------------------------------------------------------------------------------------ ranks agree
def _reduce_on_rank(rank: int, world: int, port: int, sums: dict[str, float], grad_norm: float, out) -> None:
    """One rank of a gloo group: `reduce_record` of this rank's step numbers; puts the record's verdict in `out`."""
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.loop import reduce_record
    from hylo.pipeline.train.worker import StepResult, WorkerContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = load_stage_config(2, None, [f"ray.num_workers={world}", "train.global_batch_sequences=2"])
        ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=torch.device("cpu"), dtype=torch.float32,
                            run_dir=Path("."), grad_accum=1, step=4)

        class Rows:
            position = {"rank": rank}

        record = reduce_record(ctx, StepResult(sums, 1e-3, grad_norm), [], Rows(), 1.0, 10)
        out.put((rank, record.get("nonfinite"), record["loss"], record["grad_norm"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_a_non_finite_grad_norm_on_one_rank_stops_every_rank():
    """The gradient norm is each rank's own number: one rank's inf must reach the other rank's verdict."""
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sums = {"loss_sum": 3.0, "kl_sum": 3.0, "ce_sum": 0.0, "loss_tokens": 2.0, "tokens": 4.0}
    procs = [ctx.Process(target=_reduce_on_rank, args=(r, 2, port, sums, [0.5, float("inf")][r], out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [g[1] for g in got] == [["grad_norm"], ["grad_norm"]]
    # the record is still the reduced one: both ranks' loss sums over both ranks' loss tokens
    assert [g[2] for g in got] == [pytest.approx(sums["loss_sum"] / sums["loss_tokens"])] * 2


def test_the_check_adds_no_host_read_to_a_step(tmp_path):
    """`reduce_record` reads the device once for its sums and once for its maxima, whatever the step's numbers,
    and the guard reads nothing: the verdicts ride along in the maxima (a GPU step syncs no more than before)."""
    from hylo.kernels.host_reads import HostReadLog
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.loop import reduce_record
    from hylo.pipeline.train.worker import StepResult, WorkerContext

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cfg = load_stage_config(2, None, ["ray.num_workers=1"])
        ctx = WorkerContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                            run_dir=tmp_path, grad_accum=1, step=3)

        class Rows:
            position = {"rank": 0}

        def step(loss_sum: float, grad_norm: float) -> tuple[dict, list[tuple[str, str]]]:
            sums = {"loss_sum": loss_sum, "kl_sum": loss_sum, "ce_sum": 0.0, "loss_tokens": 4.0, "tokens": 8.0}
            with HostReadLog() as log:
                record = reduce_record(ctx, StepResult(sums, 1e-3, grad_norm), [], Rows(), 1.0, 10)
                NonFiniteGuard(0).observe(record)
            # (op, "file function") of every read
            return record, [(name, f"{Path(caller.split(':')[0]).name} {caller.split('(')[-1].rstrip(')')}")
                            for name, caller in log.reads]

        finite, finite_reads = step(2.0, 0.5)
        nan, nan_reads = step(float("nan"), float("inf"))
    finally:
        dist.destroy_process_group()
    assert "nonfinite" not in finite and nan["nonfinite"] == ["loss", "grad_norm"] and nan["stopped"]
    assert sorted(nan_reads) == sorted(finite_reads)
    assert [r for r in finite_reads if r[1].startswith("worker.py")] == [("tolist", "worker.py all_sum"),
                                                                         ("tolist", "worker.py all_max")]
    assert not [r for r in finite_reads if r[1].startswith("nonfinite.py")]


# ------------------------------------------------------------------------------------ the real loop
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.helpers.train import make_tiny_models

    return make_tiny_models(tmp_path_factory.mktemp("nonfinite"))


def _job(stage: int, models, storage: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    """The stage's job (`jobs/stageN.py`'s main, torchrun launcher) in this process at world size 1: its exit
    status and its stderr lines."""
    from hylo.jobs import stage1, stage2

    from tests.helpers.train import tiny_config, write_config

    path = write_config(tiny_config(models, storage, f"s{stage}", stage=stage,
                                    train={"global_batch_sequences": 2, "max_steps": 4, "total_steps": 10},
                                    ray={"num_workers": 1}, checkpoint={"every_steps": 1, "keep": 1},
                                    metrics={"tensorboard": False}, model={"dtype": "float32"}),
                        storage / f"s{stage}.yaml")
    capsys.readouterr()
    try:
        rc = (stage1 if stage == 1 else stage2).main(["--config", str(path), *(a for e in extra for a in ("--set", e))])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # the next run in this process (another test) starts a new group
        train_helpers.forget_deepspeed_world()
    return rc, capsys.readouterr().err.strip().splitlines()


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow  # starts DeepSpeed
def test_lr_1e30_stops_at_the_first_nan_step_and_keeps_the_last_finite_checkpoint(gloo, models, tmp_path, capsys):
    from hylo.pipeline.train.checkpoint.layout import is_complete, step_dirs

    rc, err = _job(2, models, tmp_path, capsys, "optim.lr=1e30", "optim.warmup_ratio=0")
    assert rc == 2, err
    assert err[-1].startswith("error: step 2: the loss is nan"), err
    assert "step_00000001" in err[-1] and not any(line.startswith("error:") for line in err[:-1])
    # the checkpoint of the last finite step stays (checkpoint.keep=1); none is written after a NaN step
    assert [(s, is_complete(p)) for s, p in step_dirs(tmp_path / "s2")] == [(1, True)]
    assert not list((tmp_path / "s2").glob(".tmp-step_*"))
    assert not (tmp_path / "s2" / "model").exists()
    records = _records(tmp_path / "s2")
    assert [r["step"] for r in records] == [1, 2]
    assert math.isfinite(records[0]["loss"]) and "stopped" not in records[0]
    assert records[1]["stopped"] == "nonfinite_loss" and math.isnan(records[1]["stopped_value"])
    assert records[1]["nonfinite"][0] == "loss"


@pytest.mark.slow  # starts DeepSpeed
def test_patience_tolerates_one_non_finite_step_then_stops(gloo, models, tmp_path, capsys):
    from hylo.pipeline.train.checkpoint.layout import step_dirs

    rc, err = _job(1, models, tmp_path, capsys, "optim.lr=1e30", "optim.warmup_ratio=0",
                   "train.nonfinite_patience=1")
    assert rc == 2, err
    assert err[-1].startswith("error: step 3: the loss is nan"), err
    assert "(2 non-finite steps in a row)" in err[-1]
    # step 2 was tolerated but its checkpoint not written: step 1's is still the newest
    assert [s for s, _ in step_dirs(tmp_path / "s1")] == [1]
    assert not (tmp_path / "s1" / "model").exists()
    records = _records(tmp_path / "s1")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["nonfinite_streak"] == 1 and "stopped" not in records[1]
    assert records[2]["stopped"] == "nonfinite_loss"


@pytest.mark.slow  # starts DeepSpeed
def test_weights_that_are_not_finite_stop_the_run_before_their_checkpoint(gloo, models, tmp_path, capsys,
                                                                          monkeypatch):
    """Step 2's loss and gradient norm are finite, but afterwards one weight is inf (as a row of the embedding
    that no token of the batch used can overflow): its checkpoint and the model (step 2 is the last) are not
    written."""
    from hylo.pipeline.train import driver
    from hylo.pipeline.train.checkpoint.layout import step_dirs

    real = driver.stage_for

    def overflowing(number: int):
        stage = real(number)

        def train_step(task, rows, ctx):
            result = stage.train_step(task, rows, ctx)
            if ctx.step == 2:
                p = next(p for p in task.engine.module.parameters() if p.requires_grad)
                with torch.no_grad():
                    (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).view(-1)[0] = float("inf")
            return result

        return dataclasses.replace(stage, train_step=train_step)

    monkeypatch.setattr(driver, "stage_for", overflowing)
    rc, err = _job(2, models, tmp_path, capsys, "train.max_steps=2")
    assert rc == 2, err
    assert err[-1].startswith("error: step 2: the weights after it are not finite"), err
    assert [s for s, _ in step_dirs(tmp_path / "s2")] == [1]
    assert not (tmp_path / "s2" / "model").exists()
    records = _records(tmp_path / "s2")
    assert [r["step"] for r in records] == [1, 2]
    assert math.isfinite(records[1]["loss"]) and math.isfinite(records[1]["grad_norm"])
    assert records[1]["stopped"] == "nonfinite_weights"


@pytest.mark.slow  # imports DeepSpeed
def test_no_model_is_consolidated_from_weights_that_are_not_finite(models, tmp_path):
    from hylo.io import load_hylo
    from hylo.pipeline.train.checkpoint.consolidate import consolidate_hylo

    model = load_hylo(models["student"], dtype=torch.float32)
    assert consolidate_hylo(model, tmp_path / "finite", 0) is not None
    name, p = next(iter(model.named_parameters()))
    with torch.no_grad():
        p.view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteError, match=f"1 tensor.* hold NaN or inf .first: {name}.; no model written"):
        consolidate_hylo(model, tmp_path / "model", 0)
    assert not (tmp_path / "model").exists()
