"""Chunked SSD (Mamba-2 state-space duality) scan in pure torch: the CPU path behind `chunk_ssd`.

Legend: B batch, T tokens, H heads, P head dim, G groups of B/C, N state size, S sequences,
L chunk length, Nc chunks, M = B * H (batch and heads flattened), Tp = Nc * L (padded length).
Internal tensors are chunk-major, `x_NcMLP`, so the state loop walks contiguous blocks; the
internal state is [N, P] per head (the external one is mamba_ssm's [P, N]).
The derivation is in README.md next to this file.

Design choices:
* Everything that does not depend on the carried state is computed for all chunks and heads at
  once: decay cumsums, the masked intra-chunk "attention" (C B^T * Gamma) X, each chunk's own state
  contribution, and after the loop the state-to-output term. Because the SSD decay is a scalar per
  head and token, the chunk-to-chunk recurrence is only S <- exp(gamma_L) S + dS: one fused
  multiply-add per chunk in the Python loop (Nc = T / L iterations).
* Varlen (`cu_seqlens`, checked under the packed-row rule of `hylo.kernels.varlen`; the layers pass the
  model's `DocBounds`, so the layout is built from host ints without reading the device): each
  sequence is scattered into its own run of chunks, its tail padded
  with dt = 0 and x = B = C = 0. A padded token then leaves the state untouched (decay exp(0) = 1,
  zero input), so a sequence's final state is the state after its last chunk, and the loop resets
  the state to the sequence's `initial_state` at its first chunk. No Python loop over tokens.
  The layout (`hylo.kernels.varlen`) is shared with the GDN scan.
* Exponentials are only taken of differences `gamma_i - gamma_j` with i >= j (masked to -inf above
  the diagonal before `exp`) or of `gamma_L - gamma_j <= 0`, so nothing overflows however large dt*|A|.
* B and C are expanded from G groups to H heads up front (head h reads group h // (H / G), as
  mamba_ssm); autograd sums the gradients back per group.
* Gradients come from autograd through these few large ops; no hand-written backward to maintain.
* fp16/bf16 inputs are computed in fp32, float64 stays float64 (tests). y has x's dtype, the final
  state is fp32 (float64 for float64 inputs), as mamba_ssm returns it.
* GPU tensors go to fla's `chunk_simple_gla` (`hylo.kernels.backend.use_fla`; the estimator's fake
  tensors to its stand-in, `hylo.kernels.fla_shapes`): SSD is simple GLA with
  q = C, k = B, v = dt * x, g = dt * A, scale 1, and fla's `state_v_first` layout is mamba_ssm's
  [P, N]. mamba_ssm is not a dependency: fla covers varlen with per-sequence initial/final states.
"""

from __future__ import annotations

import torch

from hylo.kernels.backend import fla_stand_in_for, fla_varlen_kwargs, kernel_call, use_fla
from hylo.kernels.checks import takes
from hylo.kernels.ssd.checks import SSDChunkArgs, heads_from_groups
from hylo.kernels.varlen import chunk_layout, from_chunks, to_chunks


@takes(SSDChunkArgs)
def torch_chunk_ssd(a: SSDChunkArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch chunked SSD scan; arguments and returns as `chunk_ssd`."""
    batch, T, H, P, G, N, S, bounds = a.check("chunk_ssd")
    chunk_size, D, initial_state = a.chunk_size, a.D, a.initial_state
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_ssd: chunk_size must be a positive int, got {chunk_size!r}")
    out_dtype, cd, x, dt, A, B, C = a.computed()

    lay = chunk_layout(T, chunk_size, bounds, x.device)
    L = lay.chunk_len
    xdt_NcMLP = to_chunks(x * dt[..., None], lay)
    B_NcMLN = to_chunks(heads_from_groups(B, H), lay)
    C_NcMLN = to_chunks(heads_from_groups(C, H), lay)
    a_NcML = to_chunks((dt * A)[..., None], lay)[..., 0]

    # in-chunk cumulative log decay; Gamma_ij = exp(gamma_i - gamma_j) for i >= j, else 0
    gam_NcML = a_NcML.cumsum(-1)
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    Gam_NcMLL = (gam_NcML[..., :, None] - gam_NcML[..., None, :]).masked_fill(~causal_LL, float("-inf")).exp()

    # each chunk's own contribution to the state at its end, and the whole-chunk decay
    Bdec_NcMLN = B_NcMLN * (gam_NcML[..., -1:] - gam_NcML).exp()[..., None]
    dS_NcMNP = Bdec_NcMLN.transpose(-1, -2) @ xdt_NcMLP
    decay_NcM11 = gam_NcML[..., -1].exp()[..., None, None]

    M = batch * H
    # external [S, H, P, N] -> internal [S, H, N, P]
    h0_SHNP = x.new_zeros(S, H, N, P) if initial_state is None else initial_state.to(cd).transpose(-1, -2)
    h_MNP = h0_SHNP.reshape(M, N, P) if bounds is None else h0_SHNP[0]
    states = []
    finals: list[torch.Tensor] = [h_MNP] * S
    # unbind, not indexing: the backward of Nc index ops would write Nc full-size zero tensors
    for n, (dS_MNP, decay_M11) in enumerate(zip(dS_NcMNP.unbind(0), decay_NcM11.unbind(0))):
        if bounds is not None and n in lay.first_chunk:
            h_MNP = h0_SHNP[lay.first_chunk[n]]
        states.append(h_MNP)
        h_MNP = torch.addcmul(dS_MNP, h_MNP, decay_M11)
        if n in lay.last_chunk:
            finals[lay.last_chunk[n]] = h_MNP

    s_NcMNP = torch.stack(states, 0)
    scores_NcMLL = (C_NcMLN @ B_NcMLN.transpose(-1, -2)) * Gam_NcMLL
    y_NcMLP = scores_NcMLL @ xdt_NcMLP + (C_NcMLN * gam_NcML.exp()[..., None]) @ s_NcMNP
    y = from_chunks(y_NcMLP, lay, batch, T, H)
    if D is not None:
        y = y + D.to(cd)[:, None] * x
    y = y.to(out_dtype)

    if not a.output_final_state:
        return y, None
    if bounds is None:
        return y, finals[0].reshape(batch, H, N, P).transpose(-1, -2)
    return y, torch.stack(finals, 0).transpose(-1, -2)


@takes(SSDChunkArgs)
def fla_chunk_ssd(a: SSDChunkArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSD through fla's `chunk_simple_gla` (Triton, GPU): q = C, k = B, v = dt x, g = dt A, scale 1; the
    estimator's stand-in for it where one is set (`hylo.kernels.backend.fla_stand_in_for`). `chunk_size` is
    not read: fla picks its own."""
    chunk_simple_gla = fla_stand_in_for(a.x, "chunk_simple_gla")
    if chunk_simple_gla is None:
        from fla.ops.simple_gla import chunk_simple_gla  # optional: fla

    _, _, H, *_, bounds = a.check("chunk_ssd")
    q, k, v, g = simple_gla_operands(a.x, a.dt, a.A, a.B, a.C, H)
    o, final = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=a.initial_state,
                                output_final_state=a.output_final_state,
                                # fla's value-first state [V, K] is mamba_ssm's [P, N]
                                state_v_first=True, **fla_varlen_kwargs(chunk_simple_gla, bounds))
    return with_skip(o, a.D, a.x), final


def simple_gla_operands(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SSD as fla's simple GLA (chunk and recurrent alike): q = C, k = B (groups to heads), v = dt x in x's
    dtype, g = dt A in fp32."""
    dt32 = dt.float()
    v = (x.float() * dt32[..., None]).to(x.dtype)
    return heads_from_groups(C, H).to(x.dtype), heads_from_groups(B, H).to(x.dtype), v, dt32 * A.float()


def with_skip(o: torch.Tensor, D: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """fla's output plus the D x skip (in fp32), in x's dtype."""
    if D is not None:
        o = o.float() + D.float()[:, None] * x.float()
    return o.to(x.dtype)


@kernel_call
@takes(SSDChunkArgs)
def chunk_ssd(a: SSDChunkArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2 SSD scan over a batch or a packed row (mamba_ssm's argument names and layouts).

    Per head h (group g = h // (H / G)), state [P, N]:
        h_t = exp(dt_t A_h) h_{t-1} + (dt_t x_t) B_t^T,    y_t = h_t C_t + D_h x_t.

    Args: `SSDChunkArgs` (x, dt, A, B, C, D=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, chunk_size=64).

    Returns:
        y: [B, T, H, P] in x's dtype; final_state: [S, H, P, N] or None.
    """
    x = a.x
    if fla_stand_in_for(x, "chunk_simple_gla") is not None or (isinstance(x, torch.Tensor) and use_fla(x)):
        return fla_chunk_ssd(**vars(a))
    return torch_chunk_ssd(**vars(a))
