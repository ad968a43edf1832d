"""The fused losses' precision modes on bf16/fp16 inputs against fp64, with the CPU's exact reproduction of
the tensor-core arithmetic (kernels/fused_kl/gemm.py), and mutants of that arithmetic that must be caught.

Errors are relative norms ||got - ref|| / ||ref|| against the fp64 reference on the same (bf16-valued)
inputs, measured by bench/kl_precision.py (the table in kernels/fused_kl/README.md): the loss, the
gradients before their final rounding (the fp32 accumulators) and as returned. Measured at these shapes
(bf16): accurate ~3e-6, fast ~1.5e-3 (dense, top-k), ~8e-4 (CE); the bounds below leave 3-10x margin.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hylo.kernels.fused_kl.chunked as chunked
from hylo.kernels.fused_kl import fused_linear_kl_div, gemm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import kl_precision  # noqa: E402  (bench/kl_precision.py: the measure behind the README's table)

sys.path.remove(str(REPO / "bench"))

N, H, V = 96, 64, 512
# bf16, relative errors: the loss (logits are exact products summed in fp32), the unrounded gradients
# per mode, and the returned (bf16) gradients against the fp64 gradient rounded to bf16
LOSS_TOL = 1e-6
ACCURATE_GRAD = 1e-5
FAST_GRAD = (2e-4, 1e-2)
ACCURATE_OUT = 5e-4


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("HYLO_KERNELS", "torch")


@pytest.fixture(scope="module")
def bf16_case():
    x = kl_precision.make_inputs(N, H, V, torch.bfloat16)
    return x, {path: kl_precision.reference(path, x) for path in kl_precision.PATHS}


def check_accurate(x: dict, ref: tuple, path: str) -> dict[str, float]:
    e = kl_precision.measure(path, "accurate", x, ref)
    assert e["loss"] <= LOSS_TOL, f"{path} accurate: loss error {e['loss']:.2e}"
    for g in ("dh", "dw"):
        assert e[g] <= ACCURATE_GRAD, f"{path} accurate: {g} error {e[g]:.2e} > {ACCURATE_GRAD:.0e}"
        assert e[f"{g}_out"] <= ACCURATE_OUT, f"{path} accurate: returned {g} error {e[g + '_out']:.2e}"
    return e


@pytest.mark.parametrize("path", kl_precision.PATHS)
def test_accurate_mode_is_within_a_few_1e_6_of_fp64_and_far_better_than_fast(bf16_case, path):
    x, refs = bf16_case
    acc = check_accurate(x, refs[path], path)
    fast = kl_precision.measure(path, "fast", x, refs[path])
    # the forward is the same in both modes: exact products, fp32 sums, fp32 softmax
    assert fast["loss"] <= LOSS_TOL
    for g in ("dh", "dw"):
        assert FAST_GRAD[0] <= fast[g] <= FAST_GRAD[1], f"{path} fast: {g} error {fast[g]:.2e}"
        assert fast[g] >= 100 * acc[g], f"{path}: fast {fast[g]:.2e} is not far worse than accurate {acc[g]:.2e}"
        assert fast[f"{g}_out"] >= 5 * acc[f"{g}_out"]


def test_fp32_inputs_ignore_the_mode(bf16_case):
    x, _ = bf16_case
    h, w = x["h"].float(), x["w"].float()
    kw = dict(teacher_hidden=x["th"].float(), teacher_weight=x["tw"].float(), mask=x["mask"], chunk_size=32)
    outs = []
    for precision in gemm.PRECISIONS:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fused_linear_kl_div(hh, ww, precision=precision, **kw)
        outs.append((loss, *torch.autograd.grad(loss, [hh, ww])))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_an_unknown_precision_is_a_clear_error(bf16_case):
    x, _ = bf16_case
    with pytest.raises(ValueError, match=r"precision must be one of accurate, fast; got 'exact'"):
        fused_linear_kl_div(x["h"], x["w"], teacher_topk=x["topk"], precision="exact")


def test_the_config_choices_are_the_kernels():
    from hylo.pipeline.train.config import KL_PRECISIONS

    assert KL_PRECISIONS == gemm.PRECISIONS


def test_fp16_inputs_keep_the_accurate_bound_at_a_mean_over_many_tokens():
    # "mean" over 2,048 tokens: d(loss)/d(logits) ~ 1e-2 / 2048, near fp16's smallest normal (6e-5): the
    # step writes (q - p) * 2^14 and the products' alpha applies 1 / (2048 * 2^14) (gemm.SPLIT_SHIFT)
    x = kl_precision.make_inputs(2048, 16, 64, torch.float16, seed=1)
    for path in ("dense", "ce"):
        e = kl_precision.measure(path, "accurate", x)
        assert max(e["dh"], e["dw"]) <= ACCURATE_GRAD, (path, e)


def test_the_gpu_call_is_the_native_out_dtype_product():
    # on fake tensors (the step estimate; a GPU takes the same branch) the product is aten's bf16 x bf16 ->
    # fp32 overload, not an upcast: the dtypes the estimate prices are the real ones
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = (kwargs or {}).get("out")
            self.seen.append((str(func), tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
                              None if out is None else out.dtype))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(), Ops() as ops:
        a, b = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(16, 4, dtype=torch.bfloat16)
        out = torch.empty(8, 4)
        gemm.mm_f32(a, b, out)
        gemm.mm_f32(a, b, out, accumulate=True, alpha=0.5)
    products = [s for s in ops.seen if "mm" in s[0]]
    assert [p[0] for p in products] == ["aten.mm.dtype_out", "aten.addmm.dtype_out"], ops.seen
    assert products[0][1:] == ((torch.bfloat16, torch.bfloat16), torch.float32), products
    assert not any("_to_copy" in s[0] for s in ops.seen), ops.seen


# ------------------------------------------------------------------------------------------- mutants
def _drop_lo(parts_for_h: bool, parts_for_w: bool):
    original = chunked._gradient_products

    def mutant(parts, rows, weight, hidden, gh, gw, alpha):
        original(parts[:1] if parts_for_h else parts, rows, weight, hidden, gh, None, alpha)
        original(parts[:1] if parts_for_w else parts, rows, weight, hidden, None, gw, alpha)

    return "_gradient_products", mutant


def _mm_mutant(change):
    original = gemm.mm_f32

    def mutant(a, b, out, *, accumulate=False, alpha=1.0):
        return change(original, a, b, out, accumulate, alpha)

    return "mm_f32", mutant


MUTANTS = {
    "lo-half-dropped": ("split_operands", lambda g, dtype, precision, scratch: gemm.split_operands(
        g, dtype, "fast", scratch)),
    "lo-half-dropped-from-grad-hidden": _drop_lo(True, False),
    "lo-half-dropped-from-grad-weight": _drop_lo(False, True),
    "second-product-overwrites": _mm_mutant(lambda mm, a, b, out, acc, alpha: mm(a, b, out, alpha=alpha)),
    "alpha-dropped": _mm_mutant(lambda mm, a, b, out, acc, alpha: mm(a, b, out, accumulate=acc)),
    "logits-rounded-to-bf16": _mm_mutant(
        lambda mm, a, b, out, acc, alpha: mm(a, b, out, accumulate=acc, alpha=alpha).copy_(
            out.to(a.dtype) if not acc and a.dtype in gemm.LOW_PRECISION else out)),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
@pytest.mark.parametrize("path", kl_precision.PATHS)
def test_a_dropped_term_fails_the_accurate_check(bf16_case, monkeypatch, path, mutant):
    x, refs = bf16_case
    check_accurate(x, refs[path], path)
    name, fn = MUTANTS[mutant]
    monkeypatch.setattr(chunked, name, fn)
    with pytest.raises(AssertionError):
        check_accurate(x, refs[path], path)


# ------------------------------------------------------------------------------------------- Triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["dense", "topk"])
def test_the_triton_steps_keep_the_accurate_bound(monkeypatch, path):
    pytest.importorskip("triton")
    import hylo.kernels.fused_kl.triton_kernel as triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HYLO_KERNELS", "triton")
    monkeypatch.setattr(triton_kernel, "BLOCK_V_MAX", 64)
    monkeypatch.setattr(chunked, "dense_kl_step_torch", None)
    monkeypatch.setattr(chunked, "topk_kl_step_torch", None)
    x = kl_precision.make_inputs(24, 32, 128, torch.bfloat16, seed=2)
    acc = kl_precision.measure(path, "accurate", x)
    fast = kl_precision.measure(path, "fast", x)
    assert acc["loss"] <= LOSS_TOL and max(acc["dh"], acc["dw"]) <= ACCURATE_GRAD, acc
    assert min(fast["dh"], fast["dw"]) >= 30 * max(acc["dh"], acc["dw"]), (acc, fast)


# ------------------------------------------------------------------------------------------- the default
@pytest.mark.parametrize("mode", kl_precision.CHOICES)
def test_the_after_cast_error_is_against_the_true_fp64_gradient(bf16_case, mode):
    """bench/kl_precision.py's "after the cast" columns: the returned bf16 gradient against the fp64
    gradient of the naive loss, not against its rounding (gpu-check's "out") nor an fp32 reference."""
    x, refs = bf16_case
    e = kl_precision.measure("dense", mode, x, refs["dense"])
    h, w = (x[k].clone().requires_grad_() for k in ("h", "w"))
    loss = fused_linear_kl_div(h, w, teacher_hidden=x["th"], teacher_weight=x["tw"], mask=x["mask"],
                               chunk_size=64, precision=mode)
    got = torch.autograd.grad(loss, [h, w])
    h64, w64 = (x[k].double().requires_grad_() for k in ("h", "w"))
    ref = torch.autograd.grad(kl_precision.fused_kl.naive_kl_div(
        h64, w64, teacher_hidden=x["th"].double(), teacher_weight=x["tw"].double(), mask=x["mask"]), [h64, w64])
    for name, g, r in zip(("dh_true", "dw_true"), got, ref):
        assert g.dtype == torch.bfloat16 and r.dtype == torch.float64
        want = float((g.double() - r).norm() / r.norm())
        assert e[name] == pytest.approx(want, rel=1e-6), (name, e[name], want)
    # the cast alone puts the fp64 gradient ~1.7e-3 from itself: no returned bf16 gradient does better
    cast = kl_precision.cast_error(refs["dense"], torch.bfloat16)
    assert 1e-3 < cast["dh"] < 3e-3 and 1e-3 < cast["dw"] < 3e-3, cast
    assert e["dh_true"] >= 0.99 * cast["dh"] and e["dw_true"] >= 0.99 * cast["dw"], (e, cast)


def test_the_loss_cost_is_the_estimators_count_of_its_products():
    # the fused top-k loss on fake tensors under the estimator's rules: student logits, d(hidden), d(weight),
    # the two gradient products twice in accurate mode (hi and lo halves)
    n, h, v = 96, 64, 512
    assert kl_precision.loss_flops("fast", n, h, v, k=16) == 6 * n * v * h
    assert kl_precision.loss_flops("accurate", n, h, v, k=16) == 10 * n * v * h


def test_the_rule_takes_the_cheapest_mode_within_its_factor():
    cost = {"accurate": 10.0, "fast": 6.0}
    assert kl_precision.choose({"accurate": 1.0, "fast": 1.4}, cost) == "fast"
    assert kl_precision.choose({"accurate": 1.0, "fast": 2.5}, cost) == "accurate"
    assert kl_precision.choose({"accurate": 1.0, "fast": 1.4}, cost, factor=1.2) == "accurate"
    # none within: the most accurate
    assert kl_precision.choose({"accurate": 3.0, "fast": 4.0}, cost) == "accurate"


def test_the_config_default_is_the_rules_choice(bf16_case):
    """kd.kl_precision's default is what the rule picks from figures measured here (bf16, N=96, H=64, V=512):
    each mode's worst returned-gradient error over the three paths, as a multiple of the cast's own error,
    and each mode's FLOPs as the estimator counts them. A default that drifts from the rule fails."""
    from hylo.pipeline.train.config import KDSection

    x, refs = bf16_case
    worst = dict.fromkeys(kl_precision.CHOICES, 0.0)
    for path in kl_precision.PATHS:
        cast = kl_precision.cast_error(refs[path], torch.bfloat16)
        for mode in kl_precision.CHOICES:
            e = kl_precision.measure(path, mode, x, refs[path])
            worst[mode] = max(worst[mode], kl_precision.cast_multiple(e, cast))
    cost = {m: kl_precision.loss_flops(m, N, H, V, k=16) for m in kl_precision.CHOICES}
    # measured: accurate 1.00x, fast ~1.45x (dense, top-k; CE ~1.1x)
    assert worst["accurate"] == pytest.approx(1.0, abs=0.02), worst
    assert 1.1 < worst["fast"] < kl_precision.RULE_FACTOR, worst
    assert KDSection().kl_precision == kl_precision.choose(worst, cost), (worst, cost)
