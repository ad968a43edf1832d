"""Argument checks and small helpers shared by the chunked path and the naive reference.

Every error names the function, the argument and the expected shape, so a caller with a wrong
layout (e.g. head-first tensors, or a state in fla's value-first layout) sees what to change.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from hylo.kernels.checks import check_float_tensors, check_sequences, shape_str
from hylo.kernels.varlen import DocBounds


class GatedDeltaRuleInputError(ValueError):
    """Bad arguments to a gated-delta-rule op: the message names the argument and the expected form."""


def check_inputs(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | DocBounds | None,
) -> tuple[int, int, int, int, int, int, DocBounds | None]:
    """Validate shapes/dtypes; return (B, T, H, K, V, N, bounds): N sequences, the packed row's
    checked boundaries (None without cu_seqlens)."""

    def bad(msg: str) -> NoReturn:
        raise GatedDeltaRuleInputError(f"{fn}: {msg}")

    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    check_float_tensors(bad, named, "q")
    if q.dim() != 4:
        bad(f"q must be [B, T, H, K], got shape {shape_str(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        bad(f"k must have q's shape [B, T, H, K] = {shape_str(q)}, got {shape_str(k)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        bad(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V] (from q), got {shape_str(v)}")
    V = v.shape[-1]
    for name in ("g", "beta"):
        x = named[name]
        if tuple(x.shape) != (B, T, H):
            bad(f"{name} must be [B, T, H] = [{B}, {T}, {H}] (from q), got {shape_str(x)}")
    if T == 0 or K == 0 or V == 0 or H == 0 or B == 0:
        bad(f"empty input: q {shape_str(q)}, v {shape_str(v)}")
    if scale is not None and not scale > 0:
        bad(f"scale must be positive, got {scale}")

    bounds, N = check_sequences(bad, cu_seqlens, B, T, initial_state, ("N", "H", "K", "V"), (H, K, V), "q", q.device)
    return B, T, H, K, V, N, bounds


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's convention (eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
