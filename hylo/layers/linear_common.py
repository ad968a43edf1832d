"""Plumbing shared by the linear mixers (`GatedDeltaNet` in gdn.py, `Mamba2Mixer` in mamba2.py).

Legend: B batch, T tokens, D hidden size, C conv channels, W conv_size - 1 (cached conv inputs).

* Input checks of a mixer's forward: hidden_states [B, T, D]; packed rows (`cu_seqlens`) need B == 1,
  no cache, and boundaries under the packed-row rule of `kernels/varlen.py`. They return the row's
  `DocBounds`: the model's own (no host read), or checked here from a tensor when the mixer is called
  alone. Its `positions` (each token's index in its document) mask the packed short conv; the
  bounds go on to the kernel.
* The short causal depthwise conv + SiLU as a sum of W+1 shifted copies (optionally masked per
  document), returning the last W inputs for a cache.
* The default init of `dt_bias` (fla's and mamba_ssm's: dt log-uniform in [1e-3, 0.1], floored at
  1e-4, stored as its softplus inverse).
"""

from __future__ import annotations

import math
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from hylo.cache import LinearLayerCache
from hylo.kernels.varlen import BoundaryError, DocBounds, doc_bounds
from hylo.seq_parallel import RowShard, shard_bounds


def check_mixer_input(
    mixer: nn.Module,
    x_BTD: torch.Tensor,
    cu_seqlens: torch.Tensor | DocBounds | None,
    cache: LinearLayerCache | None,
    shard: RowShard | None = None,
) -> tuple[DocBounds | None, torch.Tensor | None]:
    """Validate a linear mixer's forward arguments (errors start with e.g. "GatedDeltaNet(layer 3)");
    return the packed row's checked boundaries and its positions [T] (a split row's: `shard.local`), or
    (None, None) unpacked."""
    def owner() -> str:
        # built on an error only: a compiled block reads no layer index (one graph for every layer of a kind)
        return f"{type(mixer).__name__}(layer {mixer.layer_idx})"

    hidden_size = mixer.hidden_size
    if x_BTD.dim() != 3 or x_BTD.shape[-1] != hidden_size:
        raise ValueError(f"{owner()}: hidden_states must be [B, T, {hidden_size}], got {list(x_BTD.shape)}")
    B, T, _ = x_BTD.shape
    if shard is not None:

        def wrong(message: str) -> NoReturn:
            raise ValueError(f"{owner()}: {message}")

        local = shard_bounds(shard, B, T, cu_seqlens, cache, wrong)
        return local, local.positions
    if cu_seqlens is None:
        return None, None
    if cache is not None:
        raise ValueError(f"{owner()}: a cache works on unpacked batches; got both cache and cu_seqlens")
    if B != 1:
        raise ValueError(f"{owner()}: packed rows (cu_seqlens) need B == 1, got B={B}")

    def bad(message: str) -> NoReturn:
        raise BoundaryError(f"{owner()}: {message}")

    bounds = doc_bounds(cu_seqlens, T, bad)
    return bounds, bounds.positions


def causal_conv_silu(
    x_BTC: torch.Tensor,
    weight_C1K: torch.Tensor,
    prefix_BCW: torch.Tensor | None = None,
    pos_T: torch.Tensor | None = None,
    bias_C: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. Returns (y [B, T, C], the last W inputs [B, C, W] for a cache).

    `prefix_BCW`: inputs preceding x (a cache); zeros if None. `pos_T`: token position inside its
    document (packed rows); taps that would reach before the document start are dropped.
    """
    B, T, C = x_BTC.shape
    Kc = weight_C1K.shape[-1]
    W = Kc - 1
    if prefix_BCW is None:
        prefix_BWC = x_BTC.new_zeros(B, W, C)
    else:
        prefix_BWC = prefix_BCW.transpose(1, 2).to(x_BTC.dtype)
    xe_BTC = torch.cat([prefix_BWC, x_BTC], 1)
    w_KC = weight_C1K[:, 0, :].t().to(x_BTC.dtype)
    # tap j looks j tokens back; weight column Kc-1-j (torch conv1d orientation, as fla)
    y_BTC = xe_BTC[:, W:] * w_KC[Kc - 1]
    for j in range(1, Kc):
        tap_BTC = xe_BTC[:, W - j : W - j + T] * w_KC[Kc - 1 - j]
        if pos_T is not None:
            tap_BTC = tap_BTC * (pos_T >= j).to(x_BTC.dtype)[None, :, None]
        y_BTC = y_BTC + tap_BTC
    if bias_C is not None:
        y_BTC = y_BTC + bias_C.to(x_BTC.dtype)
    # a copy, so that a cache does not keep the whole prefill input alive
    new_prefix_BCW = xe_BTC[:, xe_BTC.shape[1] - W :].transpose(1, 2).clone(memory_format=torch.contiguous_format)
    return F.silu(y_BTC), new_prefix_BCW


def default_dt_bias(H: int) -> torch.Tensor:
    """[H] fp32 `dt_bias` such that softplus(dt_bias) = dt, dt log-uniform in [1e-3, 0.1] (floor 1e-4).
    Draws H uniforms from torch's global generator."""
    dt_min, dt_max, dt_floor = 1e-3, 0.1, 1e-4
    dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_floor)
    # inverse of softplus, so that softplus(dt_bias) = dt at init
    return dt + torch.log(-torch.expm1(-dt))
