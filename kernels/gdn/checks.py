"""Argument checks and small helpers shared by the chunked path and the naive reference.

Every error names the function, the argument and the expected shape, so a caller with a wrong
layout (e.g. head-first tensors, or a state in fla's value-first layout) sees what to change.
"""

from __future__ import annotations

import torch


class GatedDeltaRuleInputError(ValueError):
    """Bad arguments to a gated-delta-rule op: the message names the argument and the expected form."""


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_inputs(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes/dtypes; return (B, T, H, K, V, N) with N the number of sequences."""

    def bad(msg: str) -> None:
        raise GatedDeltaRuleInputError(f"{fn}: {msg}")

    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            bad(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            bad(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.device != q.device:
            bad(f"{name} is on {x.device} but q is on {q.device}")
    if q.dim() != 4:
        bad(f"q must be [B, T, H, K], got shape {_shape(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        bad(f"k must have q's shape [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        bad(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V] (from q), got {_shape(v)}")
    V = v.shape[-1]
    for name in ("g", "beta"):
        x = named[name]
        if tuple(x.shape) != (B, T, H):
            bad(f"{name} must be [B, T, H] = [{B}, {T}, {H}] (from q), got {_shape(x)}")
    if T == 0 or K == 0 or V == 0 or H == 0 or B == 0:
        bad(f"empty input: q {_shape(q)}, v {_shape(v)}")
    if scale is not None and not scale > 0:
        bad(f"scale must be positive, got {scale}")

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            bad("cu_seqlens must be a 1-D integer tensor [N + 1] with at least two entries")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            bad(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        if B != 1:
            bad(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
        c = cu_seqlens.detach().cpu()
        if int(c[0]) != 0 or int(c[-1]) != T:
            bad(f"cu_seqlens must start at 0 and end at T={T}, got first {int(c[0])}, last {int(c[-1])}")
        if bool((c[1:] < c[:-1]).any()):
            bad(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
        N = c.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (N, H, K, V):
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            bad(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}] "
                f"(N = {'number of sequences in cu_seqlens' if cu_seqlens is not None else 'batch size'}), "
                f"got {got}")
        if initial_state.device != q.device:
            bad(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return B, T, H, K, V, N


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (tests), else float32 (fp16/bf16 inputs are upcast)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's convention (eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
