"""RMSNorm: the plain (un-gated) root-mean-square norm used by every HyLo layer, and its per-head form
for MLA's query / key (Qwen3's q_norm / k_norm).

Design choices:
* computed in fp32 whatever the input dtype, then cast back, so bf16 training matches the base
  Llama/Qwen norms (which also upcast) and the upcycled weights load with the same numerics;
* weight [D] only, no bias, initialised to ones; `eps` is added to the mean square, as Llama does.

* HeadRMSNorm normalises each head's [nope | rope] vector with one weight [E] shared by the heads. With
  `rope_key_groups` G > 1 (the converter's one block of the shared roped key per KV group) a head's mean
  runs over its nope dims and its group's block of the rope dims, the N + P/G dims of the base head it
  stands for; the other blocks are scaled by the same factor. With G = 1 it is a plain RMSNorm over E.

Legend: D normalised (last) dim; B batch, T tokens, H heads, N nope dims, P rope dims, E = N + P, G groups.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_D: torch.Tensor) -> torch.Tensor:
        dtype = x_D.dtype
        x32 = x_D.float() if dtype in (torch.float16, torch.bfloat16) else x_D
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Llama casts back before scaling by the weight; keep that order for identical upcycled numerics
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each head's [nope | rope] vector, weight [E] (see the module docstring for G > 1)."""

    def __init__(self, nope: int, rope: int, groups: int = 1, eps: float = 1e-6) -> None:
        super().__init__(nope + rope, eps=eps)
        if groups < 1 or rope % (2 * groups):
            raise ValueError(f"HeadRMSNorm: rope={rope} must be a multiple of 2 * groups (groups={groups})")
        self.nope, self.rope, self.groups = nope, rope, groups
        # the dims each head's mean runs over
        self.mean_dims = nope + rope // groups

    def inv_rms(self, nope_BTHN: torch.Tensor, pe_BTXP: torch.Tensor) -> torch.Tensor:
        """1 / RMS of each head's [nope | rope], [B, T, H] (fp32 for half inputs). `pe_BTXP` holds one rope
        part per head (X = H) or one shared by all heads (X = 1, MLA's shared key)."""
        H = nope_BTHN.shape[2]
        sq_BTH = _upcast(nope_BTHN).pow(2).sum(-1)
        pe_sq = _upcast(pe_BTXP).pow(2)
        if self.groups == 1:
            sq_BTH = sq_BTH + pe_sq.sum(-1)
        else:
            # rotate-half layout of G blocks: [reals of block 0..G-1 | imaginaries of block 0..G-1]
            G = self.groups
            blk_BTXG = pe_sq.unflatten(-1, (2, G, self.rope // (2 * G))).sum((-3, -1))
            grp_H = torch.arange(H, device=nope_BTHN.device) // (H // G)
            if blk_BTXG.shape[2] == 1:
                sq_BTH = sq_BTH + blk_BTXG[:, :, 0, grp_H]
            else:
                sq_BTH = sq_BTH + blk_BTXG.gather(-1, grp_H.view(1, 1, H, 1).expand(*blk_BTXG.shape[:3], 1))[..., 0]
        return torch.rsqrt(sq_BTH / self.mean_dims + self.eps)

    def scale(self, x_BTHX: torch.Tensor, inv_BTH: torch.Tensor, weight_X: torch.Tensor) -> torch.Tensor:
        """`weight * (x / RMS)`, cast back before the weight as RMSNorm does."""
        return weight_X * (_upcast(x_BTHX) * inv_BTH.unsqueeze(-1)).to(x_BTHX.dtype)

    def forward(self, x_BTHE: torch.Tensor) -> torch.Tensor:
        inv_BTH = self.inv_rms(x_BTHE[..., : self.nope], x_BTHE[..., self.nope:])
        return self.scale(x_BTHE, inv_BTH, self.weight)

    def extra_repr(self) -> str:
        return f"nope={self.nope}, rope={self.rope}, groups={self.groups}, eps={self.eps}"
