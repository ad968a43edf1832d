"""MLA on packed rows and in decode: memory and time, measured side by side in one run.

Packed row (fwd + bwd, fp32, one layer, SmolLM2-like shapes): our per-document causal SDPA against a
dense block-diagonal [T, T] mask passed to one SDPA call (what a naive packed implementation does).
Each variant runs in its own subprocess; "extra peak" is the child's peak RSS growth during fwd+bwd.
Decode: the latent cache (c_kv + k_pe) against the decompressed K/V a standard cache would hold, from
the real cache tensors, and the median time per decoded token of the absorbed latent path (our
preallocated cache) against (a) the same path with the cache appended by torch.cat (what HyLoCache did
before: three copies of the whole cache per step) and (b) decompressing the whole cached latent into K/V
at every step.

    python bench/mla_packed.py [--T 4096] [--docs 8] [--decode-ctx 2048] [--decode-only]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.cache import MLALayerCache  # noqa: E402
from hylo.config import HybridConfig  # noqa: E402
from hylo.layers.mla import MLAttention  # noqa: E402
from hylo.layers.rope import apply_rotary  # noqa: E402


def make_layer() -> MLAttention:
    # SmolLM2-135M: D 576, 9 heads of 64 -> d_nope 32 + d_rope 32, d_v 64, r_kv 128
    cfg = HybridConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, n_layer=1, mla_layers=[0],
                       kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32,
                       v_head_dim=64, max_position_embeddings=65536)
    torch.manual_seed(0)
    return MLAttention(cfg, layer_idx=0)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dense_mask_forward(layer: MLAttention, x_BTD: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Same math as the layer, but one SDPA call with a block-diagonal causal [T, T] mask."""
    B, T, _ = x_BTD.shape
    N, P, R, H, V = (layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank, layer.num_heads,
                     layer.v_head_dim)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])[None]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    mask_TT = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()

    q_nope, q_pe = layer._query(x_BTD).split([N, P], dim=-1)
    c_kv, k_pe = layer.kv_a_proj_with_mqa(x_BTD).split([R, P], dim=-1)
    cos, sin = layer.rotary_emb(pos, x_BTD.dtype)
    q_pe = apply_rotary(q_pe, cos[:, :, None], sin[:, :, None])
    k_pe = apply_rotary(k_pe, cos, sin)
    k_nope, v = layer.kv_b_proj(layer.kv_a_layernorm(c_kv)).view(B, T, H, N + V).split([N, V], dim=-1)
    q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
    k = torch.cat([k_nope, k_pe[:, :, None].expand(B, T, H, P)], -1).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), attn_mask=mask_TT, scale=layer.softmax_scale)
    return layer.o_proj(o.transpose(1, 2).reshape(B, T, H * V))


def child(variant: str, T: int, docs: int) -> None:
    torch.set_num_threads(2)
    layer = make_layer()
    bounds = torch.linspace(0, T, docs + 1).round().long().tolist()
    cu_t = torch.tensor(bounds, dtype=torch.int32)
    torch.manual_seed(1)
    x = torch.randn(1, T, 576, requires_grad=True)
    # warm-up on a short row so allocator/threads are set before the baseline
    layer(x[:, :64].detach()).sum().backward()
    base = peak_rss_mib()
    t0 = time.perf_counter()
    out = layer(x, cu_seqlens=cu_t) if variant == "per-doc" else dense_mask_forward(layer, x, bounds)
    out.square().mean().backward()
    dt = time.perf_counter() - t0
    print(json.dumps({"variant": variant, "extra_peak_mib": peak_rss_mib() - base, "seconds": dt,
                      "checksum": float(out.double().square().mean())}))


def rebuild_kv_step(layer: MLAttention, x_B1D: torch.Tensor, cache: MLALayerCache) -> torch.Tensor:
    """Decode one token by decompressing the whole cached latent into K/V (what absorption avoids)."""
    N, P, R, H, V = (layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank, layer.num_heads,
                     layer.v_head_dim)

    pos = torch.tensor([[cache.seq_len]])
    q_nope, q_pe = layer._query(x_B1D).split([N, P], dim=-1)
    c_kv, k_pe = layer.kv_a_proj_with_mqa(x_B1D).split([R, P], dim=-1)
    cos, sin = layer.rotary_emb(pos, x_B1D.dtype)
    q_pe, k_pe = apply_rotary(q_pe, cos[:, :, None], sin[:, :, None]), apply_rotary(k_pe, cos, sin)
    kv_all = cache.update(layer.kv_a_layernorm(c_kv), k_pe)
    c_all, kpe_all = kv_all[..., :R], kv_all[..., R:]
    S = c_all.shape[1]
    k_nope, v = layer.kv_b_proj(c_all).view(1, S, H, N + V).split([N, V], dim=-1)
    q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
    k = torch.cat([k_nope, kpe_all[:, :, None].expand(1, S, H, P)], -1).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), scale=layer.softmax_scale)
    return layer.o_proj(o.transpose(1, 2).reshape(1, 1, H * V))


class ConcatCache(MLALayerCache):
    """The cache as it was: c_kv and k_pe appended with torch.cat, then concatenated for attention."""

    def update(self, c_kv_BTR: torch.Tensor, k_pe_BTP: torch.Tensor) -> torch.Tensor:
        if self.length == 0:
            self.parts = [c_kv_BTR, k_pe_BTP]
        else:
            self.parts = [torch.cat([self.parts[0], c_kv_BTR], 1), torch.cat([self.parts[1], k_pe_BTP], 1)]
        self.length = self.parts[0].shape[1]
        return torch.cat(self.parts, dim=-1)


def decode(ctx: int, steps: int = 32) -> dict:
    torch.set_num_threads(2)
    layer = make_layer()
    x = torch.randn(1, ctx + steps, 576)
    caches = {"absorbed": MLALayerCache(), "absorbed-cat": ConcatCache(), "rebuild-kv": MLALayerCache()}
    seconds: dict[str, list[float]] = {k: [] for k in caches}
    max_diff = 0.0
    with torch.no_grad():
        for c in caches.values():
            layer(x[:, :ctx], cache=c)
        # interleave the two paths step by step so machine noise hits both alike
        for t in range(ctx, ctx + steps):
            for name, c in caches.items():
                t0 = time.perf_counter()
                out = rebuild_kv_step(layer, x[:, t:t + 1], c) if name == "rebuild-kv" else layer(x[:, t:t + 1], cache=c)
                seconds[name].append(time.perf_counter() - t0)
                if name == "absorbed":
                    ref = out
                max_diff = max(max_diff, float((out - ref).abs().max()))
    cache = caches["absorbed"]
    latent = cache.used_nbytes() // cache.seq_len
    full = layer.num_heads * (layer.qk_head_dim + layer.v_head_dim) * 4
    return {"cache_bytes_per_token_latent": latent, "cache_bytes_per_token_decompressed_kv": full,
            "ratio": latent / full, "context": ctx, "max_diff": max_diff,
            # median: other processes share the cores, and their bursts land on single steps
            **{f"{k}_ms_per_token": statistics.median(v) * 1e3 for k, v in seconds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--decode-ctx", type=int, default=2048)
    ap.add_argument("--decode-only", action="store_true", help="skip the packed-row part")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.T, a.docs)
        return
    if not a.decode_only:
        packed(a)
    report_decode(a.decode_ctx)


def packed(a: argparse.Namespace) -> None:
    rows = []
    for variant in ("per-doc", "dense-mask"):
        r = subprocess.run([sys.executable, __file__, "--child", variant, "--T", str(a.T), "--docs", str(a.docs)],
                           capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    per_doc, dense = rows
    print(f"packed row T={a.T}, {a.docs} docs, fwd+bwd, fp32, one MLA layer (D 576, 9 heads)")
    for r in rows:
        print(f"  {r['variant']:<11} extra peak {r['extra_peak_mib']:8.1f} MiB   {r['seconds']:6.2f} s")
    print(f"  same output: {abs(per_doc['checksum'] - dense['checksum']) / dense['checksum']:.2e} relative;"
          f" memory ratio dense/per-doc {dense['extra_peak_mib'] / max(per_doc['extra_peak_mib'], 1e-9):.1f}x,"
          f" time ratio {dense['seconds'] / per_doc['seconds']:.2f}x")


def report_decode(ctx: int) -> None:
    d = decode(ctx)
    print(f"decode after {d['context']} tokens: cache {d['cache_bytes_per_token_latent']} B/token (latent) vs "
          f"{d['cache_bytes_per_token_decompressed_kv']} B/token (decompressed K/V) = {d['ratio']:.3f}")
    ab = d["absorbed_ms_per_token"]
    print(f"  ms/token: absorbed {ab:.2f}, absorbed with a torch.cat cache {d['absorbed-cat_ms_per_token']:.2f} "
          f"({d['absorbed-cat_ms_per_token'] / ab:.2f}x), rebuilding K/V {d['rebuild-kv_ms_per_token']:.2f} "
          f"({d['rebuild-kv_ms_per_token'] / ab:.2f}x); max |diff| {d['max_diff']:.1e}")


if __name__ == "__main__":
    main()
