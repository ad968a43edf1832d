"""fused_linear_kl_div and fused_linear_cross_entropy (torch chunked path and Triton kernels) against the
standalone references of naive.py.

Shapes are tiny and awkward on purpose: N=37 tokens and V=50 ids with chunk_size=8 and (for the
Triton kernel) 16-wide vocabulary tiles, so the last chunk and the last tile are ragged.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import hylo.kernels.fused_kl.chunked as chunked
from hylo.kernels.fused_kl import (
    TeacherTopK,
    auto_chunk_size,
    fused_linear_cross_entropy,
    fused_linear_kl_div,
    naive_cross_entropy,
    naive_kl_div,
    tail_logmass_from_topk,
    topk_from_logits,
)

N, H, H_T, V, K, CHUNK = 37, 16, 24, 50, 7, 8
FORMS = ["hidden", "topk_tail", "topk_notail", "logits_fn"]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
# (mask, temperature, reduction)
VARIANTS = {
    "plain": (False, 1.0, "mean"),
    "mask-T0.7-mean": (True, 0.7, "mean"),
    "mask-T2-sum": (True, 2.0, "sum"),
}
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def rel_rms(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return float((ref - got).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(got).any(), f"{name}: NaN"
    err = rel_rms(ref, got)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def make_case(dtype: torch.dtype, form: str, masked: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    t_hidden = torch.randn(N, H_T, generator=g, dtype=dtype)
    t_weight = torch.randn(V, H_T, generator=g, dtype=dtype) * 0.5
    mask = torch.rand(N, generator=g) > 0.3 if masked else None
    t_logits = t_hidden @ t_weight.t()
    if form == "hidden":
        teacher = dict(teacher_hidden=t_hidden, teacher_weight=t_weight)
    elif form == "topk_tail":
        teacher = dict(teacher_topk=topk_from_logits(t_logits, K, dtype=dtype))
    elif form == "topk_notail":
        rec = topk_from_logits(t_logits, K, dtype=dtype)
        # The plain tuple form, without a tail: the teacher's top-k get renormalised.
        teacher = dict(teacher_topk=(rec.logprobs, rec.indices))
    else:
        teacher = dict(teacher_logits_fn=lambda i, j: t_logits[i:j])
    return hidden, weight, teacher, mask


def run_both(hidden, weight, teacher, mask, temperature, reduction, chunk_size=CHUNK):
    ref = naive_kl_div(hidden, weight, mask=mask, temperature=temperature, reduction=reduction, **teacher)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    out = fused_linear_kl_div(
        hidden, weight, mask=mask, temperature=temperature, reduction=reduction, chunk_size=chunk_size, **teacher
    )
    out_grads = torch.autograd.grad(out, [hidden, weight])
    return (ref, *ref_grads), (out, *out_grads)


def check_against_naive(dtype, form, variant, chunk_size=CHUNK):
    masked, temperature, reduction = VARIANTS[variant]
    hidden, weight, teacher, mask = make_case(dtype, form, masked)
    ref, out = run_both(hidden, weight, teacher, mask, temperature, reduction, chunk_size)
    assert out[0].dtype == dtype
    for name, r, o in zip(("loss", "d_hidden", "d_weight"), ref, out):
        assert_close(name, r, o, TOL[dtype])


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("HYLO_KERNELS", "torch")


@pytest.fixture
def triton_path(monkeypatch):
    """Force the Triton kernel (interpreted on CPU) and make sure the torch step is not used."""
    pytest.importorskip("triton")
    import hylo.kernels.fused_kl.triton_kernel as triton_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HYLO_KERNELS", "triton")
    monkeypatch.setattr(triton_kernel, "BLOCK_V_MAX", 16)

    def forbidden(*args, **kwargs):
        raise AssertionError("the torch step ran on the Triton path")

    monkeypatch.setattr(chunked, "dense_kl_step_torch", forbidden)
    monkeypatch.setattr(chunked, "topk_kl_step_torch", forbidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_torch_path_matches_naive(torch_path, dtype, form, variant):
    check_against_naive(dtype, form, variant)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_auto_chunk_size_matches_naive(torch_path, dtype, form):
    check_against_naive(dtype, form, "mask-T0.7-mean", chunk_size=None)


# The interpreter warns about inf - inf inside tl.where branches that are then discarded.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("variant", ["plain", "mask-T0.7-mean"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_triton_kernel_matches_naive(triton_path, dtype, form, variant):
    check_against_naive(dtype, form, variant)


def test_naive_is_the_published_reference():
    hidden, weight, teacher, _ = make_case(torch.float64, "hidden", False)
    s = hidden @ weight.t()
    t = teacher["teacher_hidden"] @ teacher["teacher_weight"].t()
    published = F.kl_div(F.log_softmax(s, -1), F.softmax(t, -1), reduction="batchmean")
    torch.testing.assert_close(naive_kl_div(hidden, weight, **teacher), published, rtol=1e-12, atol=0)
    # With temperature, both sides are divided by T and nothing is multiplied by T^2.
    published_t = F.kl_div(F.log_softmax(s / 3.0, -1), F.softmax(t / 3.0, -1), reduction="batchmean")
    torch.testing.assert_close(naive_kl_div(hidden, weight, temperature=3.0, **teacher), published_t)


def test_naive_mask_means_over_kept_rows():
    hidden, weight, teacher, mask = make_case(torch.float64, "hidden", True)
    masked = naive_kl_div(hidden, weight, mask=mask, **teacher)
    subset = naive_kl_div(
        hidden[mask], weight, teacher_hidden=teacher["teacher_hidden"][mask], teacher_weight=teacher["teacher_weight"]
    )
    torch.testing.assert_close(masked, subset, rtol=1e-12, atol=0)
    total = naive_kl_div(hidden, weight, mask=mask, reduction="sum", **teacher)
    torch.testing.assert_close(total, subset * int(mask.sum()), rtol=1e-12, atol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "notail"])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_topk_with_k_equal_vocab_is_the_full_loss(request, path, tail, temperature):
    request.getfixturevalue(f"{path}_path")
    hidden, weight, teacher, mask = make_case(torch.float64, "logits_fn", True)
    t_logits = teacher["teacher_logits_fn"](0, N)
    # Built in fp64 here (topk_from_logits works in fp32, too coarse for a 1e-12 comparison).
    logprobs, indices = F.log_softmax(t_logits, -1).topk(V, dim=-1)
    tail_logmass = tail_logmass_from_topk(logprobs).double() if tail else None
    topk = TeacherTopK(logprobs, indices, tail_logmass)
    kwargs = dict(mask=mask, temperature=temperature, chunk_size=CHUNK)
    full = fused_linear_kl_div(hidden, weight, teacher_logits_fn=lambda i, j: t_logits[i:j], **kwargs)
    full_grads = torch.autograd.grad(full, [hidden, weight])
    sparse = fused_linear_kl_div(hidden, weight, teacher_topk=topk, **kwargs)
    sparse_grads = torch.autograd.grad(sparse, [hidden, weight])
    for name, r, o in zip(("loss", "d_hidden", "d_weight"), (full, *full_grads), (sparse, *sparse_grads)):
        assert_close(name, r, o, 1e-12)


def test_topk_tail_bucket_changes_the_target(torch_path):
    # With k < V the tail bucket is a real extra term: the two top-k forms must differ.
    hidden, weight, teacher, _ = make_case(torch.float64, "topk_tail", False)
    rec = teacher["teacher_topk"]
    with_tail = fused_linear_kl_div(hidden, weight, teacher_topk=rec)
    without = fused_linear_kl_div(hidden, weight, teacher_topk=rec[:2])
    assert float((with_tail - without).detach().abs()) > 1e-3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_teacher_logits_with_neg_inf(request, path):
    # Banned vocabulary entries (-inf teacher logits) have zero teacher mass and add nothing.
    request.getfixturevalue(f"{path}_path")
    hidden, weight, teacher, mask = make_case(torch.float64, "logits_fn", True)
    t_logits = teacher["teacher_logits_fn"](0, N).clone()
    t_logits[:, ::3] = float("-inf")
    teacher = dict(teacher_logits_fn=lambda i, j: t_logits[i:j])
    ref, out = run_both(hidden, weight, teacher, mask, 0.7, "mean")
    for name, r, o in zip(("loss", "d_hidden", "d_weight"), ref, out):
        assert_close(name, r, o, 1e-12)


def test_bf16_logits_are_not_rounded_and_grads_accumulate_in_fp32(torch_path):
    torch.manual_seed(0)
    n, h, v = 64, 32, 96
    hidden = torch.randn(n, h).bfloat16().requires_grad_()
    weight = torch.randn(v, h).bfloat16().requires_grad_()
    t_logits = torch.randn(n, v) * 3
    teacher = dict(teacher_logits_fn=lambda i, j: t_logits[i:j])
    out = fused_linear_kl_div(hidden, weight, chunk_size=1, **teacher)
    d_hidden, d_weight = torch.autograd.grad(out, [hidden, weight])
    assert out.dtype == torch.float32 and d_hidden.dtype == d_weight.dtype == torch.bfloat16

    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    ref = naive_kl_div(hidden64, weight64, **teacher)
    ref_hidden, ref_weight = torch.autograd.grad(ref, [hidden64, weight64])
    # Logits rounded to bf16 before the softmax would be off by ~1e-3 relative here.
    rounded = F.kl_div(
        F.log_softmax((hidden64 @ weight64.t()).bfloat16().double(), -1), F.softmax(t_logits.double(), -1),
        reduction="batchmean",
    )
    err = abs(float(out.detach().double() - ref.detach()))
    assert abs(float(rounded.detach() - ref.detach())) > 100 * err
    assert err <= 1e-5 * float(ref.detach())
    # fp32 accumulation over 64 chunks, one final rounding: within bf16's half-ulp of the exact value.
    for name, r, got in (("d_hidden", ref_hidden, d_hidden), ("d_weight", ref_weight, d_weight)):
        bound = r.abs() * 2.0**-8 + 1e-7
        assert bool(((got.double() - r).abs() <= bound).all()), name


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("form", FORMS)
def test_no_tensor_of_size_n_by_v(torch_path, form):
    n, h, chunk = 256, 8, 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(64, h, generator=g).requires_grad_()
    vocab = weight.shape[0]
    t_hidden, t_weight = torch.randn(n, h, generator=g), torch.randn(vocab, h, generator=g)
    t_logits = t_hidden @ t_weight.t()
    teacher = {
        "hidden": dict(teacher_hidden=t_hidden, teacher_weight=t_weight),
        "topk_tail": dict(teacher_topk=topk_from_logits(t_logits, 8)),
        "topk_notail": dict(teacher_topk=topk_from_logits(t_logits, 8)[:2]),
        "logits_fn": dict(teacher_logits_fn=lambda i, j: t_logits[i:j]),
    }[form]
    limit = max(chunk * vocab, n * h, vocab * h)
    assert limit < n * vocab
    with _LargestTensor() as probe:
        fused_linear_kl_div(hidden, weight, chunk_size=chunk, **teacher).backward()
    assert probe.largest <= limit, f"a tensor of {probe.largest} elements (limit {limit})"
    # The probe itself can fail: the naive reference does materialise [N, V].
    with _LargestTensor() as probe:
        naive_kl_div(hidden, weight, **teacher).backward()
    assert probe.largest >= n * vocab


def test_fully_masked_gives_zero_loss_and_grads(torch_path):
    hidden, weight, teacher, _ = make_case(torch.float32, "hidden", False)
    out = fused_linear_kl_div(hidden, weight, mask=torch.zeros(N, dtype=torch.bool), **teacher)
    out.backward()
    assert float(out.detach()) == 0.0
    assert not hidden.grad.any() and not weight.grad.any()


def test_int_mask_frozen_weight_and_grad_scaling(torch_path):
    hidden, weight, teacher, mask = make_case(torch.float64, "hidden", True)
    weight.requires_grad_(False)
    (3.0 * naive_kl_div(hidden, weight, mask=mask, **teacher)).backward()
    ref = hidden.grad.clone()
    hidden.grad = None
    (3.0 * fused_linear_kl_div(hidden, weight, mask=mask.to(torch.int8), chunk_size=CHUNK, **teacher)).backward()
    assert_close("d_hidden", ref, hidden.grad, 1e-12)
    assert weight.grad is None


def test_teacher_gets_no_gradient_and_no_grad_mode(torch_path):
    hidden, weight, teacher, _ = make_case(torch.float64, "hidden", False)
    teacher["teacher_hidden"].requires_grad_()
    fused_linear_kl_div(hidden, weight, chunk_size=CHUNK, **teacher).backward()
    assert teacher["teacher_hidden"].grad is None and hidden.grad is not None
    with torch.no_grad():
        loss = fused_linear_kl_div(hidden, weight, chunk_size=CHUNK, **teacher)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, naive_kl_div(hidden, weight, **teacher).detach(), rtol=1e-12, atol=0)


def test_logits_fn_is_streamed_in_chunks(torch_path):
    hidden, weight, teacher, _ = make_case(torch.float64, "logits_fn", False)
    calls = []
    mask = torch.ones(N, dtype=torch.bool)
    mask[8:16] = False

    def fn(i, j):
        calls.append((i, j))
        return teacher["teacher_logits_fn"](i, j)

    fused_linear_kl_div(hidden, weight, teacher_logits_fn=fn, mask=mask, chunk_size=CHUNK)
    # Rows 8:16 are all masked: that chunk is never requested.
    assert calls == [(0, 8), (16, 24), (24, 32), (32, 37)]


def test_auto_chunk_size_bounds_the_chunk_buffers():
    cpu = torch.device("cpu")
    for n, v in ((65536, 128256), (8192, 49152), (100, 50)):
        c = auto_chunk_size(n, v, cpu)
        assert 1 <= c <= n
        assert c == n or c * v * 4 * 4 <= chunked.CHUNK_BUDGET_BYTES["cpu"] or c == 16


def _bad_cases():
    def base():
        hidden, weight, teacher, mask = make_case(torch.float32, "hidden", True)
        rec = topk_from_logits(teacher["teacher_hidden"] @ teacher["teacher_weight"].t(), K)
        return dict(student_hidden=hidden.detach(), student_weight=weight.detach(), mask=mask), teacher, rec

    def case(name, build, match):
        return pytest.param(build, match, id=name)

    def with_teacher(update):
        def build():
            kwargs, teacher, rec = base()
            kwargs.update(teacher)
            update(kwargs, rec)
            return kwargs

        return build

    def with_topk(fix):
        def build():
            kwargs, _, rec = base()
            kwargs["teacher_topk"] = fix(rec)
            return kwargs

        return build

    def nan_at(x, value=float("nan")):
        x = x.clone()
        x.view(-1)[3] = value
        return x

    return [
        case("student-1d", with_teacher(lambda kw, r: kw.update(student_hidden=kw["student_hidden"][0])), "student_hidden must be a \\[N, H\\]"),
        case("hidden-size", with_teacher(lambda kw, r: kw.update(student_weight=torch.randn(V, H + 1))), "student_weight has hidden size"),
        case("student-dtypes", with_teacher(lambda kw, r: kw.update(student_weight=kw["student_weight"].double())), "student_weight dtype"),
        case("no-teacher", with_topk(lambda r: None), "exactly one teacher form"),
        case("two-teachers", with_teacher(lambda kw, r: kw.update(teacher_topk=r)), "exactly one teacher form.*teacher_topk"),
        case("weight-missing", with_teacher(lambda kw, r: kw.pop("teacher_weight")), "teacher_weight is required"),
        case("teacher-vocab", with_teacher(lambda kw, r: kw.update(teacher_weight=torch.randn(V + 1, H_T))), "teacher_weight has vocab size 51 but student_weight has 50"),
        case("teacher-rows", with_teacher(lambda kw, r: kw.update(teacher_hidden=kw["teacher_hidden"][:-1])), "teacher_hidden has 36 rows"),
        case("teacher-dtypes", with_teacher(lambda kw, r: kw.update(teacher_weight=kw["teacher_weight"].double())), "teacher_weight dtype"),
        case("teacher-hidden-nan", with_teacher(lambda kw, r: kw.update(teacher_hidden=nan_at(kw["teacher_hidden"]))), "teacher_hidden contains NaN or inf"),
        case("teacher-weight-inf", with_teacher(lambda kw, r: kw.update(teacher_weight=nan_at(kw["teacher_weight"], float("inf")))), "teacher_weight contains NaN or inf"),
        case("topk-index-high", with_topk(lambda r: r._replace(indices=nan_at(r.indices, V))), "teacher_topk.indices out of range: found \\[\\d+, 50\\], vocab size is 50"),
        case("topk-index-negative", with_topk(lambda r: r._replace(indices=nan_at(r.indices, -1))), "teacher_topk.indices out of range"),
        case("topk-index-float", with_topk(lambda r: r._replace(indices=r.indices.float())), "teacher_topk.indices must be an integer"),
        case("topk-duplicate", with_topk(lambda r: r._replace(indices=torch.cat([r.indices[:, :1], r.indices[:, :-1]], 1))), "duplicate ids in row 0"),
        case("topk-logprobs-nan", with_topk(lambda r: r._replace(logprobs=nan_at(r.logprobs))), "teacher_topk.logprobs contains NaN"),
        case("topk-logprobs-inf", with_topk(lambda r: r._replace(logprobs=nan_at(r.logprobs, float("inf")))), "teacher_topk.logprobs contains \\+inf"),
        case("topk-shapes", with_topk(lambda r: r._replace(logprobs=r.logprobs[:, :-1])), "teacher_topk.logprobs shape"),
        case("topk-rows", with_topk(lambda r: TeacherTopK(r.logprobs[:-1], r.indices[:-1], r.tail_logmass[:-1])), "teacher_topk has 36 rows"),
        case("topk-k-too-big", with_topk(lambda r: (torch.zeros(N, V + 1), torch.zeros(N, V + 1, dtype=torch.long))), "k=51"),
        case("topk-tail-shape", with_topk(lambda r: r._replace(tail_logmass=r.tail_logmass[:-1])), "tail_logmass must be a \\[N=37\\]"),
        case("topk-tail-nan", with_topk(lambda r: r._replace(tail_logmass=nan_at(r.tail_logmass))), "tail_logmass contains NaN"),
        case("topk-no-mass", with_topk(lambda r: TeacherTopK(torch.full_like(r.logprobs, float("-inf")), r.indices)), "row 0 has no probability mass"),
        case("topk-not-a-record", with_topk(lambda r: r.logprobs), "teacher_topk must be a TeacherTopK"),
        case("mask-shape", with_teacher(lambda kw, r: kw.update(mask=kw["mask"][:-1])), "mask must be a \\[N=37\\]"),
        case("mask-float", with_teacher(lambda kw, r: kw.update(mask=kw["mask"].float())), "mask must be bool"),
        case("mask-values", with_teacher(lambda kw, r: kw.update(mask=kw["mask"].long() * 2)), "mask must hold only 0 and 1"),
        case("temperature", with_teacher(lambda kw, r: kw.update(temperature=0.0)), "temperature must be a positive"),
        case("reduction", with_teacher(lambda kw, r: kw.update(reduction="batchmean")), "reduction must be 'mean' or 'sum'"),
        case("chunk-size", with_teacher(lambda kw, r: kw.update(chunk_size=0)), "chunk_size must be a positive int"),
        case("fn-not-callable", lambda: {**base()[0], "teacher_logits_fn": 3}, "teacher_logits_fn must be callable"),
        case("fn-shape", lambda: {**base()[0], "teacher_logits_fn": lambda i, j: torch.zeros(j - i, V + 1)}, "teacher_logits_fn\\(0, \\d+\\) must return a \\[\\d+, V=50\\]"),
        case("fn-nan", lambda: {**base()[0], "teacher_logits_fn": lambda i, j: torch.full((j - i, V), float("nan"))}, "teacher_logits_fn\\(0, \\d+\\) output contains NaN"),
        case("fn-all-neg-inf", lambda: {**base()[0], "teacher_logits_fn": lambda i, j: torch.full((j - i, V), float("-inf"))}, "output row 0 is all -inf"),
        case("fn-int", lambda: {**base()[0], "teacher_logits_fn": lambda i, j: torch.zeros(j - i, V, dtype=torch.long)}, "returned dtype torch.int64"),
    ]


@pytest.mark.parametrize("build, match", _bad_cases())
def test_bad_input_is_a_clear_error(torch_path, build, match):
    kwargs = build()
    hidden, weight = kwargs.pop("student_hidden"), kwargs.pop("student_weight")
    chunk_size = kwargs.pop("chunk_size", CHUNK)
    with pytest.raises(ValueError, match=f"fused_linear_kl_div: .*{match}"):
        fused_linear_kl_div(hidden, weight, chunk_size=chunk_size, **kwargs)


# ------------------------------------------------------------------ the accelerator's rule: no host read
# `deferred_checks()` applies to CPU tensors what device tensors always get (inputs.reads_are_free):
# value checks become device flags, masked rows are zeroed rather than selected, no value is read back.
from hylo.kernels.fused_kl.inputs import check_deferred, deferred_checks  # noqa: E402
from hylo.kernels.host_reads import HostReadLog  # noqa: E402


@pytest.fixture
def no_pending():
    check_deferred()
    yield
    check_deferred()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_the_gpu_rule_reads_nothing_back_and_matches_naive(request, path, form, variant, no_pending):
    # the fused KL's forward AND backward under the accelerator's rule: zero host reads, the same
    # loss and gradients as the reference, and every deferred flag passes
    request.getfixturevalue(f"{path}_path")
    masked, temperature, reduction = VARIANTS[variant]
    hidden, weight, teacher, mask = make_case(torch.float32, form, masked)
    ref = naive_kl_div(hidden, weight, mask=mask, temperature=temperature, reduction=reduction, **teacher)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    with deferred_checks(), HostReadLog() as log:
        out = fused_linear_kl_div(hidden, weight, mask=mask, temperature=temperature, reduction=reduction,
                                  chunk_size=CHUNK, **teacher)
        # grad_output != 1 exercises the in-place scaling of the stored gradients
        out_grads = torch.autograd.grad(out * 3.0, [hidden, weight])
    assert log.reads == [], f"{len(log.reads)} host reads in the fused KL's step: {log.reads}"
    check_deferred()
    assert_close("loss", ref, out, TOL[torch.float32])
    for name, r, o in zip(("d_hidden", "d_weight"), ref_grads, out_grads):
        assert_close(name, 3.0 * r, o, TOL[torch.float32])


def test_the_host_read_log_sees_the_cpu_rule_reads(torch_path, no_pending):
    # guards the test above: the CPU rule (masked rows selected, checks at once) does read values
    hidden, weight, teacher, mask = make_case(torch.float32, "topk_tail", True)
    with HostReadLog() as log:
        fused_linear_kl_div(hidden, weight, mask=mask, chunk_size=CHUNK, **teacher).backward()
    names = {name for name, _ in log.reads}
    assert {"__int__", "nonzero", "__bool__"} <= names, log.reads


# (case id of _bad_cases, what the deferred error says): the value checks, whose words lose the row
DEFERRED_WORDS = {
    "teacher-hidden-nan": "teacher_hidden contains NaN or inf",
    "teacher-weight-inf": "teacher_weight contains NaN or inf",
    "topk-index-high": "teacher_topk.indices out of range: vocab size is 50",
    "topk-index-negative": "teacher_topk.indices out of range",
    "topk-duplicate": "teacher_topk.indices has duplicate ids in a row",
    "topk-logprobs-nan": "teacher_topk.logprobs contains NaN or \\+inf",
    "topk-logprobs-inf": "teacher_topk.logprobs contains NaN or \\+inf",
    "topk-tail-nan": "tail_logmass contains NaN or \\+inf",
    "topk-no-mass": "teacher_topk has a row with no probability mass",
    "mask-values": "mask must hold only 0 and 1",
    "fn-nan": "teacher_logits_fn\\(0, \\d+\\) output contains NaN or \\+inf",
    "fn-all-neg-inf": "teacher_logits_fn\\(0, \\d+\\) output has a row that is all -inf",
}


@pytest.mark.parametrize("build, words", [pytest.param(p.values[0], DEFERRED_WORDS[p.id], id=p.id)
                                          for p in _bad_cases() if p.id in DEFERRED_WORDS])
def test_bad_values_are_flagged_on_the_device_and_raised_by_check_deferred(torch_path, build, words, no_pending):
    # out-of-range ids are clamped until the flag is read, so the step itself cannot fault
    kwargs = build()
    hidden, weight = kwargs.pop("student_hidden"), kwargs.pop("student_weight")
    with deferred_checks(), HostReadLog() as log:
        fused_linear_kl_div(hidden, weight, chunk_size=CHUNK, **kwargs)
    assert log.reads == []
    with pytest.raises(ValueError, match=f"fused_linear_kl_div: .*{words}"):
        check_deferred()
    check_deferred()  # the flags were consumed: nothing is raised twice


def test_the_teacher_lm_head_is_scanned_once_per_version(torch_path, no_pending, monkeypatch):
    import hylo.kernels.fused_kl.inputs as inputs

    hidden, weight, teacher, _ = make_case(torch.float32, "hidden", False)
    scans = []
    real = torch.aminmax
    monkeypatch.setattr(inputs.torch, "aminmax", lambda x, **kw: scans.append(x.shape) or real(x, **kw))
    for _ in range(3):
        fused_linear_kl_div(hidden.detach(), weight.detach(), chunk_size=CHUNK, **teacher)
    # the teacher's hidden states every call, its LM head [V, H'] the first time only
    assert scans.count((V, H_T)) == 1 and scans.count((N, H_T)) == 3, scans
    # an in-place change (a new version) is checked again, and caught
    teacher["teacher_weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="teacher_weight contains NaN or inf"):
        fused_linear_kl_div(hidden.detach(), weight.detach(), chunk_size=CHUNK, **teacher)


# ------------------------------------------------------------------ cross-entropy: the KL against a one-hot teacher
def _ce_case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.5).requires_grad_()
    return hidden, weight, torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g) > 0.3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_fused_cross_entropy_matches_the_reference_and_its_gradients(request, path, dtype, reduction):
    request.getfixturevalue(f"{path}_path")
    hidden, weight, labels, mask = _ce_case(dtype)
    # a masked token's label is ignored, whatever it holds
    labels = torch.where(mask, labels, torch.full_like(labels, -100))
    ref = naive_cross_entropy(hidden, weight, labels, mask=mask, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    got = fused_linear_cross_entropy(hidden, weight, labels, mask=mask, reduction=reduction, chunk_size=CHUNK)
    got_grads = torch.autograd.grad(2.0 * got, [hidden, weight])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert got.dtype == dtype and rel_rms(ref, got) <= tol
    for r, o in zip(ref_grads, got_grads):
        assert rel_rms(2.0 * r, o) <= tol


def test_cross_entropy_reference_is_the_formula():
    hidden, weight, labels, mask = _ce_case(torch.float64)
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
    hidden, weight, _, _ = _ce_case(torch.float32)
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, labels)


# ------------------------------------------------------------------ the references stand alone
def test_the_references_import_nothing_of_the_fast_path():
    tree = ast.parse((Path(chunked.__file__).parent / "naive.py").read_text())
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
