"""The GPU branch on CPU tensors: fla's kernels and the fused KL's Triton kernels through Triton's interpreter,
equal to the torch branch (the harness and the cases: tests/helpers/fla_interpret.py), and the switch that
takes it (`hylo.kernels.backend`, mode `gpu`).

The interpreted cases run once, in one fresh process (fla must be imported after TRITON_INTERPRET=1), and
each case is reported here as its own test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hylo.kernels.backend as backend

from tests.helpers.common import fake_fla_gdn
from tests.helpers.fla_interpret import MODEL_CASES, OP_CASES, tolerance

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(out: Path, cases: str) -> tuple[dict, str]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("HYLO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.fla_interpret", "--out", str(out),
                           "--cases", cases], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.is_file(), log
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def interpreted_ops(tmp_path_factory):
    """The op cases: ~20 s of one CPU core, most of it importing."""
    return run_interpreted(tmp_path_factory.mktemp("gpu_branch") / "ops.json", "gdn/,ssd/")


@pytest.fixture(scope="module")
def interpreted_models(tmp_path_factory):
    """The tiny models: ~1 minute of one CPU core."""
    return run_interpreted(tmp_path_factory.mktemp("gpu_branch") / "models.json", "model/")


def check_case(interpreted: tuple[dict, str], case: str) -> None:
    results, log = interpreted
    assert case in results, log
    rec = results[case]
    assert "error" not in rec, rec.get("traceback", rec["error"])
    assert rec["checked"] == "interpreter"
    bad = {k: (e, tolerance(rec, k)) for k, e in rec["rel_err"].items() if not e <= tolerance(rec, k)}
    assert not bad, f"{case}: relative errors (error, tolerance) above tolerance: {bad}"
    assert rec["ok"]


@pytest.mark.parametrize("case", list(OP_CASES))
def test_fla_call_site_equals_torch_path(interpreted_ops, case):
    check_case(interpreted_ops, case)


@pytest.mark.slow  # the tiny models through the interpreter: about a minute
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_gpu_branch_equals_torch_branch(interpreted_models, case):
    check_case(interpreted_models, case)


def test_op_cases_cover_every_fla_call_site_both_directions():
    """The table docs/gpu-check.md shows: each call site, batch and packed rows, with and without states, decode."""
    for op in ("gdn", "ssd"):
        mine = [c for n, c in OP_CASES.items() if n.startswith(op + "/")]
        assert {c["cu"] is not None for c in mine} == {True, False}
        assert {c["states"] for c in mine} == {True, False}
        assert any(c["T"] == 1 for c in mine)
        # a packed row with a document across a chunk boundary
        assert any(c["cu"] and any(a // 64 != (b - 1) // 64 for a, b in zip(c["cu"], c["cu"][1:])) for c in mine)


# ------------------------------------------------------------------------------------ the switch
@pytest.fixture
def fla_importable(monkeypatch):
    """fla counts as installed without importing it here (this process must not decorate its kernels)."""
    monkeypatch.setattr(backend, "fla_available", lambda: True)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.delenv("HYLO_KERNELS", raising=False)


def test_gpu_mode_takes_every_gpu_branch_on_cpu_when_interpreting(fla_importable, monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not backend.use_fla(x) and not backend.use_gpu_kernels(x)  # auto: CPU tensors take torch
    with backend.forced_mode("gpu"):
        assert backend.use_fla(x) and backend.use_gpu_kernels(x)
        with backend.forced_mode("torch"):
            assert not backend.use_fla(x) and not backend.use_gpu_kernels(x)
    # `triton` forces our Triton kernels only: fla's need the harness's interpreter patches
    with backend.forced_mode("triton"):
        assert backend.use_gpu_kernels(x) and not backend.use_fla(x)
    monkeypatch.setenv("HYLO_KERNELS", "gpu")
    assert backend.use_fla(x) and backend.use_gpu_kernels(x)


def test_gpu_mode_needs_the_interpreter_on_cpu(fla_importable, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(1)
    with backend.forced_mode("gpu"):
        assert not backend.use_fla(x) and not backend.use_gpu_kernels(x)
    monkeypatch.setattr(backend, "fla_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with backend.forced_mode("gpu"):
        assert not backend.use_fla(x) and backend.use_gpu_kernels(x)


@pytest.mark.parametrize(("ours", "fla"), [(16, 16), (32, 32), (64, 64), (128, 64), (100, 64)])
def test_gdn_call_site_passes_fla_a_chunk_size_it_takes(monkeypatch, ours, fla):
    """fla's GDN kernel raises on chunk sizes other than 16, 32, 64; `gdn_chunk_size` is any positive int
    (the torch path's chunk length), so the call site gives fla 64 for the others."""
    import hylo.kernels.gdn.chunk as gdn_chunk

    calls = fake_fla_gdn(monkeypatch)
    q, k, v = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    gdn_chunk.chunk_gated_delta_rule(q, k, v, -torch.rand(1, 10, 2), torch.rand(1, 10, 2), chunk_size=ours)
    assert calls[0]["chunk_size"] == fla
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gdn_chunk.chunk_gated_delta_rule(q, k, v, -torch.rand(1, 10, 2), torch.rand(1, 10, 2), chunk_size=0)
