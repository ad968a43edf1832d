"""Argument checks shared by the chunked SSD scan and its step-by-step reference.

Every error names the function, the argument and the expected shape, so a caller with a wrong layout
(head-first tensors, B/C per head with the wrong group count, a state in the [N, P] orientation) sees
what to change.
"""

from __future__ import annotations

import torch


class SSDInputError(ValueError):
    """Bad arguments to an SSD op: the message names the argument and the expected form."""


def _shape(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_inputs(
    fn: str,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int, int]:
    """Validate shapes/dtypes; return (batch, T, H, P, G, N, S) with S the number of sequences."""

    def bad(msg: str) -> None:
        raise SSDInputError(f"{fn}: {msg}")

    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    if D is not None:
        named["D"] = D
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            bad(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != x.device:
            bad(f"{name} is on {t.device} but x is on {x.device}")
    if x.dim() != 4:
        bad(f"x must be [B, T, H, P], got shape {_shape(x)}")
    batch, T, H, P = x.shape
    if tuple(dt.shape) != (batch, T, H):
        bad(f"dt must be [B, T, H] = [{batch}, {T}, {H}] (from x), got {_shape(dt)}")
    if tuple(A.shape) != (H,):
        bad(f"A must be [H] = [{H}] (one decay rate per head), got {_shape(A)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, T):
        bad(f"B must be [B, T, G, N] = [{batch}, {T}, G, N] (from x), got {_shape(B)}")
    G, N = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        bad(f"C must have B's shape [B, T, G, N] = {_shape(B)}, got {_shape(C)}")
    if G == 0 or H % G:
        bad(f"the group count G={G} of B and C must divide the head count H={H}")
    if D is not None and tuple(D.shape) != (H,):
        bad(f"D must be [H] = [{H}], got {_shape(D)}")
    if T == 0 or P == 0 or N == 0 or H == 0 or batch == 0:
        bad(f"empty input: x {_shape(x)}, B {_shape(B)}")

    S = batch
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            bad("cu_seqlens must be a 1-D integer tensor [S + 1] with at least two entries")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            bad(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        if batch != 1:
            bad(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
        c = cu_seqlens.detach().cpu()
        if int(c[0]) != 0 or int(c[-1]) != T:
            bad(f"cu_seqlens must start at 0 and end at T={T}, got first {int(c[0])}, last {int(c[-1])}")
        if bool((c[1:] < c[:-1]).any()):
            bad(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
        S = c.numel() - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (S, H, P, N):
            got = _shape(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            bad(f"initial_state must be [S, H, P, N] = [{S}, {H}, {P}, {N}] "
                f"(S = {'number of sequences in cu_seqlens' if cu_seqlens is not None else 'batch size'}), "
                f"got {got}")
        if initial_state.device != x.device:
            bad(f"initial_state is on {initial_state.device} but x is on {x.device}")
    return batch, T, H, P, G, N, S


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (tests), else float32 (fp16/bf16 inputs are upcast)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def heads_from_groups(t_BTGN: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H / G), as mamba_ssm."""
    G = t_BTGN.shape[2]
    return t_BTGN if G == H else t_BTGN.repeat_interleave(H // G, dim=2)
