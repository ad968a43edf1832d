"""Chunked gated delta rule (torch path) against the step-by-step reference.

Everything runs in float64 so the tolerance can be tight: the chunked and recurrent forms are
algebraically equal, so any difference beyond round-off is a bug.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import hylo.kernels.gdn.recurrent as gdn_recurrent
from hylo.kernels.gdn import (
    GatedDeltaRuleInputError,
    chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    recurrent_gated_delta_rule,
)

from tests.helpers.common import (
    assert_close,
    bad_cu_seqlens_cases,
    compare_runs,
    fake_fla_gdn,
    forward_backward,
    one_thread,  # noqa: F401 (autouse fixture)
)

DT = torch.float64
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(B, T, H, K, V, *, n_state=None, h0=True, normalize_k=True, g_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=DT)
    k = torch.randn(B, T, H, K, generator=gen, dtype=DT)
    if normalize_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=DT)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=DT)) * g_scale
    beta = torch.rand(B, T, H, generator=gen, dtype=DT)
    state = torch.randn(n_state or B, H, K, V, generator=gen, dtype=DT) if h0 else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, g, beta, state)]


def run(fn, q, k, v, g, beta, h0, seed=1, **kw):
    """Forward, then backward of a random projection of (o, final_state); returns values and grads."""
    return forward_backward(fn, (q, k, v, g, beta), h0, seed, **kw)


def compare(ref, got, ratio=1e-10):
    compare_runs(ref, got, "o", GRAD_NAMES, ratio)


def shape_id(B, T, H, K, V):
    return f"B{B}-T{T}-H{H}-K{K}-V{V}"


SHAPES = [(2, 63, 4, 16, 16), (2, 500, 3, 16, 32), (1, 1000, 2, 8, 16)]


@pytest.mark.parametrize(("B", "T", "H", "K", "V"), [pytest.param(*s, id=shape_id(*s)) for s in SHAPES])
@pytest.mark.parametrize("h0", [False, True], ids=["h0-none", "h0-given"])
def test_chunk_matches_naive(B, T, H, K, V, h0):
    inputs = make_inputs(B, T, H, K, V, h0=h0)
    compare(run(naive_recurrent_gated_delta_rule, *inputs), run(chunk_gated_delta_rule, *inputs))


@pytest.mark.parametrize(
    "bounds",
    [[0, 37, 300, 500], [0, 1, 65, 130, 131], [0, 64, 128]],
    ids=["uneven-37-263-200", "with-len1", "chunk-aligned"],
)
@pytest.mark.parametrize("h0", [False, True], ids=["h0-none", "h0-given"])
def test_varlen_equals_one_by_one(bounds, h0):
    T, H, K, V = bounds[-1], 2, 8, 16
    cu = torch.tensor(bounds, dtype=torch.int32)
    N = len(bounds) - 1
    q, k, v, g, beta, state = make_inputs(1, T, H, K, V, n_state=N, h0=h0)
    packed = run(chunk_gated_delta_rule, q, k, v, g, beta, state, cu_seqlens=cu)
    naive = run(naive_recurrent_gated_delta_rule, q, k, v, g, beta, state, cu_seqlens=cu)
    compare(naive, packed)

    # the same sequences, each in its own call, must give the same outputs and gradients
    outs, finals = [], []
    for i in range(N):
        s, e = bounds[i], bounds[i + 1]
        h0_i = state[i : i + 1] if state is not None else None
        o_i, ht_i = chunk_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=h0_i, output_final_state=True
        )
        outs.append(o_i)
        finals.append(ht_i[0])
    o_sep, ht_sep = torch.cat(outs, 1), torch.stack(finals, 0)
    assert_close("o vs one-by-one", o_sep, packed[0])
    assert_close("final_state vs one-by-one", ht_sep, packed[1])


@pytest.mark.parametrize("chunk_size", [1, 16, 50, 64, 200], ids=lambda c: f"C{c}")
def test_chunk_size_does_not_change_result(chunk_size):
    # against the token-by-token recurrence, not the default chunk size: C64 (the default) compared the
    # default with itself and could not fail
    inputs = make_inputs(1, 130, 2, 8, 8)
    compare(run(naive_recurrent_gated_delta_rule, *inputs), run(chunk_gated_delta_rule, *inputs, chunk_size=chunk_size))


def test_qk_l2norm_in_kernel():
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 16, 8, normalize_k=False)
    ref = run(naive_recurrent_gated_delta_rule, q, k, v, g, beta, h0, use_qk_l2norm_in_kernel=True)
    got = run(chunk_gated_delta_rule, q, k, v, g, beta, h0, use_qk_l2norm_in_kernel=True)
    compare(ref, got)
    # the flag must equal normalising outside (fla's eps 1e-6 inside the root)
    qn = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    kn = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    o_out, _ = chunk_gated_delta_rule(qn, kn, v, g, beta, initial_state=h0)
    assert_close("o (l2norm outside)", o_out, got[0])
    # and must actually change the result for unnormalised inputs
    o_raw, _ = chunk_gated_delta_rule(q * 3, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    # (equal up to the eps inside the root)
    assert_close("q scale removed by l2norm", got[0], o_raw, 1e-6)


def test_strong_decay_and_custom_scale_stay_finite():
    # log decays down to about -60 per token: exp(gamma) underflows inside a chunk, nothing may overflow
    inputs = make_inputs(1, 150, 2, 8, 8, g_scale=20.0)
    compare(run(naive_recurrent_gated_delta_rule, *inputs, scale=0.3), run(chunk_gated_delta_rule, *inputs, scale=0.3))


@pytest.mark.slow
def test_matches_fla_reference():
    """fla's own step-by-step reference (argument order q, k, v, beta, g; fp32 inside) agrees."""
    fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 70, 2, 16, 8))
    o_ref, ht_ref = fla_naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0,
                                                               output_final_state=True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close("o vs fla", o_ref, o, 1e-5)
    assert_close("final_state vs fla", ht_ref, ht, 1e-5)


def test_low_precision_inputs_computed_in_fp32():
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 90, 2, 16, 16))
    o_ref, ht_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    lo = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    o, ht = chunk_gated_delta_rule(*lo, initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_close("o bf16", o_ref, o, 3e-2)
    assert_close("final_state bf16", ht_ref, ht, 3e-2)


def test_single_token_and_no_final_state():
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(3, 1, 2, 8, 8))
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert ht is None
    o_ref, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert_close("o T=1", o_ref, o)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("l2", [False, True], ids=["raw-qk", "l2norm-qk"])
def test_recurrent_op_matches_naive_forward_and_backward(T, l2):
    """The decode step's torch path: outputs, final state and every gradient equal the reference."""
    q, k, v, g, beta, h0 = make_inputs(3, T, 2, 8, 16)
    compare(run(naive_recurrent_gated_delta_rule, q, k, v, g, beta, h0, use_qk_l2norm_in_kernel=l2),
            run(recurrent_gated_delta_rule, q, k, v, g, beta, h0, use_qk_l2norm_in_kernel=l2))
    o, ht = recurrent_gated_delta_rule(*(x.detach() for x in (q, k, v, g, beta)))
    assert ht is None and o.shape == v.shape


def test_prefill_then_recurrent_steps_equal_one_chunked_pass():
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 30, 2, 8, 16))
    o_ref, ht_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    outs, state = [], h0
    for s, e in [(0, 25)] + [(t, t + 1) for t in range(25, 30)]:
        fn = chunk_gated_delta_rule if e - s > 1 else recurrent_gated_delta_rule
        o, state = fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert_close("o prefill + steps", o_ref, torch.cat(outs, 1))
    assert_close("final state prefill + steps", ht_ref, state)


def test_recurrent_gpu_dispatch_goes_to_fla_recurrent_kernel(monkeypatch):
    """On the GPU path a decode step goes to fla's `fused_recurrent_gated_delta_rule` (beta by keyword: its
    fifth positional argument is `gk`); when autograd needs the graph, to fla's chunk op (the recurrent one
    has no backward)."""
    chunk_calls = fake_fla_gdn(monkeypatch)
    fake = sys.modules["fla.ops.gated_delta_rule"]
    calls = []

    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, **kw):
        calls.append(dict(gk=gk, gv=gv, **kw))
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)

    fake.fused_recurrent_gated_delta_rule = fused_recurrent_gated_delta_rule
    monkeypatch.setattr(gdn_recurrent, "use_fla", lambda x: True)
    q, k, v, g, beta, h0 = make_inputs(2, 1, 2, 8, 8)
    with torch.no_grad():
        o, ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
    assert len(calls) == 1 and not chunk_calls
    assert calls[0]["gk"] is None and calls[0]["gv"] is None and calls[0]["use_qk_l2norm_in_kernel"] is True
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    assert_close("o (fla recurrent path)", o_ref, o)
    assert_close("final state (fla recurrent path)", ht_ref, ht)
    recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert len(calls) == 1 and len(chunk_calls) == 1


def test_gpu_dispatch_goes_to_fla(monkeypatch):
    """When the backend says fla, the call is forwarded unchanged (cu_seqlens as int64)."""
    calls = fake_fla_gdn(monkeypatch)
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in make_inputs(1, 10, 2, 8, 8, h0=False))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    chunk_gated_delta_rule(q, k, v, g, beta, scale=0.5, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert len(calls) == 1
    kw = calls[0]
    assert kw["scale"] == 0.5 and kw["use_qk_l2norm_in_kernel"] is True
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"].tolist() == [0, 4, 10]


def _bad_cases():
    B, T, H, K, V = 2, 10, 2, 8, 4

    def base():
        gen = torch.Generator().manual_seed(0)
        return dict(
            q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
            v=torch.randn(B, T, H, V, generator=gen), g=-torch.rand(B, T, H, generator=gen),
            beta=torch.rand(B, T, H, generator=gen),
        )

    cases = []

    def case(id_, match, **change):
        cases.append(pytest.param(base, change, match, id=id_))

    case("v-wrong-heads", r"v must be \[B, T, H, V\]", v=torch.randn(B, T, H + 1, V))
    case("k-wrong-dim", r"k must have q's shape", k=torch.randn(B, T, H, K + 1))
    case("g-wrong-shape", r"g must be \[B, T, H\]", g=torch.randn(B, T, H, 1))
    case("beta-head-first", r"beta must be \[B, T, H\]", beta=torch.rand(B, H, T))
    case("q-3d", r"q must be \[B, T, H, K\]", q=torch.randn(B, T, H * K))
    case("q-int", r"q must be a floating-point tensor", q=torch.ones(B, T, H, K, dtype=torch.int64))
    case("state-value-first", r"initial_state must be \[N, H, K, V\] = \[2, 2, 8, 4\]",
         initial_state=torch.zeros(B, H, V, K))
    case("cu-with-batch2", r"batch size must be 1", cu_seqlens=torch.tensor([0, 5, 10]))
    case("scale-negative", r"scale must be positive", scale=-1.0)
    return cases


@pytest.mark.parametrize(("base", "change", "match"), _bad_cases())
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, naive_recurrent_gated_delta_rule],
                         ids=["chunk", "naive"])
def test_bad_input_raises_clear_error(fn, base, change, match):
    args = base()
    args.update(change)
    with pytest.raises(GatedDeltaRuleInputError, match=match):
        fn(**args)


@pytest.mark.parametrize(("cu", "match"), bad_cu_seqlens_cases())
def test_bad_cu_seqlens(cu, match):
    q = torch.randn(1, 10, 2, 4)
    v = torch.randn(1, 10, 2, 4)
    g, beta = -torch.rand(1, 10, 2), torch.rand(1, 10, 2)
    with pytest.raises(GatedDeltaRuleInputError, match=match):
        chunk_gated_delta_rule(q, q, v, g, beta, cu_seqlens=torch.tensor(cu))


def test_initial_state_count_must_match_sequences():
    q = torch.randn(1, 10, 2, 4)
    v = torch.randn(1, 10, 2, 4)
    g, beta = -torch.rand(1, 10, 2), torch.rand(1, 10, 2)
    with pytest.raises(GatedDeltaRuleInputError, match=r"initial_state must be \[N, H, K, V\] = \[2,"):
        chunk_gated_delta_rule(q, q, v, g, beta, cu_seqlens=torch.tensor([0, 3, 10]),
                               initial_state=torch.zeros(1, 2, 4, 4))
