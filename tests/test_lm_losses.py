"""The LM-head losses' one home (hylo.kernels.fused_kl): the fused cross-entropy against its reference and
the maths, the eval's KL / NLL sums against the formulas they replaced, and the references standing alone.

Tiny awkward shapes as in test_fused_kl.py: N=37 tokens, V=50 ids, chunks of 8, 16-wide Triton tiles.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import hylo.kernels.fused_kl.chunked as chunked
import pytest
import torch
import torch.nn.functional as F
from hylo.kernels.backend import forced_mode, use_gpu_kernels
from hylo.kernels.fused_kl import fused_linear_cross_entropy, naive_cross_entropy, naive_kl_div
from hylo.pipeline.eval.kl import sum_kl, sum_nll

N, H, H_T, V, CHUNK = 37, 16, 24, 50, 8
FUSED_KL = Path(chunked.__file__).parent


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float((ref - got).norm() / ref.norm().clamp_min(1e-30))


def _case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) > 0.3
    return hidden, weight, labels, mask


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("HYLO_KERNELS", "torch")


@pytest.fixture
def triton_path(monkeypatch):
    """The Triton kernels (interpreted on CPU); the torch step must not run."""
    pytest.importorskip("triton")
    import hylo.kernels.fused_kl.triton_kernel as triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HYLO_KERNELS", "triton")
    monkeypatch.setattr(triton_kernel, "BLOCK_V_MAX", 16)

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch step ran on the Triton path")

    monkeypatch.setattr(chunked, "topk_kl_step_torch", forbidden)


# ------------------------------------------------------------------------------------ cross-entropy
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_fused_cross_entropy_matches_the_reference_and_its_gradients(request, path, dtype, reduction):
    request.getfixturevalue(f"{path}_path")
    hidden, weight, labels, mask = _case(dtype)
    # a masked token's label is ignored, whatever it holds
    labels = torch.where(mask, labels, torch.full_like(labels, -100))
    ref = naive_cross_entropy(hidden, weight, labels, mask=mask, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    got = fused_linear_cross_entropy(hidden, weight, labels, mask=mask, reduction=reduction, chunk_size=CHUNK)
    got_grads = torch.autograd.grad(2.0 * got, [hidden, weight])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert got.dtype == dtype and _rel(ref, got) <= tol
    for r, o in zip(ref_grads, got_grads):
        assert _rel(2.0 * r, o) <= tol


def test_cross_entropy_reference_is_the_formula():
    hidden, weight, labels, mask = _case(torch.float64)
    logits = hidden @ weight.t()
    # -log softmax(logits)[label], written out
    nll = torch.stack([torch.logsumexp(logits[n], 0) - logits[n, labels[n]] for n in range(N)])
    want = nll[mask].sum().detach()
    got = naive_cross_entropy(hidden, weight, labels, mask=mask, reduction="sum").detach()
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    fused = fused_linear_cross_entropy(hidden, weight, labels, mask=mask, reduction="sum", chunk_size=CHUNK).detach()
    assert float(fused) == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize("labels, match", [
    (torch.full((N,), V), "fused_linear_cross_entropy: labels out of range: found \\[50, 50\\], vocab size is 50"),
    (torch.zeros(N, 1, dtype=torch.long), "labels must be a \\[N\\] integer tensor"),
    (torch.zeros(N - 1, dtype=torch.long), "fused_linear_cross_entropy: labels has 36 rows but hidden has 37"),
], ids=["out-of-range", "2d", "rows"])
def test_cross_entropy_bad_labels_are_a_clear_error(torch_path, labels, match):
    hidden, weight, _, _ = _case(torch.float32)
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, labels)


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
def test_eval_sums_are_the_formulas_they_replaced(exact, chunk):
    # the formulas of the former pipeline/eval/kl.chunked_kl_sum / chunked_nll_sum, in fp64, whole
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


# ------------------------------------------------------------------------------------ references
def test_the_references_import_nothing_of_the_fast_path():
    tree = ast.parse((FUSED_KL / "naive.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "collections.abc", "torch", "torch.nn.functional"}, imported


def test_topk_reference_is_the_bucket_formula():
    # one token by hand: teacher top-2 + tail at T = 2, KL = sum_b P_b (log P_b - log Q_b)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(1, 4, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g,
                                                                                    dtype=torch.float64)
    ids, lp, tail, temp = [4, 1], [math.log(0.5), math.log(0.3)], math.log(0.2), 2.0
    q = torch.softmax((hidden @ weight.t())[0] / temp, -1).tolist()
    w = [math.exp(x / temp) for x in (*lp, tail)]
    p = [x / sum(w) for x in w]
    qb = [q[4], q[1], sum(q[v] for v in range(6) if v not in ids)]
    want = sum(pb * (math.log(pb) - math.log(qbb)) for pb, qbb in zip(p, qb))
    rec = (torch.tensor([lp], dtype=torch.float64), torch.tensor([ids]), torch.tensor([tail], dtype=torch.float64))
    assert float(naive_kl_div(hidden, weight, teacher_topk=rec, temperature=temp)) == pytest.approx(want, rel=1e-12)
    # without the tail: the top-2 renormalised, the student's probabilities as they are
    p2 = [math.exp(x / temp) for x in lp]
    p2 = [x / sum(p2) for x in p2]
    want2 = sum(pb * (math.log(pb) - math.log(qbb)) for pb, qbb in zip(p2, qb[:2]))
    got2 = naive_kl_div(hidden, weight, teacher_topk=rec[:2], temperature=temp)
    assert float(got2) == pytest.approx(want2, rel=1e-12)
