"""Chunked (WY) gated delta rule in pure torch: the CPU path behind `chunk_gated_delta_rule`.

Legend: B batch, T tokens, H heads, K key head dim, V value head dim, N sequences, C chunk size,
Nc chunks, M = B * H (batch and heads flattened), Tp = Nc * C (padded length).
Internal tensors are chunk-major, `x_NcMCd`, so the state loop slices contiguous blocks.
The derivation is in README.md next to this file.

Design choices:
* Everything that does not depend on the running state is computed for all chunks and heads at
  once: decay cumsums, the intra-chunk triangular system (`U` and `W` together: the inverse of the
  unit lower-triangular matrix by block doubling, `unit_lower_inverse`, log2(C) batched products,
  then one product with both right-hand sides) and, after the loop, both output terms. Only the
  chunk-to-chunk state recurrence (two fused `baddbmm`s per chunk) is a Python loop, Nc = T / C
  iterations. (A batched `torch.linalg.solve_triangular` solves the Nc * M small systems one at a
  time on CPU: it was 8-14 % of a whole stage-2 step of the demo model, bench/estimate_check.py.)
* Varlen (`cu_seqlens`, checked under the packed-row rule of `hylo.kernels.varlen`; the layers pass the
  model's `DocBounds`, so the layout is built from host ints without reading the device): each
  sequence is scattered into its own run of chunks, its tail padded
  to C with g = 0, beta = 0, k = q = v = 0. A padded token then leaves the state untouched
  (decay exp(0) = 1, zero update), so a sequence's final state is the state after its last
  chunk, and the loop resets the state to the sequence's `initial_state` at its first chunk.
  One scatter and one gather per tensor; no Python loop over tokens. The layout
  (`hylo.kernels.varlen`) is shared with the SSD scan.
* Exponentials are only ever taken of differences `gamma_i - gamma_j` with i >= j (masked to
  -inf above the diagonal before `exp`), so nothing overflows however negative g gets.
* Gradients come from autograd through these few large ops: measured on 2 CPU cores it is
  already well inside the targets (bench/gdn.py), so no hand-written backward to maintain.
* fp16/bf16 inputs are computed in fp32; float64 stays float64 (tests). The output has v's dtype,
  the final state is fp32 (float64 for float64 inputs), like fla's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo.kernels.backend import fla_stand_in_for, fla_varlen_kwargs, kernel_call, use_fla
from hylo.kernels.checks import takes
from hylo.kernels.gdn.checks import DEFAULT_CHUNK_SIZE, GDNChunkArgs
from hylo.kernels.varlen import chunk_layout, from_chunks, to_chunks

# the chunk sizes fla's GDN kernel takes (it raises on any other); the result does not depend on it
FLA_CHUNK_SIZES = (16, 32, 64)


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + strict_tril(L))^-1 of a batch of square matrices [..., C, C] (the diagonal and upper part of L
    are not read), by block doubling: the inverse of [[A, 0], [B, D]] (unit lower-triangular blocks) is
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]], so starting from 1 x 1 blocks (identity) each of log2(C) steps
    doubles the diagonal blocks with two batched products. C is padded to a power of two with identity
    rows (exact: the padded inverse is block-diagonal). Differentiable (autograd through the products)."""
    C = L.shape[-1]
    P = 1 << (C - 1).bit_length()
    N = L.tril(-1)
    if P != C:
        N = F.pad(N, (0, P - C, 0, P - C))
    batch = N.shape[:-2]
    # the inverse's diagonal blocks of size s, [..., P / s, s, s]
    inv = N.new_ones(*batch, P, 1, 1)
    s = 1
    while s < P:
        n = P // (2 * s)
        # the lower-left s x s block of each diagonal 2s x 2s block of N
        B = N.reshape(*batch, n, 2 * s, n, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)[..., s:, :s]
        A_inv, D_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -(D_inv @ (B @ A_inv))
        inv = torch.cat([torch.cat([A_inv, torch.zeros_like(A_inv)], -1), torch.cat([lower, D_inv], -1)], -2)
        s *= 2
    return inv[..., 0, :C, :C]


@takes(GDNChunkArgs)
def torch_chunk_gated_delta_rule(a: GDNChunkArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure-torch chunked gated delta rule; arguments and returns as `chunk_gated_delta_rule`."""
    B, T, H, K, V, N, bounds = a.check("chunk_gated_delta_rule")
    a.check_chunk_size()
    out_dtype, dt, scale, q, k, v, g, beta = a.computed()
    chunk_size, initial_state = a.chunk_size, a.initial_state

    lay = chunk_layout(T, chunk_size, bounds, q.device)
    C = lay.chunk_len
    q_NcMCK = to_chunks(q * scale, lay)
    k_NcMCK = to_chunks(k, lay)
    v_NcMCV = to_chunks(v, lay)
    g_NcMC = to_chunks(g[..., None], lay)[..., 0]
    beta_NcMC = to_chunks(beta[..., None], lay)[..., 0]

    # in-chunk cumulative log decay; Gamma_ij = exp(gamma_i - gamma_j) for i >= j, else 0
    gam_NcMC = g_NcMC.cumsum(-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    Gam_NcMCC = (gam_NcMC[..., :, None] - gam_NcMC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()

    # WY representation: (I + strict_tril(diag(beta) K K^T * Gamma)) [U | W] = [beta V | beta K exp(gamma)]
    # (only the strict lower triangle of L is read)
    kk_NcMCC = k_NcMCK @ k_NcMCK.transpose(-1, -2)
    L_NcMCC = kk_NcMCC * Gam_NcMCC * beta_NcMC[..., :, None]
    rhs = torch.cat([v_NcMCV, k_NcMCK * gam_NcMC.exp()[..., None]], -1) * beta_NcMC[..., None]
    uw = unit_lower_inverse(L_NcMCC) @ rhs
    u_NcMCV, w_NcMCK = uw.split([V, K], -1)

    # state update operands: keys decayed to the chunk end, and the whole-chunk decay
    kdecT_NcMKC = (k_NcMCK * (gam_NcMC[..., -1:] - gam_NcMC).exp()[..., None]).transpose(-1, -2)
    decay_NcM11 = gam_NcMC[..., -1].exp()[..., None, None]

    M = B * H
    if initial_state is None:
        h0_NHKV = q.new_zeros(N, H, K, V)
    else:
        h0_NHKV = initial_state.to(dt)
    h_MKV = h0_NHKV.reshape(M, K, V) if bounds is None else h0_NHKV[0]
    states, vnews = [], []
    finals: list[torch.Tensor] = [h_MKV] * lay.n_seqs
    # unbind, not indexing: the backward of Nc index ops would write Nc full-size zero tensors
    loop_in = zip(u_NcMCV.unbind(0), w_NcMCK.unbind(0), decay_NcM11.unbind(0), kdecT_NcMKC.unbind(0))
    for n, (u_MCV, w_MCK, decay_M11, kdecT_MKC) in enumerate(loop_in):
        if n in lay.first_chunk and bounds is not None:
            h_MKV = h0_NHKV[lay.first_chunk[n]]
        states.append(h_MKV)
        # V' = U - W S: the values the chunk still has to write once the carried state is known
        vnew_MCV = torch.baddbmm(u_MCV, w_MCK, h_MKV, alpha=-1.0)
        vnews.append(vnew_MCV)
        h_MKV = torch.baddbmm(h_MKV * decay_M11, kdecT_MKC, vnew_MCV)
        if n in lay.last_chunk:
            finals[lay.last_chunk[n]] = h_MKV

    s_NcMKV = torch.stack(states, 0)
    vnew_NcMCV = torch.stack(vnews, 0)
    qk_NcMCC = (q_NcMCK @ k_NcMCK.transpose(-1, -2)) * Gam_NcMCC
    o_NcMCV = (q_NcMCK * gam_NcMC.exp()[..., None]) @ s_NcMKV + qk_NcMCC @ vnew_NcMCV
    o = from_chunks(o_NcMCV, lay, B, T, H).to(out_dtype)

    if not a.output_final_state:
        return o, None
    if bounds is None:
        return o, finals[0].reshape(B, H, K, V)
    return o, torch.stack(finals, 0)


@kernel_call
@takes(GDNChunkArgs)
def chunk_gated_delta_rule(a: GDNChunkArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a batch or a packed row; fla 0.6 argument order and layouts.

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T (state [K, V] per head),
    o_t = S_t^T (scale * q_t).

    Args: `GDNChunkArgs` (q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64).

    Returns:
        o: [B, T, H, V] in v's dtype; final_state: [N, H, K, V] or None.

    A compiled decoder block (`train.compile: blocks`) leaves this call out of its graph, as fla leaves its own
    (`kernel_call`: torch.compiler.disable once a block is compiled): it runs eagerly between the
    block's compiled parts, on the row's chunk layout
    made once per row from its host ints (`hylo.kernels.varlen.row_chunk_layout`, `row_varlen_tensors`).

    GPU tensors go to fla's Triton kernel (`hylo.kernels.backend.use_fla`; the estimator's fake tensors
    to its stand-in, `hylo.kernels.fla_shapes`), everything else to the pure-torch chunked path above.
    """
    stand_in = fla_stand_in_for(a.q, "chunk_gated_delta_rule")
    if stand_in is not None or (isinstance(a.q, torch.Tensor) and use_fla(a.q)):
        if stand_in is None:
            from fla.ops.gated_delta_rule import (  # optional: fla
                chunk_gated_delta_rule as fla_chunk_gated_delta_rule,
            )
        else:
            fla_chunk_gated_delta_rule = stand_in
        bounds = a.check("chunk_gated_delta_rule")[-1]
        a.check_chunk_size()
        chunk_size = a.chunk_size if a.chunk_size in FLA_CHUNK_SIZES else DEFAULT_CHUNK_SIZE
        return fla_chunk_gated_delta_rule(
            a.q, a.k, a.v, a.g, a.beta,
            scale=a.scale,
            initial_state=a.initial_state,
            output_final_state=a.output_final_state,
            use_qk_l2norm_in_kernel=a.use_qk_l2norm_in_kernel,
            chunk_size=chunk_size,
            **fla_varlen_kwargs(fla_chunk_gated_delta_rule, bounds, chunk_size),
        )
    return torch_chunk_gated_delta_rule(**vars(a))
