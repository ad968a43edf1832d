"""The MLA latent widened to a width vLLM takes (hylo/serving/widen.py), checked against our own MLA in fp64: the
widened layer's outputs equal the native layer's, with and without a cache. No vLLM needed."""

from __future__ import annotations

import pytest
import torch

from hylo.cache import MLALayerCache
from hylo.config import HybridConfig
from hylo.layers.mla import MLAttention
from hylo.layers.rope import RotaryEmbedding, apply_rotary
from hylo.serving.widen import (
    ServedMLA,
    ServingShapeError,
    check_servable,
    rotate_native_dims,
    served_bytes_per_token,
    served_mla,
    widen_kv_a,
    widen_kv_b,
    widen_latent_norm,
    widen_query,
)
from hylo.serving.widths import CPU_WIDTHS, GPU_WIDTHS

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0}


def tiny(**kw) -> HybridConfig:
    base = dict(vocab_size=64, hidden_size=48, intermediate_size=64, n_layer=2, mla_layers=[0], num_attention_heads=4,
                num_key_value_heads=2, kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                gdn_num_heads=2, gdn_head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5)
    return HybridConfig(**{**base, **kw})


def run(mla: MLAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole-prompt output without a cache, prefill + one-token decode steps through the latent cache)."""
    whole = mla(x)
    cache = MLALayerCache()
    steps = [mla(x[:, :5], cache=cache)] + [mla(x[:, t:t + 1], cache=cache) for t in range(5, x.shape[1])]
    return whole, torch.cat(steps, dim=1)


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": 16, "rope_parameters": YARN}, {"kv_b_per_kv_head": True},
                                {"mla_latent_norm": False, "attention_bias": True}, {"rope_key_groups": 2}],
                         ids=["plain", "qlora-yarn", "kv_b-per-kv-head", "no-norm-bias", "rope-key-groups"])
def test_a_widened_latent_gives_the_native_outputs(kw):
    torch.manual_seed(0)
    cfg = tiny(**kw)
    native = MLAttention(cfg, 0).double()
    with torch.no_grad():
        for name, p in native.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    s = ServedMLA(cfg.kv_lora_rank, cfg.qk_rope_head_dim, 4 * cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    weight, eps = (widen_latent_norm(native.kv_a_layernorm.weight.data, cfg.latent_norm_eps, s)
                   if cfg.mla_latent_norm else (None, cfg.latent_norm_eps))
    wide_cfg = tiny(**{**kw, "kv_lora_rank": s.served_rank, "mla_latent_norm_eps": eps, "kv_b_per_kv_head": False})
    wide = MLAttention(wide_cfg, 0).double()
    if cfg.q_lora_rank is not None and cfg.mla_latent_norm:
        # only the kv latent is widened: the query latent's norm keeps the native eps (as the served layer does)
        wide.q_a_layernorm.eps = cfg.latent_norm_eps
    sd = {k: v.clone() for k, v in native.state_dict().items()}
    sd["kv_a_proj_with_mqa.weight"] = widen_kv_a(sd["kv_a_proj_with_mqa.weight"], s)
    if "kv_a_proj_with_mqa.bias" in sd:
        sd["kv_a_proj_with_mqa.bias"] = widen_kv_a(sd["kv_a_proj_with_mqa.bias"], s)
    sd["kv_b_proj.weight"] = widen_kv_b(sd["kv_b_proj.weight"], cfg, s)
    if weight is not None:
        sd["kv_a_layernorm.weight"] = weight
    wide.load_state_dict(sd, strict=True)
    x = torch.randn(2, 11, cfg.hidden_size, dtype=torch.float64)
    for a, b in zip(run(native, x), run(wide, x), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_widened_rope_part_gives_the_native_scores(groups):
    torch.manual_seed(0)
    P, H, T = 8, 3, 20
    q_pe, k_pe = torch.randn(T, H, P, dtype=torch.float64), torch.randn(T, 1, P, dtype=torch.float64)
    rope = RotaryEmbedding(P, 10000.0, YARN, 256, groups=groups)
    cos, sin = (t[0].unsqueeze(1) for t in rope(torch.arange(T).unsqueeze(0), torch.float64))
    native = torch.einsum("thp,shp->hts", apply_rotary(q_pe, cos, sin), apply_rotary(k_pe, cos, sin).expand(T, H, P))
    pad = torch.nn.functional.pad
    q_wide, k_wide = (rotate_native_dims(pad(t, (0, 64 - P)), cos, sin, P) for t in (q_pe, k_pe))
    served = torch.einsum("thp,shp->hts", q_wide, k_wide.expand(T, H, 64))
    torch.testing.assert_close(served, native, rtol=1e-12, atol=1e-12)
    # the query rows of a head: [nope | rope | zeros]
    cfg = tiny()
    s = ServedMLA(cfg.kv_lora_rank, P, 512, 64)
    w = torch.randn(cfg.num_attention_heads * (cfg.qk_nope_head_dim + P), 5)
    wide = widen_query(w, cfg, s).view(cfg.num_attention_heads, -1, 5)
    assert wide.shape[1] == cfg.qk_nope_head_dim + 64
    assert torch.equal(wide[:, :cfg.qk_nope_head_dim + P], w.view(cfg.num_attention_heads, -1, 5))
    assert not wide[:, cfg.qk_nope_head_dim + P:].any()


@pytest.mark.parametrize(("rank", "rope", "widths", "served"), [
    (128, 32, GPU_WIDTHS, (256, 64)),  # Llama-3.2-1B recipe on a GPU: 320
    (128, 32, CPU_WIDTHS, (512, 64)),
    (128, 64, GPU_WIDTHS, (256, 64)),  # Llama-3.2-3B recipe
    (256, 48, GPU_WIDTHS, (256, 64)),  # the demo's SmolLM2 hybrid
    (256, 64, GPU_WIDTHS, (256, 64)),  # already a width vLLM takes: unchanged
    (512, 64, CPU_WIDTHS, (512, 64)),
    (64, 16, (), (64, 16)),            # a backend that takes any width
])
def test_the_narrowest_accepted_width_is_served(rank, rope, widths, served):
    s = served_mla(tiny(kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=8), widths)
    assert (s.served_rank, s.served_rope) == served
    assert s.served_width in widths or not widths


def test_what_cannot_be_served_exactly_is_refused_by_name():
    with pytest.raises(ServingShapeError, match="mla_qk_norm"):
        check_servable(tiny(mla_qk_norm=True))
    with pytest.raises(ServingShapeError, match="takes widths \\[576\\] only"):
        served_mla(tiny(kv_lora_rank=1024, qk_rope_head_dim=8), CPU_WIDTHS)


def test_kv_bytes_per_token_native_and_served():
    cfg = tiny(n_layer=4, mla_layers=[0, 2], kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=8)
    s = served_mla(cfg, GPU_WIDTHS)
    assert served_bytes_per_token(cfg, s) == (2 * 160 * 2, 2 * 320 * 2)
