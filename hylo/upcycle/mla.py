"""MLA from one attention layer by SVD (X-EcoMLA).

Legend: H query heads, G KV heads, K base head dim, D hidden size, Pn nope dims, Pr rope dims (both per
head), dv value head dim, R kv_lora_rank, Rq q_lora_rank.

Design choices:
* Queries are kept whole (`q_lora_rank: null`, exact) or factored by a truncated SVD; the nope-keys and
  values of all KV heads are stacked and factored by ONE joint SVD into `kv_a_proj_with_mqa` (latent rows)
  and `kv_b_proj` (per-head nope-key and value rows, GQA groups expanded to the query heads, or per KV
  head with `kv_b_per_kv_head`).
* RoPE keys: MLA shares one roped key across heads, but GQA key heads disagree, and averaging their RoPE
  rows wrecks the attention pattern (measured on SmolLM2: attention probabilities off by up to 0.75).
  We give the shared key one block per KV group (`rope_key_groups = G`, each block with the group's own
  highest-frequency pairs and frequency ladder), each query head reading only its group's block: exact for
  the kept pairs, at the same cache cost `kv_lora_rank + qk_rope_head_dim`. `rope_key_groups = 1` keeps a
  single block fitted by a complex rank-1 SVD per pair.
* MLA scales scores by 1/sqrt(Pn + Pr), the base by 1/sqrt(K): the queries absorb the ratio.
* Qwen3's q/k RMSNorms (`mla_qk_norm`, set by the converter for a Qwen3 base): the rows stay raw and the
  norms become the layer's `q_norm` / `k_norm`, their weights laid out as the rows are (per head [nope |
  rope], the rope dims in the shared key's block layout); the query's score-scale ratio moves into
  `q_norm`'s weight (a norm undoes any scale of its input). With one block per KV group a head's norm runs
  over its nope dims and its group's block, i.e. exactly the base head's dims: the layer IS the base
  attention at full rank with every RoPE pair kept. With one shared key (`rope_key_groups = 1`) and GQA the
  rank-1 fit of the rope rows is approximate as without norms (its complex factors are normalised to unit
  RMS so the key's RMS stays that of the base key; exact for a single KV head).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from hylo.upcycle.attention import attention_weights, fit_rows, qk_norm_weights
from hylo.upcycle.options import UpcycleError

if TYPE_CHECKING:
    from hylo.config import HybridConfig


def rope_dim_split(dh: int, d_rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nope_idx, rope_idx) into a rotate-half head of size dh; rope keeps the d_rope/2 highest-freq pairs."""
    half = dh // 2
    pairs = torch.arange(d_rope // 2)
    rope_idx = torch.cat([pairs, pairs + half])
    mask = torch.ones(dh, dtype=torch.bool)
    mask[rope_idx] = False
    nope_idx = torch.arange(dh)[mask]
    return nope_idx, rope_idx



def shared_rope_key(wk_rope_GPD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One roped key shared by all KV heads: per RoPE pair, the best complex rank-1 fit.

    In rotate-half layout pair j of a head is the complex number z_j = x_j + i x_{j+P/2}; RoPE multiplies
    it by e^{i theta_j t}. Writing each KV head's key rows for pair j as a complex row c_gj and fitting
    c_gj ~= a_gj s_j (SVD), the shared key is s_j and the complex factors a_gj [G, P/2] go to the queries
    (`absorb_rope_factors`). When heads agree up to a complex scale this is exact; plain averaging is
    the special case a_gj = 1.
    """
    g, p, d = wk_rope_GPD.shape
    half = p // 2
    c = torch.complex(wk_rope_GPD[:, :half], wk_rope_GPD[:, half:])  # [G, P/2, D]
    k_pe = torch.empty(p, d, dtype=wk_rope_GPD.dtype)
    a = torch.empty(g, half, dtype=c.dtype)
    for j in range(half):
        u, sv, vh = torch.linalg.svd(c[:, j], full_matrices=False)
        a[:, j] = u[:, 0] * sv[0]
        k_pe[j], k_pe[half + j] = vh[0].real, vh[0].imag
    return k_pe, a


def unit_rms_factors(k_pe_PD: torch.Tensor, a_GJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale a rank-1 fit `c_gj ~= a_gj s_j` so that each pair's factors have RMS 1 over the heads and a
    positive real sum: then |s_j| is the heads' typical |c_gj| (a q/k norm sees the base key's RMS), and with
    one KV head a == 1 and s == c exactly."""
    half = a_GJ.shape[1]
    total = a_GJ.sum(0)
    phase = torch.where(total.abs() > 0, total / total.abs().clamp_min(1e-300), torch.ones_like(total))
    lam = a_GJ.abs().pow(2).mean(0).sqrt().clamp_min(1e-300) * phase  # [J] complex
    s = torch.complex(k_pe_PD[:half], k_pe_PD[half:]) * lam.unsqueeze(-1)
    return torch.cat([s.real, s.imag], dim=0), a_GJ / lam


def qk_norm_layout(w_K: torch.Tensor, nope_idx: torch.Tensor, rope_idx: torch.Tensor, groups: int) -> torch.Tensor:
    """A base q/k norm weight [K] laid out as an MLA head's [nope | rope] with `groups` rope blocks [E]:
    nope dims, then the rope reals of every block, then their imaginaries (each block a copy: one weight
    is shared by all base heads)."""
    k = rope_idx.numel() // 2
    return torch.cat([w_K[nope_idx], w_K[rope_idx[:k]].repeat(groups), w_K[rope_idx[k:]].repeat(groups)])


def absorb_rope_factors(wq_rope_HPD: torch.Tensor, a_HJ: torch.Tensor) -> torch.Tensor:
    """Query rope rows whose pairs are multiplied by conj(a): q.conj(a s) == (conj(a) q).conj(s)."""
    half = wq_rope_HPD.shape[1] // 2
    q = torch.complex(wq_rope_HPD[:, :half], wq_rope_HPD[:, half:]) * a_HJ.conj().unsqueeze(-1)
    return torch.cat([q.real, q.imag], dim=1)


@torch.no_grad()
def mla_weights_from_attention(attn: nn.Module, hcfg: HybridConfig) -> dict[str, torch.Tensor]:
    """SVD initialisation of one MLA layer from a Llama/Qwen3 attention module (float64 SVD)."""
    qk_norm = bool(getattr(hcfg, "mla_qk_norm", False))
    w_qn, w_kn = qk_norm_weights(attn)
    if qk_norm and (w_qn is None or w_kn is None):
        raise UpcycleError("mla_qk_norm is set but the base attention has no q_norm / k_norm (only Qwen3 bases have "
                           "them); convert without mla_qk_norm")
    # with mla_qk_norm the norms are kept as the layer's own, so their weights are not folded into the rows
    w = attention_weights(attn, hcfg, fold_qk_norm=not qk_norm)
    h, g, dh, d = w.heads
    group = w.group
    wq, wk, wv = w.q_HKD, w.k_GKD, w.v_GKD
    d_rope, d_nope, dv, r = hcfg.qk_rope_head_dim, hcfg.qk_nope_head_dim, hcfg.v_head_dim, hcfg.kv_lora_rank
    groups = getattr(hcfg, "rope_key_groups", 1)
    nope_idx, rope_idx = rope_dim_split(dh, d_rope // groups)
    out: dict[str, torch.Tensor] = {}
    if groups == g and g > 1:
        # one block of k_pe per KV group, exact; each query head's rope part sits in its group's block
        half, k = d_rope // 2, d_rope // (2 * g)
        wk_r = wk[:, rope_idx]  # [G, 2k, D]: real parts (first k), imaginary parts (last k)
        k_pe = torch.cat([wk_r[:, :k].reshape(g * k, d), wk_r[:, k:].reshape(g * k, d)], dim=0)
        wq_r = wq[:, rope_idx]
        q_rope = wq.new_zeros(h, d_rope, d)
        for head in range(h):
            blk = head // group
            q_rope[head, blk * k : (blk + 1) * k] = wq_r[head, :k]
            q_rope[head, half + blk * k : half + (blk + 1) * k] = wq_r[head, k:]
    elif groups == 1:
        # one key shared by all groups: best complex rank-1 fit per RoPE pair; each head's query pair
        # absorbs its group's complex factor (a complex scale commutes with the RoPE rotation)
        k_pe, a_GJ = shared_rope_key(wk[:, rope_idx])
        if qk_norm:
            k_pe, a_GJ = unit_rms_factors(k_pe, a_GJ)
        q_rope = absorb_rope_factors(wq[:, rope_idx], a_GJ.repeat_interleave(group, dim=0))
    else:
        raise UpcycleError(f"rope_key_groups={groups}: allowed 1 or the number of KV heads ({g})")
    # MLA scales scores by 1/sqrt(d_nope + d_rope); the base by 1/sqrt(dh)
    q_scale = math.sqrt((d_nope + d_rope) / dh)
    # queries: per head [nope | rope]
    if qk_norm:
        # a norm undoes any scale of its input: the ratio goes into q_norm's weight instead
        out["q_norm.weight"] = q_scale * qk_norm_layout(w_qn, nope_idx, rope_idx, groups)
        out["k_norm.weight"] = qk_norm_layout(w_kn, nope_idx, rope_idx, groups)
        q_scale = 1.0
    q_full = q_scale * torch.cat([wq[:, nope_idx], q_rope], dim=1).reshape(h * (d_nope + d_rope), d)
    if hcfg.q_lora_rank is None:
        out["q_proj.weight"] = q_full
    else:
        u, s, vh = torch.linalg.svd(q_full, full_matrices=False)
        rq = min(hcfg.q_lora_rank, s.numel())
        out["q_a_proj.weight"] = fit_rows(s[:rq, None] * vh[:rq], hcfg.q_lora_rank)
        out["q_b_proj.weight"] = fit_rows(u[:, :rq].T, hcfg.q_lora_rank).T.contiguous()
    # joint SVD of stacked per-KV-head nope keys and values
    k_nope = wk[:, nope_idx]  # [G, Pn, D]
    v = fit_rows(wv.transpose(0, 1), dv).transpose(0, 1) if dv != dh else wv  # [G, dv, D]
    stacked = torch.cat([k_nope.reshape(g * d_nope, d), v.reshape(g * dv, d)], dim=0)
    u, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    rk = min(r, s.numel())
    latent = fit_rows(s[:rk, None] * vh[:rk], r)  # [R, D]
    up = fit_rows(u[:, :rk].T, r).T  # [G*(Pn+dv), R]
    up_k = up[: g * d_nope].view(g, d_nope, r)
    up_v = up[g * d_nope :].view(g, dv, r)
    kv_b = torch.cat([up_k, up_v], dim=1)  # [G, Pn+dv, R]: one block per KV head
    if not getattr(hcfg, "kv_b_per_kv_head", False):
        # DeepSeek's layout: one block per query head, GQA groups expanded
        kv_b = kv_b.repeat_interleave(group, 0)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([latent, k_pe], dim=0)
    out["kv_b_proj.weight"] = kv_b.reshape(-1, r)
    wo = w.o_DHK
    if dv != dh:
        wo = fit_rows(wo.permute(2, 0, 1), dv).permute(1, 2, 0)
    out["o_proj.weight"] = wo.reshape(d, h * dv)
    if getattr(attn.o_proj, "bias", None) is not None:
        out["o_proj.bias"] = attn.o_proj.bias.detach().double()
    return out

