"""Mamba-2 (`linear_type: mamba2`) from one attention layer: x <- W_v, B <- W_k, C <- W_q, out_proj <- W_o.

Legend: H Mamba heads, P head dim, N state size, G groups of B/C, E = H * P, Cv = E + 2 * G * N conv
channels (the mixer's layout, hylo/layers/mamba2.py); h query heads, g KV heads, dh base head dim, D hidden.

Design choices:
* With the shapes derived from the attention (`HybridConfig.mamba2_dims`: H = query heads, P = N = head_dim,
  G = H) the copy is exact: x copies W_v (KV heads expanded to their query heads), B copies W_k, C copies
  W_q and out_proj copies W_o, each head keeping its own query as C. Other shapes wrap the heads (Mamba
  head m stands for query head m mod h) and truncate or zero-pad head dims.
* The z and dt rows of in_proj get the model's default normal(0, initializer_range); with calibration
  (calibrate.py) the z rows and the norm weight are then set like GDN's gate (SiLU(z) ~= 1, norm weight =
  the attention heads' RMS). The conv starts as identity (last tap 1, bias 0), as the GDN upcycle does, so
  the copied projections are not scrambled.
* Grouped x/B (`mamba2_xb_groups` = X, the Zebra-Llama / HyLo recipe when X is the number of KV heads):
  x group j copies W_v and B group j copies W_k of the KV head read by the group's first head, with no
  expansion (AMD's `in_proj[d_inner : d_inner + d_xb] <- v_proj`, `[.. + 2 d_xb] <- k_proj`).
* Qwen3's q/k RMSNorm weights are folded into the copied rows (approximate: SSD does not normalise B, C).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hylo.upcycle.attention import attention_weights, fit_rows

if TYPE_CHECKING:
    from hylo.config import HybridConfig


@torch.no_grad()
def mamba2_weights_from_attention(attn: nn.Module, hcfg: HybridConfig) -> dict[str, torch.Tensor]:
    """Initialise a Mamba-2 mixer from a Llama/Qwen3 attention module (float64; `upcycle` casts and checks shapes).

    x <- W_v, B <- W_k, C <- W_q, out_proj <- W_o. Mamba head m stands for query head m mod h (KV head of
    that query head for x); group j takes the query/key head of its first Mamba head. Head dims are
    truncated or zero-padded when P or N differ from the attention head_dim. z and dt rows keep the default
    normal(0, initializer_range); the conv becomes identity.
    """
    w = attention_weights(attn, hcfg)
    h, _, _, d = w.heads
    group = w.group
    wq, wk, wv, wo = w.q_HKD, w.k_GKD, w.v_GKD, w.o_DHK
    H, P, N, G = hcfg.mamba2_dims
    E = H * P
    q_of_head = [m % h for m in range(H)]
    q_of_group = [q_of_head[j * (H // G)] for j in range(G)]
    X = hcfg.mamba2_xb_groups
    if X is None:
        x_rows = torch.cat([fit_rows(wv[qi // group], P) for qi in q_of_head])
        B_rows = torch.cat([fit_rows(wk[qi // group], N) for qi in q_of_group])
    else:
        q_of_xb = [q_of_head[j * (H // X)] for j in range(X)]
        x_rows = torch.cat([fit_rows(wv[qi // group], P) for qi in q_of_xb])
        B_rows = torch.cat([fit_rows(wk[qi // group], N) for qi in q_of_xb])
    C_rows = torch.cat([fit_rows(wq[qi], N) for qi in q_of_group])
    std = hcfg.initializer_range
    z_rows = torch.randn(E, d, dtype=torch.float64) * std
    dt_rows = torch.randn(H, d, dtype=torch.float64) * std

    Cv = x_rows.shape[0] + B_rows.shape[0] + C_rows.shape[0]
    conv = torch.zeros(Cv, 1, hcfg.gdn_conv_size, dtype=torch.float64)
    conv[:, 0, -1] = 1.0
    # a base head used by several Mamba heads shares its output projection among them
    uses = torch.bincount(torch.tensor(q_of_head), minlength=h).double()
    o = torch.stack([fit_rows(wo[:, qi].T, P).T / uses[qi] for qi in q_of_head], dim=1)  # [D, H, P]
    return {
        "in_proj.weight": torch.cat([z_rows, x_rows, B_rows, C_rows, dt_rows]),
        "conv1d.weight": conv,
        "conv1d.bias": torch.zeros(Cv, dtype=torch.float64),
        "out_proj.weight": o.reshape(d, E),
    }
