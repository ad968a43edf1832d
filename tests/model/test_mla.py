"""MLA layer: packing, latent cache / absorbed decode, RoPE + YaRN against transformers, bad input.

Legend: B batch, T tokens, D hidden, R kv_lora_rank, P qk_rope_head_dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
    yarn_apply_mscale,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from hylo.cache import HyLoCache, MLALayerCache
from hylo.config import HybridConfig
from hylo.layers.mla import MLAInputError, MLAttention
from hylo.layers.norm import RMSNorm
from hylo.layers.rope import RotaryEmbedding, mla_softmax_scale, rope_parameters

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# name -> HybridConfig overrides; V != E both ways exercises the SDPA zero-padding
VARIANTS = {
    "qlora-none": {},
    "qlora-8": {"q_lora_rank": 8},
    "yarn": {"rope_scaling": YARN, "q_lora_rank": 8},
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "bias": {"attention_bias": True},
    "v-gt-e": {"v_head_dim": 24},
    "v-lt-e": {"v_head_dim": 6},
    # AMD's layout: kv_b_proj rows per KV head, read by the query heads of its group
    "kv-b-per-kv": {"kv_b_per_kv_head": True, "num_attention_heads": 4, "num_key_value_heads": 2},
    # Qwen3's per-head q/k RMSNorm: one shared roped key; one block of it per KV group (the converter's GQA
    # layout, a head's norm over its nope dims and its block); and that with kv_b_proj per KV head and YaRN
    "qk-norm": {"mla_qk_norm": True, "q_lora_rank": 8},
    "qk-norm-grouped": {"mla_qk_norm": True, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_key_groups": 2},
    "qk-norm-kv-b-per-kv": {"mla_qk_norm": True, "kv_b_per_kv_head": True, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "rope_key_groups": 2, "rope_scaling": YARN, "v_head_dim": 24},
}
QK_NORM = ["qk-norm", "qk-norm-grouped", "qk-norm-kv-b-per-kv"]


def make_config(**overrides) -> HybridConfig:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=2, mla_layers=[0],
              num_attention_heads=3, num_key_value_heads=1, kv_lora_rank=16, q_lora_rank=None,
              qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12, rope_theta=1000.0,
              max_position_embeddings=128)
    kw.update(overrides)
    return HybridConfig(**kw)


def make_layer(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> MLAttention:
    torch.manual_seed(seed)
    layer = MLAttention(make_config(**overrides), layer_idx=0).to(dtype)
    with torch.no_grad():
        # non-trivial norm weights and biases so a wrong layout or a skipped term shows up
        for m in layer.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
            elif isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.2)
    return layer


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-10) -> None:
    err = (a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)
    assert err < tol, f"relative RMS error {err:.3e} > {tol:.1e}"


# ---------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("explicit_pos", [False, True], ids=["pos-default", "pos-explicit"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_packed_row_equals_documents_one_by_one(variant: str, explicit_pos: bool) -> None:
    layer = make_layer(**VARIANTS[variant])
    lengths = [5, 1, 9, 7]
    T = sum(lengths)
    cu = torch.tensor([0, 5, 6, 15, 22], dtype=torch.int32)
    torch.manual_seed(1)
    x_BTD = torch.randn(1, T, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in lengths])[None] if explicit_pos else None
    out_packed = layer(x_BTD, position_ids=pos, cu_seqlens=cu)
    w = torch.randn_like(out_packed)
    (g_packed,) = torch.autograd.grad((out_packed * w).sum(), x_BTD)

    outs, grads = [], []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        x_doc = x_BTD.detach()[:, s:e].clone().requires_grad_(True)
        out_doc = layer(x_doc)
        (g_doc,) = torch.autograd.grad((out_doc * w[:, s:e]).sum(), x_doc)
        outs.append(out_doc)
        grads.append(g_doc)
    assert_close(out_packed, torch.cat(outs, dim=1))
    assert_close(g_packed, torch.cat(grads, dim=1))


def test_packed_row_differs_from_unpacked_row() -> None:
    # guards the test above: without cu_seqlens the same row must give a different answer
    layer = make_layer()
    torch.manual_seed(1)
    x_BTD = torch.randn(1, 12, 32, dtype=torch.float64)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    diff = (layer(x_BTD, cu_seqlens=cu) - layer(x_BTD))[:, 4:].abs().max()
    assert diff > 1e-3


def test_packed_row_with_padding_document() -> None:
    layer = make_layer(q_lora_rank=8)
    torch.manual_seed(2)
    x_BTD = torch.randn(1, 10, 32, dtype=torch.float64)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    out = layer(x_BTD, cu_seqlens=cu)
    assert_close(out[:, :6], layer(x_BTD[:, :6]))
    assert_close(out[:, 6:], layer(x_BTD[:, 6:]))


# ---------------------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("prefill", [0, 1, 5, 11], ids=lambda p: f"prefill{p}")
@pytest.mark.parametrize("variant", ["qlora-none", "qlora-8", "yarn", "v-lt-e", "kv-b-per-kv", *QK_NORM])
def test_incremental_decode_matches_full_forward(variant: str, prefill: int) -> None:
    layer = make_layer(**VARIANTS[variant])
    B, T = 2, 11
    torch.manual_seed(3)
    x_BTD = torch.randn(B, T, 32, dtype=torch.float64)
    full = layer(x_BTD)

    cache = MLALayerCache()
    outs = [layer(x_BTD[:, :prefill], cache=cache)] if prefill else []
    start = prefill
    # a 3-token chunk on top of a non-empty cache exercises the offset causal mask
    if 0 < start <= T - 3:
        outs.append(layer(x_BTD[:, start:start + 3], cache=cache))
        start += 3
    for t in range(start, T):
        outs.append(layer(x_BTD[:, t:t + 1], cache=cache))
    assert cache.seq_len == T
    assert_close(torch.cat(outs, dim=1), full)


@pytest.mark.parametrize("variant", ["qlora-none", "bias", "v-gt-e", "v-lt-e", "yarn", "kv-b-per-kv", *QK_NORM])
def test_absorbed_latent_path_equals_decompressed_path(variant: str) -> None:
    layer = make_layer(**VARIANTS[variant])
    # with the q/k norm a prompt on an empty cache would take the decompressed path: force the latent one
    layer.decompressed_prefill = False
    torch.manual_seed(4)
    x_BTD = torch.randn(3, 9, 32, dtype=torch.float64)
    pos = torch.randint(0, 100, (3, 9))
    assert_close(layer(x_BTD, position_ids=pos, cache=MLALayerCache()), layer(x_BTD, position_ids=pos))


def test_cache_holds_only_normalised_latent_and_roped_key() -> None:
    layer = make_layer(q_lora_rank=8)
    cfg = layer.config
    R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    B, T = 2, 7
    torch.manual_seed(5)
    x_BTD = torch.randn(B, T, 32, dtype=torch.float64)
    hylo_cache = HyLoCache(cfg, max_length=T)
    cache = hylo_cache[0]
    layer(x_BTD[:, :4], cache=cache)
    for t in range(4, T):
        layer(x_BTD[:, t:t + 1], cache=cache)

    tensors = cache.tensors()
    assert [tuple(t.shape) for t in tensors] == [(B, T, R + P)]  # allocated once: exactly max_length
    values_per_token = sum(t.numel() for t in tensors) // (B * T)
    assert values_per_token == R + P == layer.cache_values_per_token
    assert hylo_cache.nbytes()["mla"] == hylo_cache.nbytes()["mla_used"] == B * T * (R + P) * 8

    # the stored tensors are exactly the normalised latent and the roped shared key
    with torch.no_grad():
        c_kv, k_pe = layer.kv_a_proj_with_mqa(x_BTD).split([R, P], dim=-1)
        cos, sin = layer.rotary_emb(torch.arange(T)[None].expand(B, T), x_BTD.dtype)
        q_dummy = torch.zeros(B, T, 1, P, dtype=x_BTD.dtype)
        _, k_pe_ref = apply_rotary_pos_emb(q_dummy, k_pe[:, :, None], cos, sin, unsqueeze_dim=2)
    assert_close(cache.c_kv, layer.kv_a_layernorm(c_kv), tol=1e-14)
    assert_close(cache.k_pe, k_pe_ref[:, :, 0], tol=1e-14)


def _reference_qk_norm_attention(layer: MLAttention, x_BTD: torch.Tensor) -> torch.Tensor:
    """The q/k-norm layer written from Qwen3's math: every head's full query and key [nope | rope] built
    explicitly, RMS-normalised over the dims of the base head it stands for, weighted, then roped; plain
    causal softmax attention."""
    cfg = layer.config
    B, T, _ = x_BTD.shape
    H, N, P, R, V = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    G, heads = cfg.rope_key_groups, layer.kv_b_heads
    k = P // (2 * G)
    q = layer._query(x_BTD)
    c_kv, k_pe = layer.kv_a_proj_with_mqa(x_BTD).split([R, P], dim=-1)
    kv = layer.kv_b_proj(layer.kv_a_layernorm(c_kv)).view(B, T, heads, N + V).repeat_interleave(H // heads, dim=2)
    key = torch.cat([kv[..., :N], k_pe[:, :, None].expand(B, T, H, P)], dim=-1)
    cos, sin = layer.rotary_emb(torch.arange(T)[None].expand(B, T), x_BTD.dtype)

    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(v)
        for h in range(H):
            blk = h // (H // G)
            dims = [*range(N), *(N + blk * k + j for j in range(k)), *(N + P // 2 + blk * k + j for j in range(k))]
            ms = v[:, :, h, dims].pow(2).mean(-1, keepdim=True)
            out[:, :, h] = w * v[:, :, h] / torch.sqrt(ms + cfg.rms_norm_eps)
        nope, pe = out.split([N, P], dim=-1)
        _, pe = apply_rotary_pos_emb(pe, pe, cos, sin, unsqueeze_dim=2)
        return torch.cat([nope, pe], dim=-1)

    q, key = norm(q, layer.q_norm.weight), norm(key, layer.k_norm.weight)
    scores = torch.einsum("bthe,bshe->bhts", q, key) * layer.softmax_scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", scores.softmax(-1), kv[..., N:])
    return layer.o_proj(o.reshape(B, T, H * V))


@pytest.mark.parametrize("variant", QK_NORM)
def test_qk_norm_follows_qwen3_math_in_both_paths(variant: str) -> None:
    layer = make_layer(**VARIANTS[variant])
    torch.manual_seed(9)
    x_BTD = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        ref = _reference_qk_norm_attention(layer, x_BTD)
        assert_close(layer(x_BTD), ref)
        for layer.decompressed_prefill in (True, False):
            cache = MLALayerCache()
            steps = [layer(x_BTD[:, :4], cache=cache)] + [layer(x_BTD[:, t:t + 1], cache=cache) for t in range(4, 9)]
            assert_close(torch.cat(steps, dim=1), ref)
        # guards: the norms act (a scaled query or key changes nothing but what eps does), their weights count
        plain = make_layer(**{**VARIANTS[variant], "mla_qk_norm": False})
        plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "_norm." not in k or "_a_" in k})
        assert (plain(x_BTD) - ref).abs().max() > 1e-2
        layer.k_norm.weight[0] += 0.5
        assert (layer(x_BTD) - ref).abs().max() > 1e-4
        assert (layer(x_BTD[:, :4], cache=MLALayerCache()) - ref[:, :4]).abs().max() > 1e-4


def test_qk_norm_parameter_names_and_plain_rmsnorm_when_ungrouped() -> None:
    layer = make_layer(**VARIANTS["qk-norm"])
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters() if n.startswith(("q_norm", "k_norm"))}
    assert shapes == {"q_norm.weight": (18,), "k_norm.weight": (18,)}
    assert not any("norm" in n for n, _ in make_layer().named_parameters() if not n.startswith(("q_a_", "kv_a_")))
    # one roped-key block: the per-head norm is RMSNorm over E = nope + rope
    ref = RMSNorm(18, eps=layer.config.rms_norm_eps).double()
    ref.weight.data.copy_(layer.q_norm.weight)
    x = torch.randn(2, 5, 3, 18, dtype=torch.float64)
    assert_close(layer.q_norm(x), ref(x), tol=1e-14)


@pytest.mark.parametrize("variant", QK_NORM)
def test_qk_norm_cache_holds_latent_weighted_roped_key_and_key_inv_rms(variant: str) -> None:
    layer = make_layer(**VARIANTS[variant])
    cfg = layer.config
    R, P, N, G = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, layer.kv_b_heads
    B, T = 2, 7
    torch.manual_seed(5)
    x_BTD = torch.randn(B, T, 32, dtype=torch.float64)
    hylo_cache = HyLoCache(cfg, max_length=T)
    cache = hylo_cache[0]
    with torch.no_grad():
        layer(x_BTD[:, :4], cache=cache)
        for t in range(4, T):
            layer(x_BTD[:, t:t + 1], cache=cache)
        # one key 1/RMS per kv_b head and token, next to the latent and the roped key
        assert [tuple(t.shape) for t in cache.tensors()] == [(B, T, R + P + G)]
        assert layer.cache_values_per_token == R + P + G == cfg.mla_cache_values_per_token()
        assert cfg.kv_cache_values_per_token() == len(cfg.mla_layers) * (R + P + G)
        assert hylo_cache.nbytes()["mla"] == B * T * (R + P + G) * 8
        c_kv, k_pe = layer.kv_a_proj_with_mqa(x_BTD).split([R, P], dim=-1)
        c_kv = layer.kv_a_layernorm(c_kv)
        k_nope = layer.kv_b_proj(c_kv).view(B, T, G, -1)[..., :N]
        H, Gr, k = cfg.num_attention_heads, cfg.rope_key_groups, P // (2 * cfg.rope_key_groups)
        blk = [(g * (H // G)) // (H // Gr) for g in range(G)]  # rope block of each kv_b head
        pe_sq = torch.stack([k_pe[..., b * k:(b + 1) * k].pow(2).sum(-1) + k_pe[..., P // 2 + b * k:P // 2 + (b + 1) * k]
                             .pow(2).sum(-1) for b in blk], dim=-1)
        ms = (k_nope.pow(2).sum(-1) + pe_sq) / (N + P // Gr)
        cos, sin = layer.rotary_emb(torch.arange(T)[None].expand(B, T), x_BTD.dtype)
        w_pe = layer.k_norm.weight[N:]
        _, k_pe_ref = apply_rotary_pos_emb(k_pe[:, :, None], (w_pe * k_pe)[:, :, None], cos, sin, unsqueeze_dim=2)
    assert_close(cache.c_kv, c_kv, tol=1e-14)
    assert_close(cache.k_pe, k_pe_ref[:, :, 0], tol=1e-14)
    assert_close(cache.k_inv_rms, torch.rsqrt(ms + cfg.rms_norm_eps), tol=1e-13)


def test_qk_norm_padded_batch_and_bf16() -> None:
    # a left-padded batch: cached latent path == decompressed path with the same mask, pads never attended
    layer = make_layer(**VARIANTS["qk-norm-grouped"])
    torch.manual_seed(10)
    x_BTD = torch.randn(2, 8, 32, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        full = layer(x_BTD, attention_mask=mask)
        # the prompt through the decompressed prefill, then through the latent path itself, whole and one
        # query row at a time (the score chunking that bounds memory)
        for layer.decompressed_prefill, layer.SCORE_CHUNK_ELEMENTS in ((True, 1 << 24), (False, 1 << 24), (False, 1)):
            cache = MLALayerCache()
            steps = [layer(x_BTD[:, :5], cache=cache, attention_mask=mask[:, :5])]
            steps += [layer(x_BTD[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1]) for t in range(5, 8)]
            assert_close(torch.cat(steps, dim=1)[:, 3:], full[:, 3:])
        assert_close(full[0, 3:], layer(x_BTD[:1, 3:], position_ids=torch.arange(3, 8)[None])[0])
        # bf16 stays close to fp32 on both paths (the norms compute in fp32)
        layer32 = make_layer(dtype=torch.float32, **VARIANTS["qk-norm-kv-b-per-kv"])
        x32 = x_BTD.float()
        ref = layer32(x32)
        layer16 = layer32.to(torch.bfloat16)
        layer16.decompressed_prefill = False
        assert_close(layer16(x32.bfloat16()).float(), ref, tol=3e-2)
        assert_close(layer16(x32.bfloat16(), cache=MLALayerCache()).float(), ref, tol=3e-2)


@pytest.mark.parametrize("variant", ["qlora-8", "kv-b-per-kv"])
def test_decode_step_attends_over_the_latent_cache_as_stored(variant: str, monkeypatch) -> None:
    """A decode step's H heads are H queries of one head over [c_kv | k_pe] as cached: no copy of the cache per
    query head (SDPA's enable_gqa repeats it H times on CPU), and still the decompressed path's result, with
    pads in the batch too."""
    import hylo.layers.mla as mla

    layer = make_layer(**VARIANTS[variant])
    H, X = layer.num_heads, layer.kv_lora_rank + layer.qk_rope_head_dim
    torch.manual_seed(11)
    x_BTD = torch.randn(2, 8, 32, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False
    calls = []
    sdpa = mla.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    with torch.no_grad():
        full = layer(x_BTD, attention_mask=mask)
        cache = MLALayerCache()
        steps = [layer(x_BTD[:, :5], cache=cache, attention_mask=mask[:, :5])]
        monkeypatch.setattr(mla.F, "scaled_dot_product_attention", spy)
        steps += [layer(x_BTD[:, t:t + 1], cache=cache, attention_mask=mask[:, :t + 1]) for t in range(5, 8)]
    assert calls == [((2, 1, H, X), (2, 1, t + 1, X), False) for t in range(5, 8)]
    assert_close(torch.cat(steps, dim=1)[:, 3:], full[:, 3:])


def test_qk_norm_config_checks_the_grouped_layout() -> None:
    from hylo.config import HybridConfigError

    with pytest.raises(HybridConfigError, match="with mla_qk_norm, rope_key_groups=2 must divide"):
        make_config(mla_qk_norm=True, rope_key_groups=2, num_attention_heads=4, num_key_value_heads=1,
                    kv_b_per_kv_head=True)
    assert make_config(rope_key_groups=2, num_attention_heads=4, num_key_value_heads=1, kv_b_per_kv_head=True)


def test_cache_grows_in_place_and_keeps_every_token() -> None:
    # without a length hint the buffer starts at the prefill and grows by half; decode steps in between
    # write in place (same storage), and growth keeps what was cached
    layer = make_layer(q_lora_rank=8)
    torch.manual_seed(8)
    x_BTD = torch.randn(2, 12, 32, dtype=torch.float64)
    cache = MLALayerCache()
    outs = [layer(x_BTD[:, :4], cache=cache)]
    assert cache.capacity == 4
    ptrs, caps = [], []
    for t in range(4, 12):
        outs.append(layer(x_BTD[:, t:t + 1], cache=cache))
        ptrs.append(cache.buf.data_ptr())
        caps.append(cache.capacity)
    assert caps == [6, 6, 9, 9, 9, 13, 13, 13]
    assert ptrs[0] == ptrs[1] and ptrs[2] == ptrs[3] == ptrs[4] and ptrs[1] != ptrs[2]
    assert cache.seq_len == 12 and cache.used_nbytes() == 2 * 12 * cache.buf.shape[2] * 8
    assert_close(torch.cat(outs, dim=1), layer(x_BTD))  # cached decoding == the full causal forward
    exact = MLALayerCache(reserve=12)
    layer(x_BTD[:, :4], cache=exact)
    for t in range(4, 12):
        layer(x_BTD[:, t:t + 1], cache=exact)
    assert torch.equal(exact.c_kv, cache.c_kv) and torch.equal(exact.k_pe, cache.k_pe) and exact.capacity == 12
    # beam reordering moves whole rows
    cache.index_select(torch.tensor([1, 0]))
    assert torch.equal(cache.c_kv[0], exact.c_kv[1])


# ---------------------------------------------------------------------------------------------- kernels
def test_attention_stays_on_fused_sdpa_kernel() -> None:
    # with only the flash backend allowed, any fallback that would build a [T, T] score matrix raises
    layer = make_layer(dtype=torch.float32, v_head_dim=6)
    torch.manual_seed(6)
    x_BTD = torch.randn(1, 40, 32, requires_grad=True)
    cu = torch.tensor([0, 13, 30, 40], dtype=torch.int32)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        layer(x_BTD, cu_seqlens=cu).sum().backward()
        cache = MLALayerCache()
        with torch.no_grad():
            layer(x_BTD[:, :20], cache=cache)
            layer(x_BTD[:, 20:23], cache=cache)
            layer(x_BTD[:, 23:24], cache=cache)
    assert x_BTD.grad is not None and torch.isfinite(x_BTD.grad).all()


def test_bf16_forward_is_close_to_fp32() -> None:
    layer = make_layer(dtype=torch.float32, rope_scaling=YARN)
    torch.manual_seed(7)
    x_BTD = torch.randn(1, 16, 32)
    ref = layer(x_BTD, cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32))
    out = layer.to(torch.bfloat16)(x_BTD.bfloat16(), cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32))
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref, tol=3e-2)


def test_parameter_names_and_shapes_follow_deepseek_v3() -> None:
    layer = make_layer(q_lora_rank=8, attention_bias=True)
    H, E, V, R, P, D = 3, 18, 12, 16, 8, 32
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {
        "q_a_proj.weight": (8, D), "q_a_proj.bias": (8,), "q_a_layernorm.weight": (8,),
        "q_b_proj.weight": (H * E, 8),
        "kv_a_proj_with_mqa.weight": (R + P, D), "kv_a_proj_with_mqa.bias": (R + P,),
        "kv_a_layernorm.weight": (R,), "kv_b_proj.weight": (H * (10 + V), R),
        "o_proj.weight": (D, H * V), "o_proj.bias": (D,),
    }
    plain = {n: tuple(p.shape) for n, p in make_layer().named_parameters()}
    assert plain["q_proj.weight"] == (H * E, D) and "q_proj.bias" not in plain
    assert not any(n.startswith("q_a_") for n in plain)


@pytest.mark.parametrize("variant", ["qlora-none", "yarn", "bias"])
def test_matches_transformers_deepseek_v3_attention(variant: str) -> None:
    # same state dict loaded into HF's DeepSeek-V3 attention (rotate-half RoPE, eager softmax)
    overrides = {**VARIANTS[variant], "rms_norm_eps": 1e-6}
    layer = make_layer(**overrides)
    cfg = layer.config
    rope = {"rope_type": "default"} if not cfg.rope_scaling else dict(cfg.rope_scaling)
    hf_cfg = DeepseekV3Config(
        hidden_size=32, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=16, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=8, qk_nope_head_dim=10, v_head_dim=12, rope_interleave=False,
        attention_bias=cfg.attention_bias, max_position_embeddings=128,
        rope_parameters={**rope, "rope_theta": 1000.0}, attn_implementation="eager")
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).double()
    if cfg.attention_bias and cfg.q_lora_rank is None:
        # DeepSeek keeps q_proj bias-free; ours follows attention_bias, so give HF's q_proj the same bias
        hf.q_proj.bias = torch.nn.Parameter(torch.zeros(hf.q_proj.out_features, dtype=torch.float64))
    hf.load_state_dict(layer.state_dict(), strict=True)
    torch.manual_seed(8)
    x_BTD = torch.randn(2, 9, 32, dtype=torch.float64)
    pos_BT = torch.arange(3, 12)[None].expand(2, 9)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x_BTD, pos_BT)
    mask = torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    ref, _ = hf(x_BTD, (cos, sin), mask)
    assert hf.scaling == pytest.approx(layer.softmax_scale, rel=1e-12)
    # HF's RMSNorm rounds through fp32 even for fp64 inputs, hence the looser tolerance
    assert_close(layer(x_BTD, position_ids=pos_BT), ref, tol=1e-6)


def test_kv_b_per_kv_head_equals_per_query_head_with_repeated_rows() -> None:
    """A per-KV-head kv_b_proj is the per-query-head one whose rows repeat within each GQA group."""
    kw = dict(num_attention_heads=4, num_key_value_heads=2, q_lora_rank=8)
    per_kv = make_layer(seed=3, kv_b_per_kv_head=True, **kw)
    per_q = make_layer(seed=4, **kw)
    assert per_kv.kv_b_proj.weight.shape == (2 * (10 + 12), 16)
    sd = per_kv.state_dict()
    sd["kv_b_proj.weight"] = sd["kv_b_proj.weight"].view(2, 22, 16).repeat_interleave(2, 0).reshape(4 * 22, 16)
    per_q.load_state_dict(sd, strict=True)
    x_BTD = torch.randn(2, 7, 32, dtype=torch.float64)
    assert_close(per_kv(x_BTD), per_q(x_BTD))
    cache_kv, cache_q = MLALayerCache(), MLALayerCache()
    assert_close(per_kv(x_BTD, cache=cache_kv), per_q(x_BTD, cache=cache_q))


def test_construction_on_meta_device_keeps_real_frequencies() -> None:
    cfg = make_config(rope_scaling=YARN)
    with torch.device("meta"):
        layer = MLAttention(cfg, layer_idx=0)
    ref, _ = rope_parameters(8, 1000.0, YARN, 128)
    assert layer.rotary_emb.inv_freq.device.type == "cpu"
    assert torch.equal(layer.rotary_emb.inv_freq, ref)


# ---------------------------------------------------------------------------------------------- rope
def _hf_config(dim: int, base: float, scaling: dict | None, max_pos: int = 4096) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": base} if scaling is None else {**scaling, "rope_theta": base}
    return LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim, rope_parameters=params,
                       max_position_embeddings=max_pos)


ROPE_CASES = {
    "default-d32": (32, 10000.0, None),
    "linear-d16": (16, 500000.0, {"rope_type": "linear", "factor": 4.0}),
    "yarn-d64-f32": (64, 500000.0, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048,
                                    "beta_fast": 32, "beta_slow": 1}),
    "yarn-d32-deepseek": (32, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "yarn-d16-mscale-ratio": (16, 123456.0, {"rope_type": "yarn", "factor": 8.0,
                                             "original_max_position_embeddings": 1024, "beta_fast": 16,
                                             "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "yarn-d32-attn-factor-notrunc": (32, 10000.0, {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.25,
                                                   "original_max_position_embeddings": 512, "truncate": False}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES), ids=list(ROPE_CASES))
def test_rope_frequencies_and_attention_factor_match_transformers(case: str) -> None:
    dim, base, scaling = ROPE_CASES[case]
    hf_cfg = _hf_config(dim, base, scaling)
    rtype = "default" if scaling is None else scaling["rope_type"]
    if rtype == "default":
        hf_inv, hf_factor = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    else:
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rtype](hf_cfg, "cpu")
    inv, factor = rope_parameters(dim, base, scaling, 4096)
    assert torch.equal(inv, hf_inv.float())
    assert factor == pytest.approx(hf_factor, rel=1e-12)

    # cos/sin (with the attention factor folded in) match transformers' rotary module
    pos_BT = torch.tensor([[0, 1, 7, 2047, 60000]])
    cos, sin = RotaryEmbedding(dim, base, scaling, 4096)(pos_BT, torch.float32)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), pos_BT)
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=0)

    # softmax scale follows DeepSeek-V3's rule for the same rope parameters
    ds_params = {"rope_type": rtype, **(scaling or {})}
    assert mla_softmax_scale(48, scaling) == pytest.approx(yarn_apply_mscale(ds_params, 48**-0.5), rel=1e-12)


def test_deepseek_mscale_rule_changes_softmax_scale() -> None:
    # guards the test above: with mscale_all_dim the scale is not the plain 1/sqrt(E)
    m = 0.1 * math.log(40.0) + 1.0
    assert mla_softmax_scale(48, ROPE_CASES["yarn-d32-deepseek"][2]) == pytest.approx(48**-0.5 * m * m)
    assert mla_softmax_scale(48, ROPE_CASES["yarn-d64-f32"][2]) == pytest.approx(48**-0.5)


def test_rope_theta_reproduces_chosen_base_frequency_pairs() -> None:
    # the converter keeps every 2nd pair of a d=64 base head in d_rope=32: theta' = theta ** (32 / 64 * 2)
    base_inv, _ = rope_parameters(64, 10000.0)
    ours, _ = rope_parameters(32, 10000.0 ** (2 * 32 / 64))
    torch.testing.assert_close(ours, base_inv[::2], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- bad input
BAD_INPUTS = {
    "cu-with-batch2": (dict(B=2, T=6, cu=[0, 3, 6]), "one packed row"),
    "cu-last-not-T": (dict(B=1, T=6, cu=[0, 3, 5]), r"cu_seqlens must end at T=6 \(the row's length\), got \[0, 3, 5\]"),
    "cu-first-not-0": (dict(B=1, T=6, cu=[1, 3, 6]), r"cu_seqlens must start at 0"),
    "cu-decreasing": (dict(B=1, T=6, cu=[0, 4, 3, 6]), "strictly increasing"),
    "cu-empty-doc": (dict(B=1, T=6, cu=[0, 3, 3, 6]), r"strictly increasing .*document 1 spans \[3, 3\)"),
    "cu-2d": (dict(B=1, T=6, cu=[[0, 6]]), "1-D"),
    "cu-float": (dict(B=1, T=6, cu=[0.0, 6.0]), "integer"),
    "cu-with-cache": (dict(B=1, T=6, cu=[0, 6], cache=True), "cannot be combined with a cache"),
    "pos-wrong-shape": (dict(B=2, T=6, pos=(2, 5)), r"position_ids must be \[B, T\] = \[2, 6\]"),
    "hidden-wrong-dim": (dict(B=1, T=6, D=31), r"hidden_states must be \[B, T, 32\]"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises_clear_error(case: str) -> None:
    spec, pattern = BAD_INPUTS[case]
    layer = make_layer()
    x_BTD = torch.randn(spec["B"], spec["T"], spec.get("D", 32), dtype=torch.float64)
    cu = torch.tensor(spec["cu"], dtype=torch.float32 if case == "cu-float" else torch.int32) if "cu" in spec else None
    pos = torch.zeros(spec["pos"], dtype=torch.long) if "pos" in spec else None
    cache = MLALayerCache() if spec.get("cache") else None
    with pytest.raises(MLAInputError, match=r"MLAttention\(layer 0\): .*" + pattern):
        layer(x_BTD, position_ids=pos, cu_seqlens=cu, cache=cache)


def test_bad_rope_scaling_raises_clear_error() -> None:
    with pytest.raises(ValueError, match="rope_type 'yarn' needs key 'original_max_position_embeddings'"):
        rope_parameters(16, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_parameters(16, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
