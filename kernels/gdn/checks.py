"""The gated-delta-rule ops' arguments, written once (`GDNArgs` and its decode-step, packed-row and chunked
forms), their checks and small helpers shared by the chunked, recurrent and naive paths.

Every error names the function, the argument and the expected shape, so a caller with a wrong
layout (e.g. head-first tensors, or a state in fla's value-first layout) sees what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch

from hylo.kernels.checks import check_float_tensors, check_sequences, compute_dtype, shape_str
from hylo.kernels.varlen import DocBounds

DEFAULT_CHUNK_SIZE = 64


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


@dataclass
class GDNArgs:
    """The arguments every gated-delta-rule op starts with (fla 0.6's order and layouts; each op takes its form
    of them as its signature, `hylo.kernels.checks.takes`). B batch, T tokens, H heads, K key dim, V value dim.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] log decay (<= 0); beta: [B, T, H].
    scale: query scale, default K ** -0.5.
    initial_state: [N, H, K, V], N = B, or the number of sequences with `cu_seqlens`.
    output_final_state: also return the state after each sequence's last token.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False

    def check(self, fn: str) -> tuple[int, int, int, int, int, int, DocBounds | None]:
        """`check_inputs` of these arguments, errors named after op `fn`."""
        return check_inputs(fn, self.q, self.k, self.v, self.g, self.beta, self.scale, self.initial_state,
                            getattr(self, "cu_seqlens", None))

    def computed(self) -> tuple[torch.dtype, torch.dtype, float, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]:
        """(v's dtype, the compute dtype, the scale, q, k, v, g, beta in the compute dtype, q and k
        L2-normalised with `use_qk_l2norm_in_kernel`): fp16/bf16 inputs are computed in fp32, float64 stays
        float64."""
        dt = compute_dtype(self.q, self.v)
        q, k, v, g, beta = (x.to(dt) for x in (self.q, self.k, self.v, self.g, self.beta))
        if getattr(self, "use_qk_l2norm_in_kernel", False):
            q, k = l2norm(q), l2norm(k)
        scale = self.q.shape[-1] ** -0.5 if self.scale is None else self.scale
        return self.v.dtype, dt, scale, q, k, v, g, beta


@dataclass
class GDNStepArgs(GDNArgs):
    """`GDNArgs` of the decode step. use_qk_l2norm_in_kernel: L2-normalise q and k over K first (eps 1e-6,
    as fla)."""

    use_qk_l2norm_in_kernel: bool = False


@dataclass
class GDNRowArgs(GDNArgs):
    """`GDNArgs` over a batch or a packed row. cu_seqlens: [N + 1] int (starts at 0, ends at T, strictly
    increasing: the packed-row rule of `hylo.kernels.varlen`), or the model's `DocBounds`; B must be 1. State
    never crosses a boundary. use_qk_l2norm_in_kernel: as `GDNStepArgs`."""

    cu_seqlens: torch.Tensor | DocBounds | None = None
    use_qk_l2norm_in_kernel: bool = False


@dataclass
class GDNChunkArgs(GDNRowArgs):
    """`GDNRowArgs` with chunk_size: the chunk length of the torch path; fla's kernel gets it where it takes
    it (16, 32, 64), else 64 (the result does not depend on it; `gdn_chunk_size` is any positive int)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE

    def check_chunk_size(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_gated_delta_rule: chunk_size must be a positive int, got {self.chunk_size!r}")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: fla's convention (eps inside the root)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
