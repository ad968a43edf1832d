"""Multi-head Latent Attention (DeepSeek-V2 style) with partial RoPE/YaRN, packed rows and a latent cache.

Design choices:
* Parameter names and row layouts are DeepSeek-V3's (HF): `q_proj` or `q_a_proj`/`q_a_layernorm`/
  `q_b_proj`, `kv_a_proj_with_mqa` (rows: latent R, then the shared k_pe P), `kv_a_layernorm`,
  `kv_b_proj` (per head: d_nope key rows, then d_v value rows), `o_proj`. Per-head query is
  [nope | rope]. With `config.kv_b_per_kv_head` (AMD's released layout) `kv_b_proj` holds one such block
  per KV head and each query head reads its GQA group's block (h // (H / Hk)). Bias on q/q_a, kv_a and o only when `config.attention_bias` (DeepSeek keeps
  `q_proj` bias-free; here one switch covers all three, which is what an upcycled biased base needs).
* Two attention paths, chosen by whether a cache is given:
  - training / scoring (no cache): K/V are decompressed through `kv_b_proj` and fed to
    `scaled_dot_product_attention`. Packed rows (`cu_seqlens`, B == 1) run causal SDPA per document,
    documents of similar length batched into one call (`hylo.kernels.packed_sdpa`), so no [T, T]
    block-diagonal mask is ever built and documents never see each other. The
    documents are sliced with the host ints of the model's `hylo.kernels.varlen.DocBounds` (a tensor given to
    the layer alone is checked here, under the same rule), so the layer never reads the device.
  - generation (cache): only the normalised latent `c_kv` and the roped shared `k_pe` are cached. The
    key part of `kv_b_proj` is absorbed into the query (`q_nope W_uk -> q_lat`, [R] per head) and the
    value part is applied after attention, so attention runs in latent space against [c_kv | k_pe]
    shared by all heads (one K/V head, `enable_gqa`) and full K/V are never rebuilt. A decode step (one new
    token) attends its H heads as H queries of that one head, so the cache is read as stored, never repeated
    per head (what `enable_gqa` does on paths without native GQA).
* SDPA's fused CPU (flash) kernel needs equal q/k/v head dims. The decompressed path zero-pads the
  shorter of (d_nope + d_rope) and d_v (zeros add nothing to q.k and the padded output columns are
  dropped); the latent path uses [c_kv | k_pe] as both key and value and keeps the first R output
  columns. Both paths therefore stay on the memory-efficient kernels.
* Positions: `position_ids` are used as given; when None they are arange, restarting at 0 at every
  document of `cu_seqlens` (the bounds' positions), or continuing after the cached tokens with a cache.
* Padded batches (generation): `attention_mask` [B, S] (True = real token, S = cached + new) hides pad
  keys in both paths; every token may always attend to itself, so a pad query never sees an empty row
  (its output is finite and unused).
* Softmax scale 1/sqrt(d_nope + d_rope), with DeepSeek's YaRN rule (see `hylo/layers/rope.py`).
* Optional per-head q/k RMSNorm (`config.mla_qk_norm`, Qwen3's `q_norm` / `k_norm`, weight [E], eps
  rms_norm_eps; `hylo.layers.norm.HeadRMSNorm`): each head's [nope | rope] query and key are normalised
  before RoPE. The key norm needs each head's full key [k_nope_h | k_pe], which the absorbed decode never
  rebuilds, so the cache also holds one key 1/RMS per kv_b head and token (computed when the token is
  written); k_norm's nope weight moves to the query side (q . (w k) == (w q) . k), its rope weight is
  applied to the shared k_pe before RoPE and cached with it, and the 1/RMS multiplies each head's scores.
  Per-key score factors do not fit SDPA, so that latent path runs an explicit softmax over query chunks;
  a prompt on an empty cache (prefill) writes the cache and attends through the decompressed path instead
  (fused SDPA, the same result).

Legend: B batch, T new tokens, S cached + new tokens, D hidden, H heads, N d_nope, P d_rope (rotary),
E d_nope + d_rope, V d_v, R kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from hylo.cache import MLALayerCache
from hylo.kernels.packed_sdpa import packed_attention
from hylo.kernels.varlen import DocBounds, doc_bounds
from hylo.layers.norm import HeadRMSNorm, RMSNorm
from hylo.layers.rope import RotaryEmbedding, apply_rotary, mla_softmax_scale
from hylo.seq_parallel import RowShard, attend_shard, shard_bounds


class MLAInputError(ValueError):
    """Bad shapes or packing metadata given to MLAttention; the message names the argument."""


class MLAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        H, E, V, R, P, D = (self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank,
                            self.qk_rope_head_dim, self.hidden_size)
        bias = bool(config.attention_bias)
        eps = config.rms_norm_eps
        # DeepSeek normalises the latents; upcycled models may start without (see HybridConfig.mla_latent_norm)
        latent_norm = bool(getattr(config, "mla_latent_norm", True))

        latent_eps = getattr(config, "mla_latent_norm_eps", None)
        latent_eps = eps if latent_eps is None else float(latent_eps)
        # heads of kv_b_proj: every query head (DeepSeek) or one per KV head, read by its group (AMD)
        self.kv_b_heads = config.num_key_value_heads if getattr(config, "kv_b_per_kv_head", False) else H
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * E, bias=bias)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=latent_eps) if latent_norm else nn.Identity()
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * E, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, R + P, bias=bias)
        self.kv_a_layernorm = RMSNorm(R, eps=latent_eps) if latent_norm else nn.Identity()
        self.kv_b_proj = nn.Linear(R, self.kv_b_heads * (self.qk_nope_head_dim + V), bias=False)
        self.o_proj = nn.Linear(H * V, D, bias=bias)
        self.qk_norm = bool(getattr(config, "mla_qk_norm", False))
        if self.qk_norm:
            groups = getattr(config, "rope_key_groups", 1)
            self.q_norm = HeadRMSNorm(self.qk_nope_head_dim, P, groups, eps=eps)
            self.k_norm = HeadRMSNorm(self.qk_nope_head_dim, P, groups, eps=eps)

        self.rotary_emb = RotaryEmbedding(P, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings,
                                          groups=getattr(config, "rope_key_groups", 1))
        self.softmax_scale = mla_softmax_scale(E, config.rope_scaling, config.max_position_embeddings)

    # ------------------------------------------------------------------ helpers
    @property
    def cache_values_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim + (self.kv_b_heads if self.qk_norm else 0)

    def _err(self, msg: str) -> MLAInputError:
        return MLAInputError(f"MLAttention(layer {self.layer_idx}): {msg}")

    def _bad(self, msg: str) -> NoReturn:
        raise self._err(msg)

    def _position_ids(self, position_ids: torch.Tensor | None, B: int, T: int, device: torch.device,
                      bounds: DocBounds | None, offset: int) -> torch.Tensor:
        if position_ids is None:
            if bounds is not None:
                return bounds.positions.unsqueeze(0)
            return torch.arange(offset, offset + T, dtype=torch.long, device=device).unsqueeze(0).expand(B, T)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
            raise self._err(f"position_ids must be [B, T] = [{B}, {T}], got shape {tuple(position_ids.shape)}")
        return position_ids.expand(B, T)

    def _query(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        B, T, _ = x_BTD.shape
        return q.view(B, T, self.num_heads, self.qk_head_dim)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | DocBounds | None = None,
        cache: MLALayerCache | None = None,
        attention_mask: torch.Tensor | None = None,
        shard: RowShard | None = None,
    ) -> torch.Tensor:
        """`shard`: this rank's part of a split row (hylo/seq_parallel.py), None for a whole row."""
        x_BTD = hidden_states
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.hidden_size:
            raise self._err(f"hidden_states must be [B, T, {self.hidden_size}], got shape {tuple(x_BTD.shape)}")
        B, T, _ = x_BTD.shape
        N, P, R = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        bounds: DocBounds | None = None
        if shard is not None:
            bounds, cu_seqlens = shard_bounds(shard, B, T, cu_seqlens, cache, self._bad), None
        if cu_seqlens is not None:
            if cache is not None:
                raise self._err("cu_seqlens (packed rows) cannot be combined with a cache; "
                                "generation runs unpacked batches")
            if B != 1:
                raise self._err(f"cu_seqlens is given, so hidden_states must hold one packed row (B == 1); got B={B}")
            bounds = doc_bounds(cu_seqlens, T, self._bad)
        offset = cache.seq_len if cache is not None else 0
        pos_BT = self._position_ids(position_ids, B, T, x_BTD.device, bounds, offset)
        keep_BS = self._key_mask(attention_mask, B, offset + T, bounds is not None)

        q_BTHE = self._query(x_BTD)
        if self.qk_norm:
            q_BTHE = self.q_norm(q_BTHE)
        q_nope_BTHN, q_pe_BTHP = q_BTHE.split([N, P], dim=-1)
        c_kv_BTR, k_pe_BTP = self.kv_a_proj_with_mqa(x_BTD).split([R, P], dim=-1)
        c_kv_BTR = self.kv_a_layernorm(c_kv_BTR)

        cos_BTP, sin_BTP = self.rotary_emb(pos_BT, q_pe_BTHP.dtype)
        q_pe_BTHP = apply_rotary(q_pe_BTHP, cos_BTP.unsqueeze(2), sin_BTP.unsqueeze(2))
        rope = (cos_BTP, sin_BTP)

        if shard is not None:
            o_BTHV = attend_shard(self, q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, shard)
        elif cache is None:
            o_BTHV = self._attend_decompressed(q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, rope, bounds, keep_BS)
        elif self.qk_norm:
            o_BTHV = self._attend_latent_normed(q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, rope, cache, keep_BS)
        else:
            k_pe_BTP = apply_rotary(k_pe_BTP, cos_BTP, sin_BTP)
            o_BTHV = self._attend_latent(q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, cache, keep_BS)
        return self.o_proj(o_BTHV.reshape(B, T, self.num_heads * self.v_head_dim))

    def _key_mask(self, attention_mask: torch.Tensor | None, B: int, S: int,
                  packed: bool) -> torch.Tensor | None:
        """[B, S] bool (True = real key), or None when nothing is masked."""
        if attention_mask is None:
            return None
        if packed:
            raise self._err("attention_mask (padding) cannot be combined with cu_seqlens (packed rows)")
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, S):
            raise self._err(f"attention_mask must be [B, cached + new tokens] = [{B}, {S}], "
                            f"got shape {tuple(attention_mask.shape)}")
        keep_BS = attention_mask.to(torch.bool)
        return None if bool(keep_BS.all()) else keep_BS

    @staticmethod
    def _padded_causal_mask(keep_BS: torch.Tensor, T: int, past: int) -> torch.Tensor:
        """[B, 1, T, S]: new token t (absolute past + t) sees real keys up to itself, and always itself."""
        S = keep_BS.shape[1]
        causal_TS = torch.ones(T, S, dtype=torch.bool, device=keep_BS.device).tril(diagonal=past)
        self_TS = torch.zeros(T, S, dtype=torch.bool, device=keep_BS.device)
        self_TS[torch.arange(T), past + torch.arange(T)] = True
        return ((causal_TS[None] & keep_BS[:, None, :]) | self_TS[None]).unsqueeze(1)

    def decompressed_kv(self, c_kv_BSR: torch.Tensor, k_pe_BSP: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, H, S, E] and values [B, H, S, V] of S tokens from their latent and raw `k_pe` (RoPE and the
        key norm are applied here; `rope` is the keys' cos / sin)."""
        B, S, _ = c_kv_BSR.shape
        H, N = self.num_heads, self.qk_nope_head_dim
        P, V, G = self.qk_rope_head_dim, self.v_head_dim, self.kv_b_heads
        cos_BSP, sin_BSP = rope
        kv_BSGX = self.kv_b_proj(c_kv_BSR).view(B, S, G, N + V)
        k_nope_BSGN, v_BSGV = kv_BSGX.split([N, V], dim=-1)
        if self.qk_norm:
            # each kv_b head's full key [k_nope_g | k_pe], normalised before RoPE
            k_pe_BS1P = k_pe_BSP.unsqueeze(2)
            inv_BSG = self.k_norm.inv_rms(k_nope_BSGN, k_pe_BS1P)
            w = self.k_norm.weight
            k_nope_BSGN = self.k_norm.scale(k_nope_BSGN, inv_BSG, w[:N])
            k_pe_BSXP = self.k_norm.scale(k_pe_BS1P, inv_BSG, w[N:])
            k_pe_BSXP = apply_rotary(k_pe_BSXP, cos_BSP.unsqueeze(2), sin_BSP.unsqueeze(2))
        else:
            k_pe_BSXP = apply_rotary(k_pe_BSP, cos_BSP, sin_BSP).unsqueeze(2)
        if G != H:
            # each query head reads its KV group's keys and values (GQA)
            k_nope_BSGN, v_BSGV = (t.repeat_interleave(H // G, dim=2) for t in (k_nope_BSGN, v_BSGV))
            if k_pe_BSXP.shape[2] != 1:
                k_pe_BSXP = k_pe_BSXP.repeat_interleave(H // G, dim=2)
        k_BHSE = torch.cat([k_nope_BSGN, k_pe_BSXP.expand(B, S, H, P)], dim=-1).transpose(1, 2)
        return k_BHSE, v_BSGV.transpose(1, 2)

    def equal_head_dims(self, q_BHTE: torch.Tensor, k_BHSE: torch.Tensor,
                         v_BHSV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Equal q/k/v head dims keep SDPA on its fused (flash) kernels; zero columns change nothing."""
        E, V = self.qk_head_dim, self.v_head_dim
        if V < E:
            v_BHSV = F.pad(v_BHSV, (0, E - V))
        elif E < V:
            q_BHTE, k_BHSE = F.pad(q_BHTE, (0, V - E)), F.pad(k_BHSE, (0, V - E))
        return q_BHTE, k_BHSE, v_BHSV

    def _attend_decompressed(self, q_nope_BTHN: torch.Tensor, q_pe_BTHP: torch.Tensor, c_kv_BTR: torch.Tensor,
                             k_pe_BTP: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                             bounds: DocBounds | None, keep_BS: torch.Tensor | None = None) -> torch.Tensor:
        """`k_pe_BTP` before RoPE (and before k_norm): both are applied here. `bounds`: a packed row's, whose
        host ints only `packed_attention` reads (left out of a compiled block's graph)."""
        T, V = q_nope_BTHN.shape[1], self.v_head_dim
        k_BHTE, v_BHTV = self.decompressed_kv(c_kv_BTR, k_pe_BTP, rope)
        q_BHTE = torch.cat([q_nope_BTHN, q_pe_BTHP], dim=-1).transpose(1, 2)
        q_BHTE, k_BHTE, v_BHTV = self.equal_head_dims(q_BHTE, k_BHTE, v_BHTV)
        if keep_BS is not None:
            o_BHTX = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTV, scale=self.softmax_scale,
                                                    attn_mask=self._padded_causal_mask(keep_BS, T, 0))
        elif bounds is None:
            o_BHTX = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTV, is_causal=True,
                                                    scale=self.softmax_scale)
        else:
            # block-diagonal causal attention without a [T, T] mask (kernels/packed_sdpa.py)
            o_BHTX = packed_attention(q_BHTE, k_BHTE, v_BHTV, bounds, scale=self.softmax_scale)
        return o_BHTX[..., :V].transpose(1, 2)

    def _absorbed_weights(self, per_query_head: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: key part W_uk [H, N, R] and value part W_uv [H, V, R] (per kv_b head,
        [G, N, R] and [G, V, R], when not `per_query_head`)."""
        H, N, V = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        w_HXR = self.kv_b_proj.weight.view(self.kv_b_heads, N + V, self.kv_lora_rank)
        if self.kv_b_heads != H and per_query_head:
            w_HXR = w_HXR.repeat_interleave(H // self.kv_b_heads, dim=0)
        return w_HXR[:, :N], w_HXR[:, N:]

    def _absorb_query(self, q_nope_BTHN: torch.Tensor, w_uk_GNR: torch.Tensor) -> torch.Tensor:
        """q_nope W_uk per head, [B, H, T, R]; each query head reads its kv_b head (h // (H / G)) without
        repeating the weights."""
        B, T, H, N = q_nope_BTHN.shape
        G = w_uk_GNR.shape[0]
        q_lat = torch.einsum("btgin,gnr->bgitr", q_nope_BTHN.view(B, T, G, H // G, N), w_uk_GNR)
        return q_lat.reshape(B, H, T, -1)

    def _absorb_output(self, o_lat_BHTR: torch.Tensor, w_uv_GVR: torch.Tensor) -> torch.Tensor:
        """The latent attention output through W_uv per head, [B, T, H, V]."""
        B, H, T, R = o_lat_BHTR.shape
        G = w_uv_GVR.shape[0]
        o = torch.einsum("bgitr,gvr->btgiv", o_lat_BHTR.reshape(B, G, H // G, T, R), w_uv_GVR)
        return o.reshape(B, T, H, -1)

    def _attend_latent(self, q_nope_BTHN: torch.Tensor, q_pe_BTHP: torch.Tensor, c_kv_BTR: torch.Tensor,
                       k_pe_BTP: torch.Tensor, cache: MLALayerCache,
                       keep_BS: torch.Tensor | None = None) -> torch.Tensor:
        B, T, H, N = q_nope_BTHN.shape
        R = self.kv_lora_rank
        past = cache.seq_len
        kv_BSX = cache.update(c_kv_BTR, k_pe_BTP)  # [c_kv | k_pe] of every cached token
        S = kv_BSX.shape[1]
        w_uk_GNR, w_uv_GVR = self._absorbed_weights(per_query_head=False)

        # q_nope . (W_uk c) == (q_nope W_uk) . c: the query moves into latent space instead of K out of it
        q_lat_BHTR = self._absorb_query(q_nope_BTHN, w_uk_GNR)
        q_BHTX = torch.cat([q_lat_BHTR, q_pe_BTHP.transpose(1, 2)], dim=-1)
        # one key/value head shared by all query heads; [c_kv | k_pe] serves as both key and value
        kv_B1SX = kv_BSX.unsqueeze(1)

        if T == 1:
            # a decode step: the H heads of the one new token are H queries of a single head against the shared
            # key/value head. SDPA's `enable_gqa` would repeat the whole cache H times on paths without native
            # GQA (CPU: 10x slower at 8K context; CUDA's memory-efficient kernel), this reads it once.
            mask = None if keep_BS is None else self._padded_causal_mask(keep_BS, 1, past)
            o_B1HX = F.scaled_dot_product_attention(q_BHTX.transpose(1, 2), kv_B1SX, kv_B1SX, attn_mask=mask,
                                                    scale=self.softmax_scale)
            return self._absorb_output(o_B1HX.transpose(1, 2)[..., :R], w_uv_GVR)
        if keep_BS is not None:
            attn_kw: dict = {"attn_mask": self._padded_causal_mask(keep_BS, T, past)}
        elif T == 1:
            attn_kw = {}
        elif past == 0:
            attn_kw = {"is_causal": True}
        else:
            # new token t (absolute past + t) sees cached tokens and new ones up to itself
            mask_TS = torch.ones(T, S, dtype=torch.bool, device=q_BHTX.device).tril(diagonal=past)
            attn_kw = {"attn_mask": mask_TS}
        o_BHTX = F.scaled_dot_product_attention(q_BHTX, kv_B1SX, kv_B1SX, scale=self.softmax_scale,
                                                enable_gqa=True, **attn_kw)
        return self._absorb_output(o_BHTX[..., :R], w_uv_GVR)

    # scores materialised at once by the q/k-norm latent path: query chunks keep B * H * chunk * S below this
    SCORE_CHUNK_ELEMENTS = 1 << 24
    # with the q/k norm, a multi-token prompt on an empty cache attends through the decompressed path (SDPA)
    decompressed_prefill = True

    def _attend_latent_normed(self, q_nope_BTHN: torch.Tensor, q_pe_BTHP: torch.Tensor, c_kv_BTR: torch.Tensor,
                              k_pe_BTP: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: MLALayerCache,
                              keep_BS: torch.Tensor | None = None) -> torch.Tensor:
        """The absorbed decode with the q/k norm (`q_nope_BTHN`, `q_pe_BTHP` already normalised and roped;
        `k_pe_BTP` raw). score(h, t, s) = [((w_n q_nope) W_uk) . c_s + q_pe . rope(w_p k_pe_s)] / RMS_g(h)(s)."""
        B, T, H, N = q_nope_BTHN.shape
        R, P, G = self.kv_lora_rank, self.qk_rope_head_dim, self.kv_b_heads
        cos_BTP, sin_BTP = rope
        past = cache.seq_len
        w_uk_GNR, w_uv_GVR = self._absorbed_weights(per_query_head=False)
        w = self.k_norm.weight
        # the new tokens' key 1/RMS per kv_b head needs their nope keys once; cached, never rebuilt
        k_nope_BTGN = torch.einsum("btr,gnr->btgn", c_kv_BTR, w_uk_GNR)
        inv_BTG = self.k_norm.inv_rms(k_nope_BTGN, k_pe_BTP.unsqueeze(2))
        kv_BSX = cache.update(c_kv_BTR, apply_rotary(w[N:] * k_pe_BTP, cos_BTP, sin_BTP), inv_BTG.to(c_kv_BTR.dtype))
        if past == 0 and T > 1 and self.decompressed_prefill:
            return self._attend_decompressed(q_nope_BTHN, q_pe_BTHP, c_kv_BTR, k_pe_BTP, rope, None, keep_BS)
        S = kv_BSX.shape[1]
        key_BSX = kv_BSX[..., : R + P]
        inv_BHS = kv_BSX[..., R + P:].transpose(1, 2).repeat_interleave(H // G, dim=1)

        q_lat_BHTR = self._absorb_query(w[:N] * q_nope_BTHN, w_uk_GNR)
        q_BHTX = torch.cat([q_lat_BHTR, q_pe_BTHP.transpose(1, 2)], dim=-1)
        if keep_BS is not None:
            mask_XTS = self._padded_causal_mask(keep_BS, T, past)[:, 0]
        else:
            mask_XTS = torch.ones(T, S, dtype=torch.bool, device=q_BHTX.device).tril(diagonal=past)[None]
        factor_BH1S = (inv_BHS * self.softmax_scale).unsqueeze(2)
        chunk = max(1, self.SCORE_CHUNK_ELEMENTS // max(1, B * H * S))
        outs = []
        for t0 in range(0, T, chunk):
            score_BHtS = torch.einsum("bhtx,bsx->bhts", q_BHTX[:, :, t0:t0 + chunk], key_BSX) * factor_BH1S
            score_BHtS = score_BHtS.masked_fill(~mask_XTS[:, None, t0:t0 + chunk], float("-inf"))
            prob_BHtS = torch.softmax(score_BHtS, dim=-1, dtype=torch.promote_types(score_BHtS.dtype, torch.float32))
            prob_BHtS = prob_BHtS.to(q_BHTX.dtype)
            outs.append(torch.einsum("bhts,bsr->bhtr", prob_BHtS, key_BSX[..., :R]))
        return self._absorb_output(torch.cat(outs, dim=2), w_uv_GVR)
