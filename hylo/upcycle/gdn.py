"""Gated DeltaNet from one attention layer: W_q -> q_proj, W_k -> k_proj, W_v -> v_proj, W_o -> o_proj.

Legend: H query heads, G KV heads, K base head dim, D hidden size; GDN: hg heads, kd key dims, vd value dims.

Design choices:
* Every query head is used. With fewer GDN heads than query heads each GDN head stands for a contiguous
  group of them (`gdn_head_groups`): its key dims hold the group's query / key rows side by side (q.k sums
  the heads' scores; an SVD basis shared by q and k when they do not fit), its value dims one slot per
  head with that head's o_proj columns. Spare value dims are zero with trainable o_proj columns (zero
  columns would never get a gradient).
* Qwen3's q/k RMSNorm weights fold exactly into q_proj / k_proj because GDN L2-normalises q and k.
* Gates, decay and beta keep their default init; the short convolutions start as identity (last tap 1)
  so the copied projections are not scrambled. Calibration (calibrate.py) then makes the output gate
  ~constant and the output norm the attention heads' RMS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hylo.upcycle.attention import attention_weights, fit_rows

if TYPE_CHECKING:
    from hylo.config import HybridConfig


def gdn_head_groups(h: int, hg: int) -> list[list[int]]:
    """The base query heads each GDN head stands for.

    Fewer GDN heads than query heads (the released 3B: 9 for 24): every query head is used, split into
    `hg` contiguous groups as even as possible. Otherwise each GDN head takes one query head in turn.
    """
    if hg >= h:
        return [[j % h] for j in range(hg)]
    bounds = [round(j * h / hg) for j in range(hg + 1)]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(hg)]


def _top_rows(m: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, m.shape[0]]: an orthonormal basis of the `rows`-dim subspace that best keeps m's rows."""
    u, _, _ = torch.linalg.svd(m, full_matrices=False)
    return u[:, :rows].T


@torch.no_grad()
def gdn_weights_from_attention(attn: nn.Module, hcfg: HybridConfig,
                               o_fill: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Copy attention projections into a GDN layer, every query head used.

    GDN head j stands for the query heads of `gdn_head_groups(h, hg)[j]`. Its key space holds their
    query / key rows side by side, so q.k is the sum of those heads' scores; when they do not fit
    (n * dh > gdn_head_dim) both are projected onto one shared basis (the leading left singular vectors
    of [q rows | k rows]). Its value space holds one slot of dh value rows per query head (the head's
    KV head), with that head's o_proj columns; when they do not fit they are projected onto the leading
    singular subspace of the stacked value rows (exact when they repeat one KV head). Unused key dims
    are zero; unused value dims are zero with the o_proj columns of `o_fill` (the layer's default init),
    so they add nothing at first but train (zero columns there would never get a gradient).
    """
    w = attention_weights(attn, hcfg)
    h, _, _, d = w.heads
    group = w.group
    wq, wk, wv, wo = w.q_HKD, w.k_GKD, w.v_GKD, w.o_DHK
    hg, kd, vd = hcfg.gdn_num_heads, hcfg.gdn_head_dim, hcfg.gdn_value_dim
    groups = gdn_head_groups(h, hg)
    # a base head used by several GDN heads (hg > h) shares its output projection among them
    uses = torch.bincount(torch.tensor([a for grp in groups for a in grp]), minlength=h).double()
    fill = o_fill.detach().double().view(d, hg, vd) if o_fill is not None else None
    qs, ks, vs, os_ = [], [], [], []
    for j, heads in enumerate(groups):
        q_cat = torch.cat([wq[a] for a in heads])  # [n*dh, D]
        k_cat = torch.cat([wk[a // group] for a in heads])
        if q_cat.shape[0] > kd:
            basis = _top_rows(torch.cat([q_cat, k_cat], dim=1), kd)
            q_cat, k_cat = basis @ q_cat, basis @ k_cat
        qs.append(fit_rows(q_cat, kd))
        ks.append(fit_rows(k_cat, kd))
        v_cat = torch.cat([wv[a // group] for a in heads])  # [n*dh, D]
        o_cat = torch.cat([wo[:, a] / uses[a] for a in heads], dim=1)  # [D, n*dh]
        if v_cat.shape[0] > vd:
            basis = _top_rows(v_cat, vd)
            v_cat, o_cat = basis @ v_cat, o_cat @ basis.T
        used = v_cat.shape[0]
        vs.append(fit_rows(v_cat, vd))
        o_j = fit_rows(o_cat.T, vd).T
        if fill is not None and used < vd:
            o_j[:, used:] = fill[:, j, used:]
        os_.append(o_j)
    return {
        "q_proj.weight": torch.stack(qs).reshape(hg * kd, d),
        "k_proj.weight": torch.stack(ks).reshape(hg * kd, d),
        "v_proj.weight": torch.stack(vs).reshape(hg * vd, d),
        "o_proj.weight": torch.stack(os_, dim=1).reshape(d, hg * vd),
    }


def identity_convs_(mixer: nn.Module) -> None:
    """Set the GDN mixer's short convolutions to identity (last tap 1), so they pass the copied projections."""
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(mixer, name, None)
        if conv is not None:
            _identity_conv_(conv)


def _identity_conv_(conv: nn.Module) -> None:
    w = conv.weight
    w.zero_()
    w[:, 0, -1] = 1.0
    if getattr(conv, "bias", None) is not None:
        conv.bias.zero_()

