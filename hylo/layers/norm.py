"""RMSNorm: the plain (un-gated) root-mean-square norm used by every HyLo layer.

Design choices:
* computed in fp32 whatever the input dtype, then cast back, so bf16 training matches the base
  Llama/Qwen norms (which also upcast) and the upcycled weights load with the same numerics;
* weight [D] only, no bias, initialised to ones; `eps` is added to the mean square, as Llama does.

Legend: D normalised (last) dim.
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
