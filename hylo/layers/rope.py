"""Rotary position embedding for MLA's decoupled key/query part, with linear and YaRN scaling.

Design choices:
* rotate-half convention (Llama's): dim i is paired with dim i + P/2 and both turn at
  `inv_freq[i] = rope_theta ** (-2i / P)`. The converter picks `rope_theta` so that the base model's
  chosen frequency pairs are reproduced, so this formula is fixed (computed exactly as transformers does).
* YaRN frequencies and attention factor follow `transformers.modeling_rope_utils` (same ramp, same
  truncation, same mscale rule); the attention factor multiplies cos/sin, as in transformers.
* MLA's softmax scale is `1/sqrt(d_nope + d_rope)`, times `mscale(factor, mscale_all_dim)**2` when the
  YaRN config sets `mscale_all_dim` (DeepSeek-V2/V3's rule: the roped part already carries the
  attention factor through cos/sin, the squared mscale rescales every logit).
* `inv_freq` is a plain CPU tensor built at construction with an explicit device, not a buffer, so
  meta-device model construction and `state_dict` round trips cannot corrupt it; it is copied to the
  device of `position_ids` once per device.
* cos/sin are computed in fp32 (positions up to 64K and beyond lose precision in bf16), then cast.

Legend: B batch, T tokens, H heads, P rotary dims (qk_rope_head_dim).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "yarn")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    rtype = rope_scaling.get("rope_type", rope_scaling.get("type")) or "default"
    if rtype not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rtype!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
    return rtype


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _require(rope_scaling: dict[str, Any], key: str, rtype: str) -> Any:
    if rope_scaling.get(key) is None:
        raise ValueError(f"rope_scaling: rope_type {rtype!r} needs key {key!r}; got keys {sorted(rope_scaling)}")
    return rope_scaling[key]


def rope_parameters(
    dim: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32, CPU) and the cos/sin attention factor.

    `rope_scaling` is None / {"rope_type": "default"}, {"rope_type": "linear", "factor"} or
    {"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    optional "mscale", "mscale_all_dim", "attention_factor", "truncate"}.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even number, got {dim}")
    rtype = rope_type_of(rope_scaling)
    # Same op order and dtypes as transformers' default RoPE, so inv_freq matches it bit for bit
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    pos_freqs = base**exponent
    inv_freq = 1.0 / pos_freqs
    if rtype == "default":
        return inv_freq, 1.0
    assert rope_scaling is not None
    factor = rope_scaling.get("factor")
    if rtype == "linear":
        factor = float(_require(rope_scaling, "factor", rtype))
        return inv_freq / factor, 1.0

    # YaRN
    original_max = int(_require(rope_scaling, "original_max_position_embeddings", rtype))
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_scaling: yarn without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / original_max
    factor = float(factor)
    attention_factor = rope_scaling.get("attention_factor")
    mscale = rope_scaling.get("mscale")
    mscale_all_dim = rope_scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1
    truncate = rope_scaling.get("truncate", True)

    def correction_dim(n_rotations: float) -> float:
        # the dim index whose wavelength fits n_rotations times into the original window
        return (dim * math.log(original_max / (n_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    # extrapolate (keep the original frequency) for fast dims, interpolate (divide by factor) for slow ones
    extrapolation_weight = 1 - ramp
    inv_freq_interp = 1.0 / (factor * pos_freqs)
    inv_freq = inv_freq_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_factor)


def mla_softmax_scale(
    qk_head_dim: int, rope_scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None
) -> float:
    """`1/sqrt(qk_head_dim)`, times `mscale(factor, mscale_all_dim)**2` for scaled RoPE with mscale_all_dim."""
    scale = qk_head_dim**-0.5
    if rope_type_of(rope_scaling) != "default":
        assert rope_scaling is not None
        mscale_all_dim = rope_scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            factor = rope_scaling.get("factor")
            if factor is None:
                # same fallback as the YaRN frequencies: the extension ratio of the context window
                original_max = _require(rope_scaling, "original_max_position_embeddings", "yarn")
                if max_position_embeddings is None:
                    raise ValueError("rope_scaling without 'factor' needs max_position_embeddings")
                factor = max_position_embeddings / original_max
            m = yarn_get_mscale(float(factor), float(mscale_all_dim))
            scale = scale * m * m
    return scale


def rotate_half(x_P: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_P.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_P: torch.Tensor, cos_P: torch.Tensor, sin_P: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of `x` (shapes broadcast, e.g. x [B,T,H,P] with cos [B,T,1,P])."""
    return x_P * cos_P + rotate_half(x_P) * sin_P


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions: `forward(position_ids_BT, dtype) -> (cos_BTP, sin_BTP)`."""

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int | None = None,
        groups: int = 1,
    ) -> None:
        super().__init__()
        if groups < 1 or dim % (2 * groups):
            raise ValueError(f"RotaryEmbedding: dim={dim} must be a multiple of 2 * groups (groups={groups})")
        self.dim = dim
        self.base = base
        self.groups = groups
        self.rope_type = rope_type_of(rope_scaling)
        inv_freq, self.attention_factor = rope_parameters(dim // groups, base, rope_scaling, max_position_embeddings)
        # `groups` blocks of rotary pairs share one frequency ladder (one block per upcycled KV head group)
        self._inv_freq_cpu = inv_freq.repeat(groups)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._inv_freq_cpu

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq_on(position_ids_BT.device)
        with torch.autocast(device_type=position_ids_BT.device.type, enabled=False):
            freqs_BTh = position_ids_BT[..., None].float() * inv_freq
            emb_BTP = torch.cat((freqs_BTh, freqs_BTh), dim=-1)
            cos_BTP = emb_BTP.cos() * self.attention_factor
            sin_BTP = emb_BTP.sin() * self.attention_factor
        return cos_BTP.to(dtype), sin_BTP.to(dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, groups={self.groups}, base={self.base}, rope_type={self.rope_type}, attention_factor={self.attention_factor:.6g}"
