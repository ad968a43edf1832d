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

REPO = Path(__file__).resolve().parents[2]
CASES = ("fused_kl", "gdn_mamba2", "mla_packed", "stage2_step", "decode", "deepspeed_zero3")
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

    proc, data = check(tmp_path / "a", "--cases", "3", "--case-seconds", "300", "--bypass-fla-hopper-guard")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["cases"]["mla_packed"]["ok"] is True and data["isolated"]["case_seconds"] == 300
    assert data["fla_hopper_guard_bypassed"] is False  # the flag reached the child; no Hopper here
    assert "[gpu_check] case 3 mla_packed ..." in (tmp_path / "a" / "case_3" / "log.txt").read_text()

    # a limit shorter than the child's start-up: stopped, recorded, the exit status says so
    proc, data = check(tmp_path / "b", "--cases", "5", "--case-seconds", "0.5")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert data["cases"]["decode"]["error"]["type"] == "TimeoutExpired", data
    assert "| decode | False |" in (tmp_path / "b" / "gpu_check.md").read_text()


def test_the_reports_never_overwrite_a_users_files_in_out_and_are_refused_before_any_case(tmp_path, monkeypatch):
    """`make gpu-check OUT=folder` wrote gpu_check.json / .md (and case_N/log.txt) over files of those names
    with no ownership check; now such a file of the user's is refused, untouched, before any case runs."""
    import importlib.util

    from hylo.files import ForeignOutputError

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
