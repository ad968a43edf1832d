"""What `hylo estimate` prints a user (pipeline/estimate/report.py, advice.py, cli.py, tracking.py): memory lines
that are parts of what they sit under, the run's GPUs in all, advice that the config's own rules accept, and
none of torch's notes to its developers on the terminal."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from hylo.pipeline.estimate import advice
from hylo.pipeline.estimate.gpus import GIB, GPU, GPUS
from hylo.pipeline.estimate.report import ACTIVATIONS, format_table
from hylo.pipeline.estimate.sp_teacher import TeacherDims
from hylo.pipeline.estimate.step import Estimate
from hylo.pipeline.train.config import load_stage_config

from tests.helpers.models import tiny_student, tiny_teacher

REPO = Path(__file__).resolve().parents[2]
RECIPE_1B = REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"
ZERO = "ZeRO-3 gathered parameters + reduce bucket"


def _estimate(loss_at_peak: float | None) -> Estimate:
    memory = {"parameters": 0.8 * GIB, "gradients": 0.1 * GIB, ACTIVATIONS: 18.7 * GIB, ZERO: 1.5 * GIB}
    return Estimate(stage=2, tokens=65536, world_size=4, dtype="bfloat16", parameters=1, trainable_parameters=1,
                    memory=memory, peak_bytes=sum(memory.values()), peak_phase="forward/backward",
                    loss_chunk_bytes=2.7 * GIB, flops={"student forward": 10**12}, host_reads=[],
                    flops_by_dtype={"student forward": {"bf16": 10**12}}, loss_at_peak=loss_at_peak)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def test_each_memory_line_sits_under_what_it_is_a_part_of():
    lines = format_table("training GPU:", [_estimate(None)]).splitlines()
    parts = [ln for ln in lines if ln.startswith("  ") and ln.split()[0] in ("parameters", "gradients", "activations,",
                                                                              "ZeRO-3")]
    # the parts at one depth, their sum printed as the peak
    assert len(parts) == 4 and {_indent(p) for p in parts} == {2}
    peak = next(ln for ln in lines if ln.startswith("peak"))
    assert "sum" in peak and peak.split()[-1] == f"{21.1:.1f}"
    # the fused loss's own peak is not a part of the peak (it was reached elsewhere): never indented under a part
    loss = next(i for i, ln in enumerate(lines) if "fused loss" in ln)
    assert _indent(lines[loss]) == 0 and lines.index(peak) < loss
    # a peak inside the loss: the loss's share is a part of the activations, under them
    lines = format_table("training GPU:", [_estimate(2.0 * GIB)]).splitlines()
    act = next(i for i, ln in enumerate(lines) if ln.strip().startswith("activations"))
    assert "of which the fused loss" in lines[act + 1] and _indent(lines[act + 1]) > _indent(lines[act])


def test_the_run_counts_its_gpus_with_the_teacher_replicas():
    from hylo.pipeline.estimate.cli import gpu_count

    cfg = load_stage_config(2, RECIPE_1B)  # 4 training workers, a pool of 4 replicas of 1 GPU
    assert gpu_count(cfg, 4) == "GPUs in all: 8 = 4 training + 4 teacher replicas x 1 GPU (teacher.pool)"
    assert gpu_count(cfg, 16).startswith("GPUs in all: 20 = 16 training")
    inproc = load_stage_config(2, RECIPE_1B, ["teacher.source=inprocess"])
    assert gpu_count(inproc, 4) == "GPUs in all: 4 training (the teacher runs on them)"


def test_torchs_module_tracking_note_stays_off_the_terminal_and_other_warnings_do_not(capfd):
    from hylo.pipeline.estimate.fake import fake_tensors
    from hylo.pipeline.estimate.tracking import StepMemory

    class CallsItself(torch.nn.Module):
        """Entered again before it has left: torch's ModTracker warns (and swaps the warnings' format)."""

        def __init__(self) -> None:
            super().__init__()
            self.linear, self.depth = torch.nn.Linear(4, 4), 0

        def forward(self, x):
            self.depth += 1
            return self.linear(self(x) if self.depth < 2 else x)

    fmt = warnings.formatwarning
    model = CallsItself()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with fake_tensors() as host:
            memory = StepMemory(1, host)
            memory.tracker.track_external(model)
            with memory.tracker:
                model(torch.empty(2, 4))
                warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a warning of the user's own"]
    assert warnings.formatwarning is fmt


def _load(recipe: Path = RECIPE_1B):
    return lambda keys: load_stage_config(2, recipe, keys)


def test_a_suggested_layout_is_one_the_configs_rules_accept():
    load = _load()  # 4 workers, global batch 8, 64K rows
    T, given = 65536, (4, 1)
    ok = advice.check_layout(load, T, 4, 2, given, conv=4)
    assert ok.problem is None and ok.flags == ["--sequence-parallel", "2"]
    # a group that does not divide the workers, or the row into shards holding the conv window
    assert "must divide ray.num_workers" in advice.check_layout(load, 3 * 16384, 4, 3, given, conv=4).problem
    assert "do not split into 3" in advice.check_layout(load, T, 6, 3, given, conv=4).problem
    assert "conv window" in advice.check_layout(load, 8, 4, 4, given, conv=4).problem
    # 16 workers in groups of 1: 16 data-parallel ranks, so the global batch of 8 is raised to 16, said in the flags
    w16 = advice.check_layout(load, T, 16, 1, given, conv=4)
    assert w16.problem is None and w16.flags == ["--world-size", "16", "--set", "train.global_batch_sequences=16"]
    load_stage_config(2, RECIPE_1B, ["ray.num_workers=16", "train.global_batch_sequences=16"])  # it loads
    # Ulysses: the group divides the teacher's query heads (6 here), or it is not offered
    teacher = TeacherDims(layers=2, heads=6, kv_heads=2, head_dim=8, hidden=48, vocab=10)
    assert "heads" in advice.check_layout(load, T, 4, 4, given, 4, teacher, "ulysses").problem
    assert advice.check_layout(load, T, 4, 2, given, 4, teacher, "ulysses").problem is None
    assert advice.check_layout(load, T, 4, 4, given, 4, teacher, "allgather").problem is None


def test_the_advice_names_the_smallest_world_size_and_group_that_fit_and_measures_only_what_it_needs():
    h100 = next(g for g in GPUS if g.name == "H100")
    measured = []

    def measure(n: int, w: int) -> float:
        measured.append((n, w))
        return {2: 75 * GIB, 4: 40 * GIB}[n]  # only N = 4 fits an H100 (90 % of 79.6 GiB: 71.6)

    def check(w: int, n: int) -> advice.Layout:
        flags = (["--sequence-parallel", str(n)] if n != 1 else []) + (["--world-size", str(w)] if w != 4 else [])
        return advice.Layout(65536, w, n, flags, None if w <= 8 else "the global batch")

    by_world = {8: 70 * GIB, 16: 65 * GIB}
    lines, records = advice.advise(65536, 100 * GIB, 4, 1, by_world, check, measure, gpus=(h100,))
    # ZeRO-3 over 8 fits (70 GiB); over 16 would too but is refused by the rules, and 8 is the smaller anyway
    assert len(lines) == 1 and lines[0].startswith("  H100 80 GiB at 64K (100.0 GiB): --world-size 8 (70.0 GiB")
    assert "--sequence-parallel 4 (40.0 GiB, its split step measured)" in lines[0]
    # the groups measured in turn, stopping at the first that fits
    assert measured == [(2, 4), (4, 4)]
    assert [f["flags"] for f in records[0]["fixes"]] == [["--world-size", "8"], ["--sequence-parallel", "4"]]
    # nothing to say where the GPU fits
    assert advice.advise(65536, 60 * GIB, 4, 1, by_world, check, measure, gpus=(h100,)) == ([], [])


def test_the_group_search_stops_where_splitting_no_longer_lowers_the_peak():
    tiny = GPU("tiny", 1.0, 1.0, 1.0, 1.0)
    measured = []

    def measure(n: int, w: int) -> float:
        measured.append(n)
        return 5 * GIB  # a fixed part the split does not shrink

    lines, _ = advice.advise(1 << 20, 6 * GIB, 8, 1, {}, lambda w, n: advice.Layout(0, w, n, [], None), measure,
                             gpus=(tiny,))
    assert measured == [2, 4] and "no larger world size" in lines[0]


@pytest.mark.slow
def test_the_advised_group_fits_when_the_estimate_runs_at_it(tmp_path: Path, monkeypatch, capsys):
    """End to end at tiny shapes, on a GPU made small enough that the row fits only split: the advice's flags,
    given back to `hylo estimate`, run and fit."""
    from hylo.pipeline.estimate import cli, gpus, report

    (tmp_path / "student").mkdir()
    tiny_student().save_pretrained(tmp_path / "student")
    tiny_teacher().save_pretrained(tmp_path / "teacher")
    cfg = {"model": {"student": str(tmp_path / "student"), "activation_checkpointing": True},
           "train": {"global_batch_sequences": 2}, "ray": {"num_workers": 2},
           "data": {"source": "synthetic", "seq_len": 256}, "deepspeed": {"reduce_bucket_size": 1000},
           "teacher": {"source": "inprocess", "k": 0, "model": {"path": str(tmp_path / "teacher"),
                                                                "dtype": "float32"}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    small = GPU("small", 0.0054, 1.0, 1.0, 1.0)  # 5.0 MiB usable: the 256-token row takes 5.6 MiB, split over 2 4.4
    for module in (gpus, report, advice):
        monkeypatch.setattr(module, "GPUS", (small,))
    out = tmp_path / "est.json"
    assert cli.main(["--config", str(path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not small.fits(data["estimates"][0]["peak_bytes"])
    (rec,) = data["advice"]
    fix = next(f for f in rec["fixes"] if "--sequence-parallel" in f["flags"])
    assert small.fits(fix["peak_bytes"]) and "small 0 GiB at 256" in capsys.readouterr().out
    assert fix["flags"] == ["--sequence-parallel", "2"] and rec["groups_measured"][0]["sequence_parallel"] == 2
    again = tmp_path / "again.json"
    assert cli.main(["--config", str(path), *fix["flags"], "--json", str(again)]) == 0
    split = json.loads(again.read_text())
    assert split["sequence_parallel"] == fix["sequence_parallel"] and split["advice"] == []
    assert small.fits(split["estimates"][0]["peak_bytes"])
    assert split["estimates"][0]["peak_bytes"] == pytest.approx(fix["peak_bytes"], rel=1e-9)
