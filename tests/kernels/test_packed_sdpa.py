"""Block-diagonal causal SDPA over a packed row (kernels/packed_sdpa.py): the grouped (batched, end-padded)
path against the per-document loop it replaces, and the MLA layer on both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo.kernels import packed_sdpa
from hylo.kernels.packed_sdpa import packed_causal_sdpa, packed_causal_sdpa_loop, plan_groups

# awkward packings: equal lengths, a long document among short ones, lengths 1, all different
PACKINGS = {
    "equal8x16": [0, *range(16, 129, 16)],
    "long-and-short": [0, 100, 105, 111, 118, 120, 127],
    "ones": [0, 1, 2, 3, 40, 41],
    "ragged": [0, 63, 125, 130, 500, 531, 1000],
}


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((got.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


@pytest.mark.parametrize("name", list(PACKINGS))
def test_grouped_equals_the_per_document_loop_with_gradients(name):
    cu = tuple(PACKINGS[name])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, cu[-1], 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dy = torch.randn(1, 3, cu[-1], 8, generator=g, dtype=torch.float64)
    outs = {}
    for impl in ("loop", "grouped"):
        with packed_sdpa.implementation(impl):
            y = packed_causal_sdpa(q, k, v, cu, scale=0.3)
        grads = torch.autograd.grad(y, (q, k, v), dy)
        outs[impl] = (y, *grads)
    for name_, r, o in zip(("out", "dq", "dk", "dv"), outs["loop"], outs["grouped"]):
        assert rel(r, o) < 1e-12, name_


def test_documents_never_see_each_other():
    # a value change in document 0 leaves every other document's output unchanged
    cu = tuple(PACKINGS["equal8x16"])
    q, k, v = (torch.randn(1, 2, cu[-1], 4, dtype=torch.float64) for _ in range(3))
    y = packed_causal_sdpa(q, k, v, cu)
    v2 = v.clone()
    v2[:, :, : cu[1]] += 5.0
    y2 = packed_causal_sdpa(q, k, v2, cu)
    assert torch.equal(y[:, :, cu[1]:], y2[:, :, cu[1]:]) and not torch.allclose(y[:, :, : cu[1]], y2[:, :, : cu[1]])


@pytest.mark.parametrize("name", list(PACKINGS))
def test_the_plan_covers_every_document_once_within_the_padding_bound(name):
    cu = tuple(PACKINGS[name])
    groups = plan_groups(cu)
    docs = sorted(d for _, ds in groups for d in ds)
    assert docs == list(range(len(cu) - 1))
    for L, ds in groups:
        lengths = [cu[d + 1] - cu[d] for d in ds]
        assert L == max(lengths)
        assert len(ds) * L * L <= (1 + packed_sdpa.SLACK) * sum(x * x for x in lengths) + 1e-9


def test_equal_documents_take_one_sdpa_call(monkeypatch):
    # 8 documents of one length: one batched call instead of eight
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(packed_sdpa.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    cu = tuple(PACKINGS["equal8x16"])
    q = torch.randn(1, 2, cu[-1], 4)
    packed_causal_sdpa(q, q, q, cu)
    assert calls == [torch.Size([8, 2, 16, 4])]
    calls.clear()
    packed_causal_sdpa_loop(q, q, q, cu)
    assert len(calls) == 8


def test_mla_layer_is_the_same_on_both_paths():
    from hylo.config import HybridConfig
    from hylo.layers.mla import MLAttention

    cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=2, mla_layers=[0],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    layer = MLAttention(cfg, 0).double()
    cu = torch.tensor(PACKINGS["long-and-short"], dtype=torch.int32)
    x = torch.randn(1, int(cu[-1]), 32, dtype=torch.float64, requires_grad=True)
    out = {}
    for impl in ("loop", "grouped"):
        with packed_sdpa.implementation(impl):
            y = layer(x, cu_seqlens=cu)
        out[impl] = (y, *torch.autograd.grad(y.square().sum(), [x, layer.kv_b_proj.weight]))
    for r, o in zip(out["loop"], out["grouped"]):
        assert rel(r, o) < 1e-12
