"""Mamba-2 linear block: the SSD scan (chunked vs reference), the mixer (packing, cache, interchange with
transformers' Mamba2Mixer), the attention initialisation and the whole hybrid model with `linear_type: mamba2`.

Numerics run in float64 so the tolerance can be tight: the chunked and recurrent forms are algebraically
equal, so any difference beyond round-off is a bug.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import hylo.kernels.ssd.chunk as ssd_chunk
import hylo.kernels.ssd.recurrent as ssd_recurrent
from hylo.config import HybridConfig, HybridConfigError
from hylo.kernels.ssd import SSDInputError, chunk_ssd, naive_ssd, recurrent_ssd
from hylo.layers.mamba2 import Mamba2Mixer, causal_conv1d_silu
from hylo.upcycle import mamba2_weights_from_attention

from tests.helpers.common import (
    assert_bad_layer_input_raises,
    assert_bf16_close_to_fp32,
    assert_cached_decode_equals_full,
    assert_close,
    assert_every_parameter_gets_a_gradient,
    bad_cu_seqlens_cases,
    bad_layer_input_cases,
    cache_after_prefill_and_step,
    compare_runs,
    forward_backward,
    one_thread,  # noqa: F401 (autouse fixture)
    packed_vs_separate,
)

DT = torch.float64
GRAD_NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dh0")


# ============================================================================ the SSD scan


def make_inputs(B, T, H, G, P, N, *, n_state=None, h0=True, dt_scale=1.0, seed=0, dtype=DT):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, P, generator=gen, dtype=dtype)
    dt = F.softplus(torch.randn(B, T, H, generator=gen, dtype=dtype) - 1.0) * dt_scale
    A = -torch.empty(H, dtype=dtype).uniform_(0.5, 4.0, generator=gen)
    Bm = torch.randn(B, T, G, N, generator=gen, dtype=dtype) / N**0.5
    Cm = torch.randn(B, T, G, N, generator=gen, dtype=dtype)
    D = torch.randn(H, generator=gen, dtype=dtype)
    state = torch.randn(n_state or B, H, P, N, generator=gen, dtype=dtype) if h0 else None
    return [t.requires_grad_() if t is not None else None for t in (x, dt, A, Bm, Cm, D, state)]


def run(fn, x, dt, A, Bm, Cm, D, h0, seed=1, **kw):
    """Forward, then backward of a random projection of (y, final_state); returns values and grads."""
    return forward_backward(fn, (x, dt, A, Bm, Cm, D), h0, seed, **kw)


def compare(ref, got, ratio=1e-10):
    compare_runs(ref, got, "y", GRAD_NAMES, ratio)


SHAPES = [(2, 63, 4, 2, 8, 16), (2, 500, 3, 1, 16, 8), (1, 1000, 2, 2, 8, 8)]


@pytest.mark.parametrize(("B", "T", "H", "G", "P", "N"),
                         [pytest.param(*s, id="B{}-T{}-H{}-G{}-P{}-N{}".format(*s)) for s in SHAPES])
@pytest.mark.parametrize("h0", [False, True], ids=["h0-none", "h0-given"])
def test_chunk_matches_naive(B, T, H, G, P, N, h0):
    inputs = make_inputs(B, T, H, G, P, N, h0=h0)
    compare(run(naive_ssd, *inputs), run(chunk_ssd, *inputs))


@pytest.mark.parametrize(
    "bounds",
    [[0, 37, 300, 500], [0, 1, 65, 130, 131], [0, 64, 128]],
    ids=["uneven-37-263-200", "with-len1", "chunk-aligned"],
)
@pytest.mark.parametrize("h0", [False, True], ids=["h0-none", "h0-given"])
def test_varlen_equals_reference_and_one_by_one(bounds, h0):
    T, H, G, P, N = bounds[-1], 2, 1, 8, 4
    cu = torch.tensor(bounds, dtype=torch.int32)
    S = len(bounds) - 1
    x, dt, A, Bm, Cm, D, state = make_inputs(1, T, H, G, P, N, n_state=S, h0=h0)
    packed = run(chunk_ssd, x, dt, A, Bm, Cm, D, state, cu_seqlens=cu)
    compare(run(naive_ssd, x, dt, A, Bm, Cm, D, state, cu_seqlens=cu), packed)

    # the same sequences, each in its own call, must give the same outputs and final states
    outs, finals = [], []
    for i in range(S):
        s, e = bounds[i], bounds[i + 1]
        h0_i = state[i : i + 1] if state is not None else None
        y_i, ht_i = chunk_ssd(x[:, s:e], dt[:, s:e], A, Bm[:, s:e], Cm[:, s:e], D, initial_state=h0_i,
                              output_final_state=True)
        outs.append(y_i)
        finals.append(ht_i[0])
    assert_close("y vs one-by-one", torch.cat(outs, 1), packed[0])
    assert_close("final_state vs one-by-one", torch.stack(finals, 0), packed[1])


@pytest.mark.parametrize("chunk_size", [1, 16, 50, 64, 200], ids=lambda c: f"C{c}")
def test_chunk_size_does_not_change_result(chunk_size):
    # against the token-by-token recurrence, not the default chunk size: C64 (the default) compared the
    # default with itself and could not fail
    inputs = make_inputs(1, 130, 2, 2, 8, 8)
    compare(run(naive_ssd, *inputs), run(chunk_ssd, *inputs, chunk_size=chunk_size))


def test_strong_decay_stays_finite():
    # log decays down to about -100 per token: exp(gamma) underflows inside a chunk, nothing may overflow
    inputs = make_inputs(1, 150, 2, 1, 8, 8, dt_scale=40.0)
    compare(run(naive_ssd, *inputs), run(chunk_ssd, *inputs))


def test_matches_transformers_mamba2_chunk_scan():
    """transformers' own torch SSD (its mamba_ssm fallback, fp32 inside) agrees."""
    hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    x, dt, A, Bm, Cm, D, h0 = (t.detach() for t in make_inputs(2, 70, 4, 2, 8, 16))
    y_ref, ht_ref = hf.mamba2_chunk_scan(x.float(), dt.float(), A.float(), Bm.float(), Cm.float(), chunk_size=16,
                                         D=D.float(), initial_states=h0.float(), return_final_states=True)
    y, ht = chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True)
    assert_close("y vs transformers", y_ref, y, 1e-5)
    assert_close("final_state vs transformers", ht_ref, ht, 1e-5)


def test_low_precision_inputs_computed_in_fp32():
    x, dt, A, Bm, Cm, D, h0 = (t.detach() for t in make_inputs(1, 90, 2, 2, 16, 16))
    y_ref, ht_ref = chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True)
    lo = [t.to(torch.bfloat16) for t in (x, dt, A, Bm, Cm, D)]
    y, ht = chunk_ssd(*lo, initial_state=h0.float(), output_final_state=True)
    assert y.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_close("y bf16", y_ref, y, 3e-2)
    assert_close("final_state bf16", ht_ref, ht, 3e-2)


def test_single_token_and_no_final_state():
    x, dt, A, Bm, Cm, D, h0 = (t.detach() for t in make_inputs(3, 1, 2, 1, 8, 4))
    y, ht = chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0)
    assert ht is None
    assert_close("y T=1", naive_ssd(x, dt, A, Bm, Cm, D, initial_state=h0)[0], y)


def _fake_fla_simple_gla(calls):
    """A stand-in for fla.ops.simple_gla built on fla's own CPU reference (`naive_chunk_simple_gla`,
    no varlen, [K, V] state): one call per sequence, state transposed for `state_v_first`."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive").naive_chunk_simple_gla

    def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, **kw):
        calls.append(dict(scale=scale, state_v_first=state_v_first, cu_seqlens=cu_seqlens, g_dtype=g.dtype, **kw))
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outs, finals = [], []
        for i in range(len(bounds) - 1):
            s, e = bounds[i], bounds[i + 1]
            for b in range(q.shape[0]):
                h0 = None
                if initial_state is not None:
                    h0 = initial_state[i if cu_seqlens is not None else b][None]
                    h0 = h0.transpose(-1, -2) if state_v_first else h0
                o, ht = naive(q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], g[b : b + 1, s:e],
                              initial_state=None if h0 is None else h0.float().clone(), output_final_state=True,
                              scale=scale)
                outs.append(o)
                finals.append(ht.transpose(-1, -2) if state_v_first else ht)
        o = torch.cat(outs, 1 if cu_seqlens is not None else 0).to(v.dtype)
        return o, torch.cat(finals, 0) if output_final_state else None

    fake = types.ModuleType("fla.ops.simple_gla")
    fake.chunk_simple_gla = chunk_simple_gla
    fake.fused_recurrent_simple_gla = chunk_simple_gla  # the same math: the call site's arguments are checked
    return fake


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("groups", [1, 2])
def test_recurrent_op_matches_naive_forward_and_backward(T, groups):
    """The decode step's torch path: outputs, final state and every gradient equal the reference."""
    inputs = make_inputs(3, T, 4, groups, 8, 16)
    compare(run(naive_ssd, *inputs), run(recurrent_ssd, *inputs))
    y, ht = recurrent_ssd(*(t.detach() for t in inputs[:6]))
    assert ht is None and y.shape == inputs[0].shape


def test_prefill_then_recurrent_steps_equal_one_chunked_pass():
    x, dt, A, Bm, Cm, D, h0 = (t.detach() for t in make_inputs(2, 30, 4, 2, 8, 16))
    y_ref, ht_ref = chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True)
    outs, state = [], h0
    for s, e in [(0, 25)] + [(t, t + 1) for t in range(25, 30)]:
        fn = chunk_ssd if e - s > 1 else recurrent_ssd
        y, state = fn(x[:, s:e], dt[:, s:e], A, Bm[:, s:e], Cm[:, s:e], D, initial_state=state,
                      output_final_state=True)
        outs.append(y)
    assert_close("y prefill + steps", y_ref, torch.cat(outs, 1))
    assert_close("final state prefill + steps", ht_ref, state)


def test_recurrent_gpu_dispatch_to_fla_fused_recurrent_simple_gla(monkeypatch):
    """On the GPU path a decode step goes to fla's `fused_recurrent_simple_gla` (q = C, k = B, v = dt x,
    g = dt A, scale 1, value-first state, + D x) and equals ours."""
    calls = []
    fake = _fake_fla_simple_gla(calls)
    fake.chunk_simple_gla = None  # a decode step must not reach the chunk op
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fake)
    monkeypatch.setattr(ssd_recurrent, "use_fla", lambda x: True)
    x, dt, A, Bm, Cm, D, h0 = (t.detach().float() for t in make_inputs(2, 1, 4, 2, 8, 16))
    y, ht = recurrent_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True)
    assert len(calls) == 1
    assert calls[0]["scale"] == 1.0 and calls[0]["state_v_first"] is True and calls[0]["g_dtype"] == torch.float32
    y_ref, ht_ref = ssd_recurrent.torch_recurrent_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True)
    assert_close("y (fla recurrent path)", y_ref, y, 1e-5)
    assert_close("final_state (fla recurrent path)", ht_ref, ht, 1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_gpu_dispatch_to_fla_simple_gla(monkeypatch, packed):
    """The fla path (q = C, k = B, v = dt x, g = dt A, scale 1, value-first state, + D x) equals ours."""
    calls = []
    fake = _fake_fla_simple_gla(calls)
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", fake)
    monkeypatch.setattr(ssd_chunk, "use_fla", lambda x: True)
    if packed:
        cu = torch.tensor([0, 20, 21, 70], dtype=torch.int32)
        x, dt, A, Bm, Cm, D, h0 = (t.detach().float() for t in make_inputs(1, 70, 4, 2, 8, 16, n_state=3))
    else:
        cu = None
        x, dt, A, Bm, Cm, D, h0 = (t.detach().float() for t in make_inputs(2, 70, 4, 2, 8, 16))
    y, ht = chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert len(calls) == 1
    kw = calls[0]
    assert kw["scale"] == 1.0 and kw["state_v_first"] is True and kw["g_dtype"] == torch.float32
    if packed:
        assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"].tolist() == [0, 20, 21, 70]
    y_ref, ht_ref = ssd_chunk.torch_chunk_ssd(x, dt, A, Bm, Cm, D, initial_state=h0, output_final_state=True,
                                              cu_seqlens=cu)
    assert_close("y (fla path)", y_ref, y, 1e-5)
    assert_close("final_state (fla path)", ht_ref, ht, 1e-5)


def _bad_cases():
    B, T, H, G, P, N = 2, 10, 4, 2, 8, 4

    def base():
        gen = torch.Generator().manual_seed(0)
        return dict(x=torch.randn(B, T, H, P, generator=gen), dt=torch.rand(B, T, H, generator=gen),
                    A=-torch.rand(H, generator=gen), B=torch.randn(B, T, G, N, generator=gen),
                    C=torch.randn(B, T, G, N, generator=gen))

    cases = []

    def case(id_, match, **change):
        cases.append(pytest.param(base, change, match, id=id_))

    case("x-3d", r"x must be \[B, T, H, P\]", x=torch.randn(B, T, H * P))
    case("dt-head-first", r"dt must be \[B, T, H\] = \[2, 10, 4\]", dt=torch.rand(B, H, T))
    case("A-per-channel", r"A must be \[H\] = \[4\]", A=-torch.rand(H, P))
    case("C-other-groups", r"C must have B's shape", C=torch.randn(B, T, 1, N))
    case("groups-not-dividing", r"group count G=3 of B and C must divide the head count H=4",
         B=torch.randn(B, T, 3, N), C=torch.randn(B, T, 3, N))
    case("D-wrong", r"D must be \[H\] = \[4\]", D=torch.ones(H * P))
    case("x-int", r"x must be a floating-point tensor", x=torch.ones(B, T, H, P, dtype=torch.int64))
    case("state-NP-layout", r"initial_state must be \[S, H, P, N\] = \[2, 4, 8, 4\]",
         initial_state=torch.zeros(B, H, N, P))
    case("cu-with-batch2", r"batch size must be 1", cu_seqlens=torch.tensor([0, 5, 10]))
    return cases


@pytest.mark.parametrize(("base", "change", "match"), _bad_cases())
@pytest.mark.parametrize("fn", [chunk_ssd, naive_ssd], ids=["chunk", "naive"])
def test_bad_input_raises_clear_error(fn, base, change, match):
    args = base()
    args.update(change)
    with pytest.raises(SSDInputError, match=match):
        fn(**args)


@pytest.mark.parametrize(("cu", "match"), bad_cu_seqlens_cases())
def test_bad_cu_seqlens(cu, match):
    x, dt, A, Bm, Cm = torch.randn(1, 10, 2, 4), torch.rand(1, 10, 2), -torch.rand(2), *torch.randn(2, 1, 10, 1, 4)
    with pytest.raises(SSDInputError, match=match):
        chunk_ssd(x, dt, A, Bm, Cm, cu_seqlens=torch.tensor(cu))


# ============================================================================ the mixer

D_MODEL, H, P, N, G, CONV = 32, 4, 8, 16, 2, 4


def make_config(**over) -> HybridConfig:
    kw = dict(vocab_size=64, hidden_size=D_MODEL, intermediate_size=64, n_layer=2, mla_layers=[0],
              num_attention_heads=4, num_key_value_heads=2, linear_type="mamba2", mamba2_num_heads=H,
              mamba2_head_dim=P, mamba2_state_size=N, mamba2_n_groups=G, gdn_conv_size=CONV, gdn_chunk_size=16)
    kw.update(over)
    return HybridConfig(**kw)


def make_layer(dtype=DT, seed=0, **over) -> Mamba2Mixer:
    torch.manual_seed(seed)
    layer = Mamba2Mixer(make_config(**over), layer_idx=1).to(dtype)
    # random conv/norm/skip weights so that every tap, the bias, the norm weight and D matter in the checks
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.conv1d.bias.normal_(0, 0.5)
        layer.norm.weight.normal_(1, 0.2)
        layer.D.normal_(1, 0.5)
    return layer


def test_config_derives_mamba2_shape_from_attention_and_validates():
    # SmolLM2-135M: 9 heads, 3 KV heads, head_dim 64 -> 9 heads of 64, state 64, one group per head
    cfg = HybridConfig(linear_type="mamba2")
    assert cfg.mamba2_dims == (9, 64, 64, 9)
    assert make_config().mamba2_dims == (H, P, N, G)
    with pytest.raises(HybridConfigError, match=r"HybridConfig.mamba2_n_groups: 3 must divide the Mamba-2 head count 4"):
        make_config(mamba2_n_groups=3)
    with pytest.raises(HybridConfigError, match=r"HybridConfig.mamba2_state_size: must be a positive integer or null"):
        make_config(mamba2_state_size=0)


def test_conv_matches_torch_conv1d_with_bias():
    """The shift-sum conv equals nn.Conv1d with left padding + bias (mamba_ssm's causal_conv1d convention)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 6, dtype=DT)
    w, b = torch.randn(6, 1, 4, dtype=DT), torch.randn(6, dtype=DT)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w, b, padding=3, groups=6)[..., :9].transpose(1, 2))
    y, tail = causal_conv1d_silu(x, w, b)
    assert_close("conv", ref, y)
    assert torch.equal(tail, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("bounds", [[0, 1, 20, 57], [0, 16, 48], [0, 3, 5, 70]],
                         ids=["docs-1-19-37", "docs-16-32", "docs-3-2-65"])
def test_packed_row_equals_documents_one_by_one(bounds):
    layer = make_layer()
    x, y_packed, y_sep = packed_vs_separate(layer, bounds)
    # gradients too: nothing leaks across a boundary in the backward pass either
    gy = torch.randn_like(y_packed)
    params = list(layer.parameters())
    g_packed = torch.autograd.grad((y_packed * gy).sum(), [x, *params])
    g_sep = torch.autograd.grad((y_sep * gy).sum(), [x, *params])
    for (name, _), a, b in zip([("hidden", None), *layer.named_parameters()], g_sep, g_packed):
        assert_close(f"d {name}", a, b)


@pytest.mark.parametrize("prefill", [1, 2, 7], ids=lambda p: f"prefill{p}")
def test_cached_decode_equals_full_forward(prefill):
    assert_cached_decode_equals_full(make_layer(), prefill)


def _grouped_and_expanded(X: int = 2):
    """A layer with X groups of x/B (Zebra-Llama's d_xb layout, C per head) and the plain layer holding the
    same weights with x/B rows and conv channels repeated to the heads."""
    grouped = make_layer(mamba2_n_groups=H, mamba2_state_size=P, mamba2_xb_groups=X)
    plain = make_layer(mamba2_n_groups=H, mamba2_state_size=P)
    E, r = H * P, H // X
    with torch.no_grad():
        z, x, Bw, Cw, dt = grouped.in_proj.weight.split([E, X * P, X * P, H * P, H])

        def rep(w):  # [X * P, ...] -> [H * P, ...], group j read by heads j*r .. j*r + r - 1
            return w.unflatten(0, (X, P)).repeat_interleave(r, 0).flatten(0, 1)

        cw, cb = grouped.conv1d.weight.split([X * P, X * P, H * P]), grouped.conv1d.bias.split([X * P, X * P, H * P])
        plain.in_proj.weight.copy_(torch.cat([z, rep(x), rep(Bw), Cw, dt]))
        plain.conv1d.weight.copy_(torch.cat([rep(cw[0]), rep(cw[1]), cw[2]]))
        plain.conv1d.bias.copy_(torch.cat([rep(cb[0]), rep(cb[1]), cb[2]]))
        for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
            plain.get_parameter(name).copy_(grouped.get_parameter(name))
    return grouped, plain


def test_grouped_xb_equals_the_layer_with_repeated_rows():
    """x / B in X groups repeated to the heads after the conv = the same rows repeated before it."""
    grouped, plain = _grouped_and_expanded()
    assert grouped.in_proj.weight.shape == (H * P + 2 * 2 * P + H * P + H, D_MODEL)
    assert grouped.conv1d.weight.shape[0] == 2 * 2 * P + H * P
    x = torch.randn(2, 21, D_MODEL, dtype=DT)
    with torch.no_grad():
        assert_close("grouped vs repeated", plain(x), grouped(x))
    # a layout mistake (groups read by heads in turn rather than consecutively) is visible
    with torch.no_grad():
        z, xr, Bw, rest = grouped.in_proj.weight.split([H * P, 2 * P, 2 * P, H * P + H])
        swapped = torch.cat([z, xr.unflatten(0, (2, P)).flip(0).flatten(0, 1), Bw, rest])
        grouped.in_proj.weight.copy_(swapped)
        assert float((plain(x) - grouped(x)).abs().max()) > 1e-3


@pytest.mark.parametrize("prefill", [1, 7], ids=lambda p: f"prefill{p}")
def test_grouped_xb_cached_decode_and_packed_row(prefill):
    grouped, _ = _grouped_and_expanded()
    assert_cached_decode_equals_full(grouped, prefill)
    packed_vs_separate(grouped, [0, 5, 23])


def test_grouped_xb_config_is_validated():
    with pytest.raises(HybridConfigError, match=r"mamba2_xb_groups: must be null .* divisor of the Mamba-2 head count 4"):
        make_config(mamba2_xb_groups=3)


def test_cache_size_is_constant_in_length():
    layer = make_layer(dtype=torch.float32)
    B, Cv = 2, H * P + 2 * G * N
    sizes = []
    for T in (5, 60):
        cache = cache_after_prefill_and_step(layer, B, T)
        sizes.append(sum(t.numel() * t.element_size() for t in cache.tensors()))
        assert tuple(cache.state.shape) == (B, H, P, N) and cache.state.dtype == torch.float32
        assert {k: tuple(v.shape) for k, v in cache.conv.items()} == {"xBC": (B, Cv, CONV - 1)}
    assert sizes[0] == sizes[1] == 4 * B * (H * P * N + Cv * (CONV - 1))


def test_default_init_like_mamba_ssm_and_reset():
    layer = make_layer(dtype=torch.float32, mamba2_num_heads=64, mamba2_n_groups=1)
    A, dt = layer.A_log.exp(), F.softplus(layer.dt_bias)
    assert ((A >= 1) & (A <= 16)).all() and A.std() > 1
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all() and dt.max() / dt.min() > 5
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.D, layer.norm.weight):
            p.zero_()
    layer.reset_special_parameters()
    assert layer.A_log.std() > 0.1 and (F.softplus(layer.dt_bias) <= 0.1 + 1e-7).all()
    assert torch.equal(layer.D, torch.ones(64)) and torch.equal(layer.norm.weight, torch.ones(64 * P))
    assert all(getattr(p, "_no_weight_decay", False) for p in (layer.A_log, layer.dt_bias, layer.D))


def test_every_parameter_gets_a_gradient():
    assert_every_parameter_gets_a_gradient(make_layer(dtype=torch.float32))


def test_bf16_close_to_fp32():
    assert_bf16_close_to_fp32(make_layer(dtype=torch.float32))


@pytest.mark.parametrize(("kwargs", "match"), bad_layer_input_cases(D_MODEL))
def test_bad_input_raises_clear_error_in_layer(kwargs, match):
    assert_bad_layer_input_raises(make_layer(dtype=torch.float32), kwargs, match)


@pytest.fixture(scope="module")
def hf_mixer():
    """transformers' Mamba2Mixer with our shape (its torch path runs on CPU, fp32 inside)."""
    hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from transformers import Mamba2Config

    cfg = Mamba2Config(hidden_size=D_MODEL, num_heads=H, head_dim=P, state_size=N, n_groups=G,
                       expand=H * P // D_MODEL, conv_kernel=CONV, use_conv_bias=True, use_bias=False, chunk_size=16,
                       layer_norm_epsilon=make_config().rms_norm_eps, num_hidden_layers=1)
    torch.manual_seed(5)
    mixer = hf.Mamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        mixer.conv1d.bias.normal_(0, 0.5)
        mixer.norm.weight.normal_(1, 0.2)
        mixer.D.normal_(1, 0.5)
    return mixer, cfg


def test_state_dict_interchanges_with_transformers_mamba2(hf_mixer):
    hf_mixer, hf_cfg = hf_mixer
    ours = make_layer(dtype=torch.float32, seed=3)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf_mixer.state_dict().items()}
    x = torch.randn(2, 37, D_MODEL)
    layer = make_layer(dtype=torch.float32, seed=4)
    layer.load_state_dict(hf_mixer.state_dict(), strict=True)
    with torch.no_grad():
        assert_close("transformers weights in our layer", hf_mixer(x), layer(x), 1e-5)
        theirs = type(hf_mixer)(hf_cfg, layer_idx=0).eval()
        theirs.load_state_dict(ours.state_dict(), strict=True)
        assert_close("our weights in transformers' layer", theirs(x), ours(x), 1e-5)


# ============================================================================ attention init and whole model


def tiny_llama(n_layer: int = 4, seed: int = 0, dtype=DT):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def mamba2_hybrid(dtype=DT, mla="even", **dims):
    from hylo.upcycle import hybrid_config_from_base, upcycle

    base = tiny_llama(dtype=dtype)
    hcfg = hybrid_config_from_base(base.config, mla_layers=mla, kv_lora_rank=32, qk_rope_head_dim=8,
                                   linear_type="mamba2")
    for k, v in dims.items():
        setattr(hcfg, k, v)
    hcfg.validate()
    return base, upcycle(base, hcfg).eval()


def test_attention_copy_is_exact_with_derived_shape():
    base, model = mamba2_hybrid()
    h, g, dh = 4, 2, 16
    assert model.config.mamba2_dims == (h, dh, dh, h)
    for i in model.config.linear_layers:
        attn, mixer = base.model.layers[i].self_attn, model.model.layers[i].mixer
        E, GN = h * dh, h * dh
        z, x, Bw, Cw, dt = mixer.in_proj.weight.detach().split([E, E, GN, GN, h])
        wk, wv = attn.k_proj.weight.view(g, dh, -1), attn.v_proj.weight.view(g, dh, -1)
        # each Mamba head m is query head m: x and B from its KV head (GQA expanded), C from its query
        assert torch.equal(x, wv.repeat_interleave(2, 0).reshape(E, -1))
        assert torch.equal(Bw, wk.repeat_interleave(2, 0).reshape(GN, -1))
        assert torch.equal(Cw, attn.q_proj.weight)
        assert torch.equal(mixer.out_proj.weight, attn.o_proj.weight)
        # z and dt rows keep the default init; the conv starts as identity
        assert 0.01 < float(z.std()) < 0.03 and 0.01 < float(dt.std()) < 0.03
        assert torch.equal(mixer.conv1d.weight[:, 0, :-1], torch.zeros_like(mixer.conv1d.weight[:, 0, :-1]))
        assert torch.equal(mixer.conv1d.weight[:, 0, -1], torch.ones(E + 2 * GN, dtype=DT))
        assert not mixer.conv1d.bias.any()


def test_attention_copy_with_x_and_b_per_kv_head_is_amds_recipe():
    """mamba2_xb_groups = KV heads: x <- W_v and B <- W_k once per KV head (AMD's d_xb rows), C <- W_q; the
    heads of a group read the same x and B, so the layer equals the expanded copy's."""
    base, model = mamba2_hybrid(mamba2_xb_groups=2)
    _, plain = mamba2_hybrid()
    h, dh = 4, 16
    for i in model.config.linear_layers:
        attn, mixer = base.model.layers[i].self_attn, model.model.layers[i].mixer
        z, x, Bw, Cw, dt = mixer.in_proj.weight.detach().split([h * dh, 2 * dh, 2 * dh, h * dh, h])
        assert torch.equal(x, attn.v_proj.weight) and torch.equal(Bw, attn.k_proj.weight)
        assert torch.equal(Cw, attn.q_proj.weight)
        ref = plain.model.layers[i].mixer
        with torch.no_grad():
            # the same z / dt rows in both, then the same outputs
            rz, rx, rB, rC, rdt = ref.in_proj.weight.split([h * dh, h * dh, h * dh, h * dh, h])
            rz.copy_(z)
            rdt.copy_(dt)
            for name in ("dt_bias", "A_log", "D", "norm.weight"):
                ref.get_parameter(name).copy_(mixer.get_parameter(name))
            u = torch.randn(2, 9, 64, dtype=DT)
            assert_close("grouped vs expanded copy", ref(u), mixer(u))


def test_attention_copy_wraps_and_truncates_other_shapes():
    base, model = mamba2_hybrid(mamba2_num_heads=6, mamba2_head_dim=8, mamba2_state_size=24, mamba2_n_groups=3)
    attn, mixer = base.model.layers[1].self_attn, model.model.layers[1].mixer
    w = mamba2_weights_from_attention(attn, model.config)
    assert {k: tuple(v.shape) for k, v in w.items()} == \
        {k: tuple(p.shape) for k, p in mixer.named_parameters() if k in w}
    E, GN = 6 * 8, 3 * 24
    _, x, Bw, Cw, _ = mixer.in_proj.weight.detach().split([E, E, GN, GN, 6])
    wq, wk, wv = (p.weight.view(-1, 16, 64) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    # head 5 wraps to query head 1 (KV head 0); x rows truncated to 8 of 16 dims
    assert torch.equal(x.view(6, 8, 64)[5], wv[0, :8])
    # group 2 starts at head 4 = query head 0; B/C rows zero-padded from 16 to 24 dims
    assert torch.equal(Cw.view(3, 24, 64)[2, :16], wq[0]) and not Cw.view(3, 24, 64)[2, 16:].any()
    assert torch.equal(Bw.view(3, 24, 64)[1, :16], wk[1])
    # query heads 0 and 1 are used twice: their W_o columns are shared (halved) between the two Mamba heads
    wo = attn.o_proj.weight.view(64, 4, 16)
    assert torch.allclose(mixer.out_proj.weight.view(64, 6, 8)[:, 4], wo[:, 0, :8] / 2)
    assert torch.isfinite(model(torch.randint(0, 128, (1, 9))).logits).all()


def test_whole_model_packed_equals_separate_and_cached_equals_full():
    _, model = mamba2_hybrid()
    torch.manual_seed(1)
    # the converted conv is identity: give every tap a weight so the windows' resets and cache matter
    with torch.no_grad():
        for i in model.config.linear_layers:
            model.model.layers[i].mixer.conv1d.weight.normal_(0, 0.5)
            model.model.layers[i].mixer.conv1d.bias.normal_(0, 0.5)
    lens = [5, 17, 1, 9]
    docs = [torch.randint(0, 128, (1, n)) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(0, 128, (2, 14))
    with torch.no_grad():
        out = model(torch.cat(docs, 1), cu_seqlens=cu).logits
        for d, s, e in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            assert_close(f"doc {s}:{e}", model(d).logits, out[:, s:e])
        full = model(ids).logits
        step = model(ids[:, :6], use_cache=True)
        cache, steps = step.past_key_values, [step.logits]
        for t in range(6, 14):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    assert_close("cached decode vs full", full, torch.cat(steps, 1))
    for i in model.config.linear_layers:
        assert tuple(cache[i].state.shape) == (2, 4, 16, 16)


def test_save_load_identical_logits_and_generate(tmp_path):
    from hylo.io import load_hylo, save_hylo

    _, model = mamba2_hybrid(dtype=torch.float32)
    save_hylo(model, tmp_path / "ckpt")
    back = load_hylo(tmp_path / "ckpt").eval()
    assert back.config.linear_type == "mamba2" and back.config.mamba2_dims == model.config.mamba2_dims
    assert type(back.model.layers[1].mixer) is Mamba2Mixer
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    gen = back.generate(ids, max_new_tokens=5, eos_token_id=None)
    with torch.no_grad():
        nxt = back(gen[:, :-1]).logits[:, 9:].argmax(-1)
    assert torch.equal(nxt, gen[:, 10:])


# ============================================================================ SmolLM2 14MLA + 16M2; both stages' jobs


@pytest.mark.slow  # loads the real SmolLM2-135M
def test_smollm2_14mla_16m2_converts_and_every_mamba2_mixer_gets_a_gradient():
    """The real SmolLM2-135M converted with 14 MLA + 16 Mamba-2 layers (`upcycle(..., mla_layers="uniform:14",
    linear_type="mamba2", kv_lora_rank=128, qk_rope_head_dim=32)`, what `model.convert` of a stage config does): a
    forward is finite and one backward reaches every Mamba-2 mixer's projections. Training a Mamba-2 student
    through both stages' jobs: the next test (a tiny base, the same jobs)."""
    from hylo.assets import fetch_asset
    from hylo.upcycle import load_base_model, upcycle

    base_dir = fetch_asset("smollm2-135m-instruct")
    model = upcycle(load_base_model(base_dir), mla_layers="uniform:14", linear_type="mamba2", kv_lora_rank=128,
                    qk_rope_head_dim=32)
    cfg = model.config
    assert len(cfg.mla_layers) == 14 and len(cfg.linear_layers) == 16
    assert all(type(model.model.layers[i].mixer) is Mamba2Mixer for i in cfg.linear_layers)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    out = model(ids, labels=ids)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    for i in cfg.linear_layers:
        mixer = model.model.layers[i].mixer
        for name in ("in_proj", "out_proj"):
            grad = getattr(mixer, name).weight.grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, (i, name)


@pytest.mark.slow  # two torchrun launches of the real jobs
def test_mamba2_student_trains_through_both_stages_jobs(tmp_path):
    """The real jobs (jobs/stage1.py, jobs/stage2.py under torchrun, 2 ranks, ZeRO-3) train a tiny converted Llama
    with 2 MLA + 2 Mamba-2 layers: 3 steps each on synthetic 64-token rows, the loss falls, and each stage writes
    a Mamba-2 HyLo checkpoint whose Mamba-2 mixers changed. (The real SmolLM2 shape: the test above.)

    The same through Ray Train (the demo's launcher), with the conversion done by stage 1 itself:
        python jobs/stage1.py --config configs/demo-smollm2.yaml \\
          --set 'model.convert={mla_layers: "uniform:14", linear_type: mamba2, kv_lora_rank: 128, qk_rope_head_dim: 32}' \\
          --set data.source=synthetic --set data.seq_len=128 --set data.synthetic.vocab_size=49152 \\
          --set data.synthetic.rows=16 --set train.total_steps=4 --set ray.storage_path=/tmp/m2run --set ray.name=m2-stage1
        python jobs/stage2.py --config configs/demo-smollm2.yaml --set model.student=/tmp/m2run/m2-stage1/model \\
          --set data.source=synthetic ... (same data/train overrides) --set ray.name=m2-stage2
    """
    from hylo.io import load_hylo, save_hylo
    from hylo.pipeline.train.metrics import read_metrics
    from hylo.upcycle import load_base_model, upcycle

    from tests.helpers.teacher import save_tiny_llama
    from tests.helpers.train import assert_ok, tiny_config, torchrun, write_config

    base_dir = save_tiny_llama(tmp_path / "base", layers=4)
    model = upcycle(load_base_model(base_dir), mla_layers="uniform:2", linear_type="mamba2", kv_lora_rank=16,
                    qk_rope_head_dim=4)
    assert len(model.config.mla_layers) == 2 and len(model.config.linear_layers) == 2
    save_hylo(model, tmp_path / "converted", tokenizer_from=base_dir)
    del model

    models = {"base": base_dir, "student": tmp_path / "converted"}
    before = load_hylo(tmp_path / "converted")
    for stage in (1, 2):
        if stage == 2:
            models["student"] = tmp_path / "runs" / "stage1" / "model"
        cfg = tiny_config(models, tmp_path / "runs", f"stage{stage}", stage=stage,
                          data={"synthetic": {"rows": 12, "vocab_size": 96, "min_doc_len": 8, "max_doc_len": 48}},
                          optim={"warmup_ratio": 0.0}, train={"global_batch_sequences": 2, "total_steps": 3},
                          metrics={"tensorboard": False})
        assert_ok(torchrun(stage, write_config(cfg, tmp_path / f"stage{stage}.yaml")))
        got = read_metrics(tmp_path / "runs" / f"stage{stage}")
        assert list(got) == [1, 2, 3] and got[3]["loss"] < got[1]["loss"], {s: m["loss"] for s, m in got.items()}
        after = load_hylo(tmp_path / "runs" / f"stage{stage}" / "model")
        assert after.config.linear_type == "mamba2" and after.config.linear_layers == before.config.linear_layers
        i = after.config.linear_layers[0]
        p0, p1 = before.model.layers[i].mixer.in_proj.weight, after.model.layers[i].mixer.in_proj.weight
        assert type(after.model.layers[i].mixer) is Mamba2Mixer and not torch.equal(p0, p1)
        before = after
