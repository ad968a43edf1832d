"""`hylo estimate` (pipeline/estimate/): the training step on fake tensors, at tiny shapes.

The estimate's sharded states are checked against exact byte counts of a real model of the same config,
its activation peak against the same step measured by the CPU allocator (torch.profiler's memory events,
bench/estimate_check.py), its fused-loss FLOPs against their closed form, and its device reads against the
sites it knows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hylo.modeling import HyLoForCausalLM
from hylo.outputs import OutputConflictError
from hylo.ownership import ForeignOutputError, is_own_file
from hylo.pipeline.estimate import EstimateError, estimate_step, fake_tensors
from hylo.pipeline.train.config import load_stage_config

from tests.helpers.models import TINY_VOCAB, tiny_student, tiny_teacher

REPO = Path(__file__).resolve().parents[2]
V = TINY_VOCAB


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    """A stage-2 config whose student and in-process teacher are directories holding only a config.json."""
    tiny_student().save_pretrained(tmp_path / "student")
    tiny_teacher().save_pretrained(tmp_path / "teacher")
    cfg = {"model": {"student": str(tmp_path / "student"), "activation_checkpointing": True},
           "train": {"global_batch_sequences": 2}, "ray": {"num_workers": 2},
           "data": {"source": "synthetic", "seq_len": 128},
           "teacher": {"source": "inprocess", "k": 0,
                       "model": {"path": str(tmp_path / "teacher"), "dtype": "float32"}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def blocks(t: torch.Tensor) -> int:
    """Bytes of a tensor's storage."""
    return t.numel() * t.element_size()


@pytest.mark.slow
def test_hylo_estimate_runs_and_its_sharded_states_are_the_exact_sizes(tiny_config: Path, tmp_path: Path):
    out = tmp_path / "est.json"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the `hylo` console script of this environment (pyproject's [project.scripts]), or its entry point
    script = Path(sys.executable).with_name("hylo")
    hylo = [str(script)] if script.is_file() else [
        sys.executable, "-c", "import sys; from hylo.pipeline.cli import hylo_main; sys.exit(hylo_main())"]
    proc = subprocess.run([*hylo, "estimate", "--config", str(tiny_config),
                           "--tokens", "64,128", "--world-size", "2", "--json", str(out)],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = proc.stdout
    for words in ("ZeRO-3 over 2 GPUs", "peak", "fits", "MI300X", "time at each dtype's dense peak", "lower bound"):
        assert words in text, text
    data = json.loads(out.read_text())
    assert [e["tokens"] for e in data["estimates"]] == [64, 128]
    # the file says it is ours: a later run may replace it (hylo.outputs.check_output_file)
    assert data["written_by"] == "hylo-pipeline" and is_own_file(out)
    from transformers import LlamaForCausalLM

    model = HyLoForCausalLM(tiny_student())
    params = list(model.parameters())
    teacher_bytes = sum(blocks(p) for p in LlamaForCausalLM(tiny_teacher()).parameters())
    n = sum(p.numel() for p in params)
    for e in data["estimates"]:
        mem = e["memory"]
        assert e["parameters"] == e["trainable_parameters"] == n and e["world_size"] == 2 and e["dtype"] == "bfloat16"
        # bf16 parameters; fp32 master weights and two fp32 AdamW moments per parameter: all over 2 workers
        assert mem["parameters"] == sum(blocks(p.to(torch.bfloat16)) for p in params) / 2
        assert mem["optimizer states (fp32 master + AdamW)"] == 3 * sum(blocks(p.float()) for p in params) / 2
        # the in-process teacher (fp32, as configured) on every training GPU, not sharded
        assert mem["teacher weights"] == teacher_bytes
        # the parts add up to the peak; the activations (and the rest) are what is left, not negative
        assert e["peak_bytes"] == pytest.approx(sum(mem.values()), rel=1e-9)
        assert mem["activations, temporaries, loss buffers"] >= 0
        assert e["host_reads"], "the step's end-of-step reads are served by HOST_VALUES"
        assert set(e["gpus"]) == {"H100", "H200", "B200", "MI300X", "MI355X"}
        # every FLOP has its dtype class, and each GPU's time is theirs at their rates
        assert sum(e["gemm_flops_by_dtype"].values()) == pytest.approx(e["total_flops"] / 1e12, rel=1e-9)
        assert e["gpus"]["H100"]["seconds"] == pytest.approx(sum(e["gpus"]["H100"]["seconds_by_dtype"].values()))
    small, big = data["estimates"]
    assert big["peak_bytes"] > small["peak_bytes"] and big["total_flops"] > 1.8 * small["total_flops"]


@pytest.fixture(scope="module")
def measure():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import estimate_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    return estimate_check


def _stage2(tiny_config: Path):
    return load_stage_config(2, tiny_config, ["ray.num_workers=1", "train.global_batch_sequences=1"])


@pytest.mark.parametrize("tokens", [256])
def test_the_estimate_is_the_cpu_allocators_peak_of_the_same_step(tiny_config: Path, measure, tokens: int):
    """The real step (same builder, real tensors, PlainEngine, fp32, world size 1) under the CPU allocator's
    own accounting, beside the estimate with the CPU rules: the step's extra peak and its forward+backward
    part within 10 %."""
    from torch.profiler import record_function

    from hylo.pipeline.estimate import DOC_TOKENS, ShapeTeacher, build_model, shapes_of, synthetic_row
    from hylo.pipeline.train import stage2
    from hylo.pipeline.train.plain_engine import plain_engine
    from hylo.pipeline.train.worker import SoloContext

    cfg = _stage2(tiny_config)
    est = estimate_step(cfg, tokens, 1, torch.float32, gpu=False)
    shapes = shapes_of(cfg)
    torch.manual_seed(0)
    ctx = SoloContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=Path("."), grad_accum=1)
    task = stage2.build(ctx, student=lambda: build_model(shapes.student, torch.float32),
                        engine=plain_engine(cfg.optim), teacher=ShapeTeacher(cfg, shapes))
    stage2.train_step(task, [synthetic_row(min(256, tokens), V, (64, 128), seed=1)], ctx)
    row = synthetic_row(tokens, V, DOC_TOKENS)
    engine_step = task.engine.step

    def marked() -> None:
        with record_function("hylo::optimizer"):
            engine_step()

    task.engine.step = marked
    peak, fwd_bwd = measure.allocator_peaks(lambda: stage2.train_step(task, [row], ctx))
    got, got_fb = est.peak_bytes - est.start_bytes, est.phase_peaks["forward/backward"] - est.start_bytes
    assert got == pytest.approx(peak, rel=0.10), (got, peak)
    assert got_fb == pytest.approx(fwd_bwd, rel=0.10), (got_fb, fwd_bwd)


@pytest.mark.parametrize("mode, gradient_products", [(None, 1), ("accurate", 2)])
def test_the_fused_loss_flops_are_its_products(tiny_config: Path, mode: str | None, gradient_products: int):
    """GPU rules: every row through the chunks; student and teacher logits, d(hidden) and d(weight). None:
    the config's default, kd.kl_precision = fast."""
    cfg = _stage2(tiny_config)
    if mode is not None:
        cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, kl_precision=mode))
    T = 128
    est = estimate_step(cfg, T, 1, torch.bfloat16, gpu=True)
    D, Dt = tiny_student().hidden_size, tiny_teacher().hidden_size
    # bf16 student: fast rounds the logit gradient once (one product each for d(hidden) and d(weight));
    # accurate sends its hi and lo halves each through both
    g = gradient_products
    assert est.flops["fused loss"] == 2 * T * V * (D + Dt + g * (D + D))
    # each phase's FLOPs, split by the dtype they run at: the student's products are bf16 (fp32 accumulation);
    # this config's teacher is fp32 (teacher.model.dtype's default), so its logits are an fp32 product
    assert {p: sum(c.values()) for p, c in est.flops_by_dtype.items()} == est.flops
    assert est.flops_by_dtype["fused loss"] == {"bf16": 2 * T * V * (D + g * (D + D)), "fp32": 2 * T * V * Dt}
    # the student's layers: at least forward, recompute and backward of every linear weight over T tokens
    linear = sum(m.weight.numel() for m in HyLoForCausalLM(tiny_student()).model.layers.modules()
                 if isinstance(m, torch.nn.Linear))
    assert est.flops["student forward"] + est.flops["backward (with recompute)"] >= 8 * linear * T


def test_a_device_read_the_estimate_has_no_value_for_names_its_line():
    with fake_tensors(), pytest.raises(EstimateError, match=r"reads a device value .* at \S*test_estimate\.py:\d+"):
        x = torch.ones(4)
        float(x.sum())  # a read no step makes: no value for it


def test_a_recipe_without_its_model_directories_uses_the_published_shapes():
    """The 1B recipe's base and teacher are not mounted here: their published config.json shapes are used."""
    from hylo.pipeline.estimate import parameter_count, shapes_of

    cfg = load_stage_config(2, REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml")
    shapes = shapes_of(cfg, load_stage_config(1, REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"))
    # the card's 1.61B parameters (configs/llama-3.2-1b-8mla8gdn-64k.yaml) and Llama-3.1-8B's 8.03B
    assert parameter_count(shapes.student) == pytest.approx(1.61e9, rel=0.005)
    assert parameter_count(shapes.teacher) == pytest.approx(8.03e9, rel=0.005)


@pytest.fixture
def no_work(monkeypatch):
    """`hylo estimate` stops where its work would start: a check made later than this is not up front."""
    from hylo.pipeline.estimate import cli

    def started(*a, **kw):
        raise AssertionError("the estimate started")

    monkeypatch.setattr(cli, "estimate_step", started)
    return cli


def test_estimate_never_writes_json_over_a_users_file_and_refuses_before_the_work(tiny_config: Path, tmp_path: Path,
                                                                                  no_work):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(ForeignOutputError, match=f"--json {notes} exists and this project did not write it"):
        no_work.main(["--config", str(tiny_config), "--json", str(notes)])
    assert notes.read_text() == "my notes"
    # --force lets it through to the work
    with pytest.raises(AssertionError, match="the estimate started"):
        no_work.main(["--config", str(tiny_config), "--json", str(notes), "--force"])


def test_estimate_json_is_never_its_own_config(tiny_config: Path, no_work):
    before = tiny_config.read_text()
    with pytest.raises(OutputConflictError, match=f"--json {tiny_config} is the input --config"):
        no_work.main(["--config", str(tiny_config), "--json", str(tiny_config), "--force"])
    assert tiny_config.read_text() == before


def test_an_unwritable_estimate_json_is_named_as_given_before_the_work(tiny_config: Path, no_work):
    from hylo.pipeline.cli import input_error_message

    with pytest.raises(OSError) as info:
        no_work.main(["--config", str(tiny_config), "--json", "/proc/hylo-est.json"])
    assert input_error_message(info.value) == "--json /proc/hylo-est.json: cannot write it (No such file or directory)"
