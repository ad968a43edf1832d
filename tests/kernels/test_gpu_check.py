"""bench/gpu_check.py at --tiny shapes on CPU: every case runs and reports finite figures within tolerance,
so the prepared GPU check keeps working between loans of a GPU (docs/gpu-check.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hylo.ownership import ForeignOutputError

REPO = Path(__file__).resolve().parents[2]
# in the time plan's order: the most informative first
CASES = ("gdn_mamba2", "stage2_step", "decode", "deepspeed_zero3", "fused_kl", "mla_packed", "serve_decode")
# The GPU machine has no Ray (nor boto3): the check must not import them. Blocked in the child.
RUN = ("import sys, runpy; sys.modules.update(dict.fromkeys(('ray', 'boto3'), None)); "
       "sys.argv = ['bench/gpu_check.py', *sys.argv[1:]]; runpy.run_path('bench/gpu_check.py', run_name='__main__')")


def numbers(x, path=""):
    """Every number in a JSON value, with its path."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return
    if isinstance(x, int | float):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from numbers(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("HYLO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", RUN, "--tiny", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert (out / "gpu_check.json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    data["_returncode"], data["_md"], data["_log"] = proc.returncode, (out / "gpu_check.md").read_text(), proc.stdout
    return data


@pytest.mark.slow
def test_every_case_runs_and_reports_finite_figures(report):
    assert tuple(report["cases"]) == CASES
    for name, case in report["cases"].items():
        assert case.get("ok") is True, f"{name}: {case.get('error')}"
        bad = [p for p, v in numbers(case) if not math.isfinite(v)]
        assert not bad, f"{name}: non-finite figures at {bad}"
    assert report["_returncode"] == 0, report["_log"][-2000:]
    # the table has a row per case
    assert all(f"| {name} | True |" in report["_md"] for name in CASES), report["_md"]


@pytest.mark.slow
def test_every_case_has_its_first_call_apart_from_its_steady_state(report):
    for name, case in report["cases"].items():
        if "skipped" in case:
            continue
        assert case["measurements"], name
        for m in case["measurements"]:
            # None: a call measured without a first call of its own (a reference run after the same call)
            assert m["steady_seconds"] > 0 and (m["first_call_seconds"] is None or m["first_call_seconds"] > 0), m
        assert sum(m["first_call_seconds"] is not None for m in case["measurements"]) >= 1, name
        assert case["first_call_seconds"] == pytest.approx(sum(m["first_call_seconds"] or 0
                                                               for m in case["measurements"]))
        assert case["steady_seconds"] == pytest.approx(sum(m["steady_seconds"] for m in case["measurements"]))
        assert "estimate_seconds" in case, name  # the estimates made after the measured figures were written
    # the sizes and contexts in the plan's order, the key one first
    assert report["cases"]["decode"]["contexts_in_order"] == [64, 32]
    assert [m["call"] for m in report["cases"]["decode"]["measurements"]] == [
        "decode hylo_8mla8gdn ctx64", "decode llama_3.2_1b ctx64", "decode hylo_8mla8gdn ctx32",
        "decode llama_3.2_1b ctx32"]
    assert "| first calls s | steady s |" in report["_md"]


@pytest.mark.slow
def test_the_step_has_its_profile_estimate_and_mfu(report):
    step = report["cases"]["stage2_step"]
    prof = step["profile"]
    # one step under torch.profiler: the top ops (kernels on a GPU) by their own time
    assert prof["student"] == "8mla8gdn" and prof["tokens"] == 64 and "error" not in prof, prof
    assert len(prof["top"]) == 15 and prof["top"][0]["ms"] >= prof["top"][-1]["ms"] > 0
    assert 0 < sum(e["share"] for e in prof["top"]) <= 1 + 1e-9 and "Self CPU" in prof["table"]
    assert "[gpu_check]   profile of one step" in report["_log"]
    for variant in ("8mla8gdn", "4mla12m2"):
        r = step[variant]["T64"]
        assert r["first_call_seconds"] > 0 and r["seconds"] > 0
        assert r["estimated_flops"] > 0 and r["estimated_peak_gib"] is not None, r
        assert set(r["estimated_seconds_at_peak"]) >= {"H100", "H200"}
        assert r["mfu"] is None and "mfu" in r  # no GPU: no peak rate to divide by


@pytest.mark.slow
def test_the_relative_errors_are_within_tolerance(report):
    tol = {"kl_loss": 1e-4, "kl_grad": 1e-3, "layer": 1e-4}
    kl = report["cases"]["fused_kl"]
    # --tiny runs the Triton kernel through the interpreter
    assert kl["kernel"] == "triton"
    for form in ("hidden", "topk64_tail", "ce"):
        f, fast = kl[form]["fused"], kl[form]["fused_fast"]
        assert (f["precision"], fast["precision"]) == ("accurate", "fast")
        assert f["loss_rel_err"] <= tol["kl_loss"] and f["grad_hidden_rel_err"] <= tol["kl_grad"]
        assert f["grad_weight_rel_err"] <= tol["kl_grad"]
        assert f["seconds"] > 0 and kl[form]["reference_full_logits"]["seconds"] > 0
        # fast mode rounds the logit gradient to bf16 once: Liger's level, far from the accurate mode's
        assert fast["loss_rel_err"] <= tol["kl_loss"] and 3e-4 <= fast["grad_weight_rel_err"] <= 1e-2
        # one gradient product per split half: accurate performs 2NV(5H+H'), fast 2NV(3H+H') (no H' for top-k, CE)
        sh, teacher_h = kl["shape"], kl["shape"]["H_teacher"] if form == "hidden" else 0
        for r, halves in ((f, 2), (fast, 1)):
            assert math.isclose(r["tflop"], 2 * sh["N"] * sh["V"] * (sh["H"] * (1 + 2 * halves) + teacher_h) / 1e12)
    lin = report["cases"]["gdn_mamba2"]
    for variant in ("gdn", "mamba2"):
        errs = lin[variant]["rel_err"]
        # outputs, the input and every parameter gradient, the op's final state and its input gradients
        assert {"output", "grad_input", "op_final_state", "op_output"} <= set(errs)
        assert sum(k.startswith("grad_") for k in errs) >= 4 and sum(k.startswith("op_grad_") for k in errs) == 5
        assert max(errs.values()) <= tol["layer"], errs
    mla = report["cases"]["mla_packed"]
    assert all(mla[k]["grouped_vs_loop_rel_err"] <= 1e-4 for k in mla if k.startswith("docs"))


@pytest.mark.slow
def test_the_step_and_decode_figures_are_there(report):
    step = report["cases"]["stage2_step"]
    for variant in ("8mla8gdn", "4mla12m2"):
        r = step[variant]
        assert r["parameters"] > 0 and r["host_syncs_per_step"]["count"] >= 1
        sizes = [k for k in r if k.startswith("T")]
        assert sizes and all(r[k]["tokens_per_s"] > 0 for k in sizes)
    dec = report["cases"]["decode"]
    for model in ("hylo_8mla8gdn", "llama_3.2_1b"):
        assert all(v["cache_bytes"] > 0 and v["decode_tokens_per_s"] > 0 for v in dec[model].values())
    # the Llama cache grows with the context; HyLo's MLA latents grow more slowly (GDN states are fixed)
    ctx = sorted(int(k[3:]) for k in dec["llama_3.2_1b"])
    assert dec["llama_3.2_1b"][f"ctx{ctx[-1]}"]["cache_bytes"] > dec["llama_3.2_1b"][f"ctx{ctx[0]}"]["cache_bytes"]
    ds = report["cases"]["deepspeed_zero3"]
    assert "skipped" in ds or (ds["8mla8gdn"]["parameters"] > 0 and ds["8mla8gdn"]["T64"]["tokens_per_s"] > 0)
    # vLLM is not in this environment (nor on the GPU machines lent): one line, and the computed figures
    serve = report["cases"]["serve_decode"]
    assert serve["skipped"].startswith("vLLM does not import here") and serve["computed"]["1b"]["ratio_served"] > 1


@pytest.mark.slow
def test_each_case_in_a_process_of_its_own_under_a_time_limit(tmp_path):
    """--case-seconds: a case runs in a child process and its figures are merged into OUT; a child past its limit
    is stopped and recorded as that case's failure; the child gets the other flags (here the fla guard's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("HYLO_KERNELS", None)

    def check(out, *flags):
        proc = subprocess.run([sys.executable, "-c", RUN, "--tiny", "--out", str(out), *flags], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        return proc, json.loads((out / "gpu_check.json").read_text())

    proc, data = check(tmp_path / "a", "--cases", "3", "--isolated", "--bypass-fla-hopper-guard")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the plan, printed before the case starts
    assert "[gpu_check] plan: case 3 mla_packed 600 s; no deadline" in proc.stdout.splitlines()[0]
    assert data["plan"] == [{"case": 3, "name": "mla_packed", "budget_s": 600.0}]
    assert data["cases"]["mla_packed"]["ok"] is True and data["cases"]["mla_packed"]["measurements"]
    assert data["fla_hopper_guard_bypassed"] is False  # the flag reached the child; no Hopper here
    assert "[gpu_check] case 3 mla_packed ..." in (tmp_path / "a" / "case_3" / "log.txt").read_text()

    # a limit shorter than the child's start-up: stopped, recorded, the exit status says so
    proc, data = check(tmp_path / "b", "--cases", "5", "--case-seconds", "0.5")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert data["cases"]["decode"]["error"]["type"] == "TimeoutExpired", data
    assert "| decode | False |" in (tmp_path / "b" / "gpu_check.md").read_text()

    # a case killed after its first measurement (as its budget would) leaves that figure: the child wrote its
    # partial report after every measurement, the parent keeps it and marks the case stopped
    proc, data = check(tmp_path / "c", "--cases", "5", "--isolated", "--stop-after-measurements", "1")
    assert proc.returncode == 1, proc.stdout[-3000:]
    dec = data["cases"]["decode"]
    assert dec["ok"] is False and dec["stopped"] == "exit status -9" and dec["error"]["type"] == "ChildFailed"
    assert [m["call"] for m in dec["measurements"]] == ["decode hylo_8mla8gdn ctx64"]
    assert dec["hylo_8mla8gdn"]["ctx64"]["decode_tokens_per_s"] > 0 and dec["llama_3.2_1b"] == {}
    assert "1 measurements kept" in (tmp_path / "c" / "gpu_check.md").read_text()


@pytest.mark.slow
def test_the_compile_case_runs_outside_the_plan_at_tiny_shapes(tmp_path):
    """Case 8 (`--cases 8`, outside the 8-minute plan): compiled blocks against the eager step, every figure there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("HYLO_KERNELS", None)
    out = tmp_path / "c8"
    proc = subprocess.run([sys.executable, "-c", RUN, "--tiny", "--out", str(out), "--cases", "8"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    case = json.loads((out / "gpu_check.json").read_text())["cases"]["compile"]
    assert case["ok"] is True and case["graphs_after_first_row"] == 0 and case["graphs_first_row"] > 0
    assert case["host_reads_per_step_eager"] == [0, 0] and case["time_ratio_compiled_over_eager"] > 0
    assert [m["call"] for m in case["measurements"]] == ["step eager", "step compiled"]


def test_the_reports_never_overwrite_a_users_files_in_out_and_are_refused_before_any_case(tmp_path, monkeypatch):
    """`make gpu-check OUT=folder` wrote gpu_check.json / .md (and case_N/log.txt) over files of those names
    with no ownership check; now such a file of the user's is refused, untouched, before any case runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hylo_bench_gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the checkout first on the path
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gc"
    out.mkdir()
    (out / "gpu_check.md").write_text("my notes")
    with pytest.raises(ForeignOutputError, match=f"--out {out / 'gpu_check.md'} exists and this project did not"):
        gpu_check.main(["--tiny", "--out", str(out), "--cases", "3"])
    (out / "gpu_check.md").unlink()
    (out / "case_3").mkdir()
    (out / "case_3" / "log.txt").write_text("my log")
    with pytest.raises(ForeignOutputError, match="case_3/log.txt exists"):
        gpu_check.main(["--tiny", "--out", str(out), "--cases", "3", "--case-seconds", "1"])
    assert (out / "case_3" / "log.txt").read_text() == "my log"
    assert sorted(p.name for p in out.iterdir()) == ["case_3"]


def load_gpu_check(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("hylo_bench_gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, gpu_check)  # its dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # it puts the checkout first on the path
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_time_plan_fits_eight_minutes_and_passes_on_what_a_case_leaves(monkeypatch):
    gc = load_gpu_check(monkeypatch)
    assert sorted(n for n, _ in gc.PLAN) == [1, 2, 3, 4, 5, 6, 7] and sum(b for _, b in gc.PLAN) <= gc.PLAN_DEADLINE <= 480
    # case 8 (compiled blocks) runs on its own, with its own budget
    assert set(gc.EXTRA_BUDGETS) == set(gc.CASES) - {n for n, _ in gc.PLAN} == {8}
    plan = [{"case": n, "budget_s": b} for n, b in ((2, 60.0), (4, 160.0), (5, 90.0))]
    # a full 480 s: the first case may use what the later ones' budgets leave
    assert gc.case_limit(plan, 0, 480.0) == 230.0
    # the first case took 20 s: the step gets its budget and the 40 s left over
    assert gc.case_limit(plan, 1, 300.0) == 210.0
    # behind: its budget, never past the deadline; too little left: not started
    assert gc.case_limit(plan, 2, 70.0) == 70.0 and gc.case_limit(plan, 2, 9.0) is None
    assert gc.case_limit(plan, 2, None) == 90.0


def test_the_step_falls_back_to_an_all_mla_student_where_no_linear_route_is_correct(monkeypatch):
    gc = load_gpu_check(monkeypatch)
    monkeypatch.setattr(gc, "fla_route_problem", lambda device, kinds: "Triton 3.6 on Hopper" if "gdn" in kinds else None)
    assert gc.step_variants("cuda", "plain", False) == (["all_mla", "4mla12m2"], {"8mla8gdn": "Triton 3.6 on Hopper"})
    assert gc.step_variants("cuda", "deepspeed", False) == (["all_mla"], {"8mla8gdn": "Triton 3.6 on Hopper"})
    assert gc.step_variants("cuda", "plain", True) == (["8mla8gdn", "4mla12m2"], {})  # measure only
    cfg, ref = gc.hylo_config("all_mla", True), gc.hylo_config("8mla8gdn", True)
    assert list(cfg.mla_layers) == list(range(cfg.num_hidden_layers)) and len(ref.mla_layers) < ref.num_hidden_layers
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (ref.hidden_size, ref.num_hidden_layers,
                                                                        ref.vocab_size)


def test_mfu_is_the_estimated_step_at_the_gpus_peak_over_the_measured_step(monkeypatch):
    gc = load_gpu_check(monkeypatch)

    class Est:
        total_flops = 989.4e12  # one second at an H100's dense bf16 peak

    at_peak, pricing = gc.peak_seconds(Est())
    assert at_peak["H100"] == pytest.approx(1.0) and "bf16" in pricing
    Est.seconds_at_peak = lambda self, gpu: 2.0  # an estimator that prices each dtype at its rate
    assert gc.peak_seconds(Est())[0]["H200"] == 2.0
    entry = {"seconds": 4.0}
    gc.add_step_estimate(entry, {"estimated_seconds_at_peak": at_peak}, "NVIDIA H100 80GB HBM3")
    assert entry["mfu"] == pytest.approx(0.25) and entry["mfu_gpu"] == "H100"
    gc.add_step_estimate(entry, {"estimated_seconds_at_peak": at_peak}, "NVIDIA A100-SXM4-80GB")
    assert entry["mfu"] is None
