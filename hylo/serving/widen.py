"""The MLA latent at a width a serving engine accepts, widened exactly.

vLLM's MLA kernels take a cached latent + roped key of a few fixed widths only (`kv_lora_rank +
qk_rope_head_dim` of 320, 512 or 576; its CPU and FlashAttention MLA backends 576 alone). The recipes' widths
are narrower (Llama-3.2-1B 128 + 32, Llama-3.2-3B 128 + 64, Qwen3-1.7B 256 + 64). Serving widens them with
zeros, so that every output is the native model's:

* the rope part P -> P' (64): each query head's and the shared key's rope rows gain zero rows after the P
  native ones. The rotary embedding turns the first P dims only (the native frequencies); the zero dims add
  nothing to q . k.
* the latent R -> R' = width - P': `kv_a_proj_with_mqa` gains zero latent rows, `kv_b_proj` zero columns.
  The latent RMSNorm is compensated: with R' - R zero dims, mean(x'^2) = (R / R') mean(x^2), so
  eps' = eps R / R' and weight' = weight sqrt(R / R') give x / rms(x) * weight on the native dims, and 0 on
  the zero dims. Without a latent norm nothing needs compensating.
* `kv_b_proj` per KV head (AMD's layout) is repeated to one block per query head, which vLLM's MLA reads.

The softmax scale stays the native one (1/sqrt(N + P), YaRN's mscale included): the caller passes it.
KV bytes per token grow from R + P to R' + P' values a layer: `served_bytes_per_token` says by how much.

Legend: H heads, G kv_b_proj heads, N nope dims, P rope dims, V value dims, R latent, Q q_lora_rank, D hidden.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.config import HybridConfig

# the rope width vLLM's MLA kernels assume (DeepSeek's); a narrower native rope is zero-padded to it
SERVED_ROPE_DIM = 64


class ServingShapeError(ValueError):
    """A model a serving engine cannot run exactly; the message names the key and what to change."""


@dataclass(frozen=True)
class ServedMLA:
    """An MLA layer's native and served latent (R) and rope (P) widths."""

    rank: int
    rope: int
    served_rank: int
    served_rope: int

    @property
    def width(self) -> int:
        return self.rank + self.rope

    @property
    def served_width(self) -> int:
        return self.served_rank + self.served_rope

    @property
    def widened(self) -> bool:
        return self.served_width != self.width


def served_mla(cfg: HybridConfig, accepted: Sequence[int]) -> ServedMLA:
    """The narrowest accepted width at least the native one, its rope part `SERVED_ROPE_DIM` where the native
    rope is narrower; an empty `accepted` (a backend that takes any width) keeps the native widths."""
    R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    check_servable(cfg)
    if not accepted or R + P in accepted:
        return ServedMLA(R, P, R, P)
    rope = max(P, SERVED_ROPE_DIM)
    fits = sorted(w for w in accepted if w - rope >= R)
    if not fits:
        raise ServingShapeError(
            f"kv_lora_rank + qk_rope_head_dim = {R} + {P}: the serving engine's MLA takes widths "
            f"{sorted(accepted)} only, none of which holds this latent with a rope part of {rope}")
    return ServedMLA(R, P, fits[0] - rope, rope)


def check_servable(cfg: HybridConfig) -> None:
    """Refuse what the latent-cache serving path cannot compute exactly, naming the key."""
    if cfg.mla_qk_norm:
        raise ServingShapeError(
            "mla_qk_norm: the per-head key norm (Qwen3's k_norm) scales each head's scores by a per-token "
            "factor that vLLM's MLA kernels do not take; models converted with it are served by "
            "HyLoForCausalLM.generate only")
    if cfg.qk_rope_head_dim > SERVED_ROPE_DIM and cfg.qk_rope_head_dim % 2:
        raise ServingShapeError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def widen_query(w: torch.Tensor, cfg: HybridConfig, s: ServedMLA) -> torch.Tensor:
    """q_proj / q_b_proj rows [H (N + P), in] -> [H (N + P'), in]: zero rows after each head's rope rows."""
    H, N = cfg.num_attention_heads, cfg.qk_nope_head_dim
    w_HXI = w.reshape(H, N + s.rope, *w.shape[1:])
    return torch.stack([_pad_rows(h, N + s.served_rope) for h in w_HXI]).reshape(H * (N + s.served_rope),
                                                                                   *w.shape[1:])


def widen_kv_a(w: torch.Tensor, s: ServedMLA) -> torch.Tensor:
    """kv_a_proj_with_mqa rows (or bias) [R + P] -> [R' + P']: [latent | 0 | k_pe | 0]."""
    latent, k_pe = w.split([s.rank, s.rope])
    return torch.cat([_pad_rows(latent, s.served_rank), _pad_rows(k_pe, s.served_rope)])


def widen_latent_norm(weight: torch.Tensor, eps: float, s: ServedMLA) -> tuple[torch.Tensor, float]:
    """The latent RMSNorm's weight [R'] and eps that give the native norm on the first R dims."""
    ratio = s.rank / s.served_rank
    scaled = (weight.double() * math.sqrt(ratio)).to(weight.dtype) if weight.dtype == torch.float64 else \
        (weight.float() * math.sqrt(ratio)).to(weight.dtype)
    return _pad_rows(scaled, s.served_rank), eps * ratio


def widen_kv_b(w: torch.Tensor, cfg: HybridConfig, s: ServedMLA) -> torch.Tensor:
    """kv_b_proj [G (N + V), R] -> [H (N + V), R']: one block per query head, zero latent columns."""
    H, G = cfg.num_attention_heads, cfg.kv_b_heads
    if G != H:
        w = w.reshape(G, -1, w.shape[1]).repeat_interleave(H // G, dim=0).reshape(-1, w.shape[1])
    if s.served_rank > s.rank:
        w = torch.cat([w, w.new_zeros(w.shape[0], s.served_rank - s.rank)], dim=1)
    return w


def rotate_native_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: int) -> torch.Tensor:
    """RoPE (`hylo.layers.rope.apply_rotary`, rotate-half) on the first `rope` dims of a served rope part
    [..., P']; the zero dims after them stay as they are."""
    from hylo.layers.rope import apply_rotary

    out = x.clone()
    out[..., :rope] = apply_rotary(x[..., :rope], cos, sin)
    return out


def served_bytes_per_token(cfg: HybridConfig, s: ServedMLA, dtype_bytes: int = 2) -> tuple[int, int]:
    """KV bytes per token over the model, native and served (MLA layers only; linear layers cache nothing
    that grows)."""
    n = len(cfg.mla_layers)
    return n * s.width * dtype_bytes, n * s.served_width * dtype_bytes
