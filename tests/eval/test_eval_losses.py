"""The eval's KL / NLL sums (pipeline/eval/kl.py), now the kernels' LM-head losses (hylo.kernels.fused_kl),
against the formulas they replaced; the exact option runs the ops' pure-torch path.

Tiny awkward shapes as in test_fused_kl.py: N=37 tokens, V=50 ids, chunks of 16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo.kernels.backend import forced_mode, use_gpu_kernels
from hylo.pipeline.eval.kl import sum_kl, sum_nll

N, H, H_T, V = 37, 16, 24, 50


# ------------------------------------------------------------------------------------ eval sums
def _eval_case(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g)
    ws = torch.randn(V, H, generator=g) * 0.5
    ht = torch.randn(N, H_T, generator=g)
    wt = torch.randn(V, H_T, generator=g) * 0.5
    return hs, ws, ht, wt, torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("exact", [False, True], ids=["fused", "exact"])
@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "auto"])
def test_eval_sums_are_their_formulas(exact, chunk):
    # the sums written out: KL(teacher || student) and NLL over every token, in fp64, whole
    hs, ws, ht, wt, labels = _eval_case()
    logq = torch.log_softmax(hs.double() @ ws.double().t(), -1)
    logp = torch.log_softmax(ht.double() @ wt.double().t(), -1)
    kl = float((logp.exp() * (logp - logq)).sum())
    nll = float(F.cross_entropy(hs.double() @ ws.double().t(), labels, reduction="sum"))
    assert sum_kl(hs, ws, ht, wt, chunk, exact) == pytest.approx(kl, rel=1e-5)
    assert sum_nll(hs, ws, labels, chunk, exact) == pytest.approx(nll, rel=1e-6)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_exact_eval_path_never_runs_triton(monkeypatch):
    pytest.importorskip("triton")
    import hylo.kernels.fused_kl.triton_kernel as triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HYLO_KERNELS", "triton")
    monkeypatch.setattr(triton_kernel, "BLOCK_V_MAX", 16)
    hs, ws, ht, wt, labels = _eval_case()
    fused = sum_kl(hs, ws, ht, wt, 16) + sum_nll(hs, ws, labels, 16)

    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton step ran on the exact path")

    monkeypatch.setattr(triton_kernel, "dense_kl_step", forbidden)
    monkeypatch.setattr(triton_kernel, "topk_kl_step", forbidden)
    exact = sum_kl(hs, ws, ht, wt, 16, exact=True) + sum_nll(hs, ws, labels, 16, exact=True)
    assert exact == pytest.approx(fused, rel=1e-5)
    # the guard can fire: without `exact` the Triton steps run here
    with pytest.raises(AssertionError, match="a Triton step ran"):
        sum_kl(hs, ws, ht, wt, 16)


def test_forced_mode_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("HYLO_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(1)
    assert use_gpu_kernels(x)
    with forced_mode("torch"):
        assert not use_gpu_kernels(x)
    assert use_gpu_kernels(x)
    with pytest.raises(ValueError, match="kernel mode 'cuda' is not valid"):
        with forced_mode("cuda"):
            pass
