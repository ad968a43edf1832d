"""What every mixer converter reads first: one attention layer's projections, per head, in float64.

Legend: H query heads, G KV heads, K base head dim, D hidden size.

Qwen3's q/k RMSNorm weights are folded into the query / key rows for the linear blocks (exact for GDN,
which L2-normalises q and k; approximate for Mamba-2, whose SSD does not normalise B and C). MLA layers
with `mla_qk_norm` keep the norms instead (`fold_qk_norm=False` here, `qk_norm_weights`): folding the
weights alone drops the per-token division by the RMS, which MLA's bilinear scores do not undo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class AttentionWeights:
    q_HKD: torch.Tensor
    k_GKD: torch.Tensor
    v_GKD: torch.Tensor
    o_DHK: torch.Tensor

    @property
    def heads(self) -> tuple[int, int, int, int]:
        """(H, G, K, D)."""
        h, dh, d = self.q_HKD.shape
        return h, self.k_GKD.shape[0], dh, d

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q_HKD.shape[0] // self.k_GKD.shape[0]


def qk_norm_weights(attn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The q_norm / k_norm weights [K] of a Qwen3 attention module (float64), None where it has none."""
    qn = getattr(attn, "q_norm", None)
    kn = getattr(attn, "k_norm", None)
    return (qn.weight.detach().double() if qn is not None else None,
            kn.weight.detach().double() if kn is not None else None)


@torch.no_grad()
def attention_weights(attn: nn.Module, hcfg: Any, fold_qk_norm: bool = True) -> AttentionWeights:
    """The q/k/v/o projections of a Llama/Qwen3 attention module, split per head (float64; q/k norm weights
    folded into the rows unless `fold_qk_norm` is false)."""
    h, g, dh = hcfg.num_attention_heads, hcfg.num_key_value_heads, hcfg.base_head_dim or hcfg.head_dim
    wq = attn.q_proj.weight.detach().double().view(h, dh, -1)
    wk = attn.k_proj.weight.detach().double().view(g, dh, -1)
    wv = attn.v_proj.weight.detach().double().view(g, dh, -1)
    qw, kw = qk_norm_weights(attn) if fold_qk_norm else (None, None)
    if qw is not None:
        wq = wq * qw.double().view(1, dh, 1)
    if kw is not None:
        wk = wk * kw.double().view(1, dh, 1)
    d = wq.shape[-1]
    wo = attn.o_proj.weight.detach().double().view(d, h, dh)
    return AttentionWeights(wq, wk, wv, wo)


def fit_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Truncate or zero-pad the first dim of w to `rows`."""
    if w.shape[0] >= rows:
        return w[:rows]
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)
