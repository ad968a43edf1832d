"""The SSD ops' arguments, written once (`SSDArgs` and its packed-row and chunked forms), and their checks.

Every error names the function, the argument and the expected shape, so a caller with a wrong layout
(head-first tensors, B/C per head with the wrong group count, a state in the [N, P] orientation) sees
what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from hylo.kernels.checks import check_float_tensors, check_sequences, compute_dtype, shape_str
from hylo.kernels.varlen import DocBounds

DEFAULT_CHUNK_SIZE = 64


class SSDInputError(ValueError):
    """Bad arguments to an SSD op: the message names the argument and the expected form."""


def check_inputs(
    fn: str,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | DocBounds | None,
) -> tuple[int, int, int, int, int, int, int, DocBounds | None]:
    """Validate shapes/dtypes; return (batch, T, H, P, G, N, S, bounds): S sequences, the packed
    row's checked boundaries (None without cu_seqlens)."""

    def bad(msg: str) -> NoReturn:
        raise SSDInputError(f"{fn}: {msg}")

    named = {"x": x, "dt": dt, "A": A, "B": B, "C": C}
    if D is not None:
        named["D"] = D
    check_float_tensors(bad, named, "x")
    if x.dim() != 4:
        bad(f"x must be [B, T, H, P], got shape {shape_str(x)}")
    batch, T, H, P = x.shape
    if tuple(dt.shape) != (batch, T, H):
        bad(f"dt must be [B, T, H] = [{batch}, {T}, {H}] (from x), got {shape_str(dt)}")
    if tuple(A.shape) != (H,):
        bad(f"A must be [H] = [{H}] (one decay rate per head), got {shape_str(A)}")
    if B.dim() != 4 or tuple(B.shape[:2]) != (batch, T):
        bad(f"B must be [B, T, G, N] = [{batch}, {T}, G, N] (from x), got {shape_str(B)}")
    G, N = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        bad(f"C must have B's shape [B, T, G, N] = {shape_str(B)}, got {shape_str(C)}")
    if G == 0 or H % G:
        bad(f"the group count G={G} of B and C must divide the head count H={H}")
    if D is not None and tuple(D.shape) != (H,):
        bad(f"D must be [H] = [{H}], got {shape_str(D)}")
    if T == 0 or P == 0 or N == 0 or H == 0 or batch == 0:
        bad(f"empty input: x {shape_str(x)}, B {shape_str(B)}")

    bounds, S = check_sequences(bad, cu_seqlens, batch, T, initial_state, ("S", "H", "P", "N"), (H, P, N),
                                "x", x.device)
    return batch, T, H, P, G, N, S, bounds


@dataclass
class SSDArgs:
    """The arguments of every SSD op (mamba_ssm's names and layouts; each op takes them as its signature,
    `hylo.kernels.checks.takes`). B batch, T tokens, H heads, P head dim, G groups of B/C, N state size.

    x: [B, T, H, P]; dt: [B, T, H] positive step (softplus and bias already applied);
    A: [H] negative decay rate; B, C: [B, T, G, N]; D: [H] skip weight or None.
    initial_state: [S, H, P, N], S = B, or the number of sequences with `cu_seqlens`.
    output_final_state: also return the state after each sequence's last token.
    """

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False

    def check(self, fn: str) -> tuple[int, int, int, int, int, int, int, DocBounds | None]:
        """`check_inputs` of these arguments, errors named after op `fn`."""
        return check_inputs(fn, self.x, self.dt, self.A, self.B, self.C, self.D, self.initial_state,
                            getattr(self, "cu_seqlens", None))

    def computed(self) -> tuple[torch.dtype, torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
        """(x's dtype, the compute dtype, x, dt, A, B, C in the compute dtype): fp16/bf16 inputs are computed
        in fp32, float64 stays float64."""
        cd = compute_dtype(self.x, self.dt, self.B, self.C)
        return (self.x.dtype, cd, *(t.to(cd) for t in (self.x, self.dt, self.A, self.B, self.C)))


@dataclass
class SSDRowArgs(SSDArgs):
    """`SSDArgs` over a batch or a packed row. cu_seqlens: [S + 1] int (starts at 0, ends at T, strictly
    increasing: the packed-row rule of `hylo.kernels.varlen`), or the model's `DocBounds`; B must be 1. State
    never crosses a boundary."""

    cu_seqlens: torch.Tensor | DocBounds | None = None


@dataclass
class SSDChunkArgs(SSDRowArgs):
    """`SSDRowArgs` with the chunk length of the torch path, chunk_size (fla picks its own)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE


def heads_from_groups(t_BTGN: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, G, N] -> [B, T, H, N]: head h reads group h // (H / G), as mamba_ssm."""
    G = t_BTGN.shape[2]
    return t_BTGN if G == H else t_BTGN.repeat_interleave(H // G, dim=2)
