"""The estimator's stand-in for fla's chunk functions (`hylo.kernels.fla_shapes`): what it saves and allocates is
what fla saves and allocates (fla run under Triton's interpreter: tests/helpers/fla_saved.py), and only the
estimator's fake tensors take it (`pipeline/estimate/fake.fake_tensors(gpu=True)`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hylo.kernels.gdn.chunk as gdn_chunk
import hylo.kernels.ssd.chunk as ssd_chunk
from hylo.kernels.backend import fla_stand_in
from hylo.kernels.fla_shapes import FlaShapes
from hylo.pipeline.estimate.fake import fake_tensors

from tests.helpers.fla_saved import cases

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """fla's functions and the stand-in on the cases of tests/helpers/fla_saved.py (about 16 CPU-s in one process)."""
    pytest.importorskip("triton")
    pytest.importorskip("fla.ops.gated_delta_rule")
    out = tmp_path_factory.mktemp("fla_saved") / "saved.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("HYLO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.fla_saved", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _buffers(created: list) -> list[tuple[str, int]]:
    # (dtype, bytes) in creation order; the interpreter's own empty tensors and the host index tensors aside
    return [(dtype, nbytes) for _shape, dtype, nbytes in created if nbytes > 0 and "int" not in dtype]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(cases()))
def test_stand_in_saves_and_allocates_what_fla_does(traced, case):
    fla, ours = traced[case]["fla"], traced[case]["stand_in"]
    # every tensor ctx.save_for_backward keeps: shape, dtype, bytes, in order
    assert ours["saved"] == fla["saved"]
    assert ours["outputs"] == fla["outputs"]
    assert ours["grads"] == fla["grads"]
    # every buffer each pass creates, in order (l2norm's rows are [B*T*H, K] in fla, viewed back: same bytes)
    for phase in ("forward", "backward"):
        assert _buffers(ours["created"][phase]) == _buffers(fla["created"][phase]), phase


def _gdn_inputs(T: int = 200, H: int = 2, K: int = 32, V: int = 64):
    q, k = (torch.empty(1, T, H, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.empty(1, T, H, V, dtype=torch.bfloat16, requires_grad=True)
    g = torch.empty(1, T, H, requires_grad=True)
    beta = torch.empty(1, T, H, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, g, beta


def _forbid(monkeypatch, module, name):
    def forbidden(*a, **k):
        raise AssertionError(f"{name} ran")

    monkeypatch.setattr(module, name, forbidden)


def test_estimator_on_gpu_rules_prices_the_scans_as_fla(monkeypatch):
    # gpu=True: the stand-in, never our torch scans; FLOPs counted at the operands' dtype
    _forbid(monkeypatch, gdn_chunk, "torch_chunk_gated_delta_rule")
    _forbid(monkeypatch, ssd_chunk, "torch_chunk_ssd")
    with fake_tensors(gpu=True) as host:
        host.flop_registry = {}
        q, k, v, g, beta = _gdn_inputs()
        o, _ = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()
        x = torch.empty(1, 200, 4, 16, dtype=torch.bfloat16, requires_grad=True)
        dt = torch.empty(1, 200, 4, requires_grad=True)
        B, C = (torch.empty(1, 200, 2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        y, _ = ssd_chunk.chunk_ssd(x, dt, -torch.ones(4), B, C, torch.ones(4))
        y.float().sum().backward()
        assert q.grad.shape == q.shape and x.grad.shape == x.shape and B.grad.shape == B.shape
        assert host.flops > 0


def test_estimator_on_cpu_rules_and_real_tensors_run_the_torch_scans(monkeypatch):
    calls = []
    monkeypatch.setattr(FlaShapes, "chunk_gated_delta_rule", lambda *a, **k: calls.append(1))
    with fake_tensors(gpu=False):
        q, k, v, g, beta = _gdn_inputs(T=64)
        gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta)
    # a real tensor inside the stand-in's block (a training step never enters it) takes the torch path too
    with fla_stand_in(FlaShapes()):
        q, k, v, g, beta = (torch.randn(x.shape, dtype=x.dtype) for x in _gdn_inputs(T=64))
        o, _ = gdn_chunk.chunk_gated_delta_rule(q, k, v, g.clamp(max=0), beta.sigmoid())
        assert torch.isfinite(o.float()).all()
    assert calls == []


def test_a_gdn_layer_holds_less_priced_as_fla_than_on_the_torch_scan():
    """One GDN layer's forward + backward at 4K tokens: fla recomputes the chunk states in its backward, the
    torch scan keeps every chunk's intermediates."""
    from hylo.pipeline.estimate.step import estimate_call

    T, H, K, V = 4096, 2, 64, 128

    def setup():
        return _gdn_inputs(T, H, K, V)

    def run(inputs):
        q, k, v, g, beta = inputs
        o, _ = gdn_chunk.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()

    fla_peak, torch_peak = estimate_call(setup, run, gpu=True), estimate_call(setup, run, gpu=False)
    # fla's largest buffers: the chunk states h and dh ([T / 64, H, K, V] bf16 each) and a few [T, H, V]
    assert fla_peak < torch_peak / 2
    assert fla_peak >= 2 * (T // 64) * H * K * V * 2
