"""fla's chunk kernels as the estimator prices them: their allocations and saved tensors, without their arithmetic.

`hylo estimate` runs the step on fake tensors (pipeline/estimate/), where the GPU path's fla calls cannot run.
Our torch scans (`kernels/gdn/chunk.py`, `kernels/ssd/chunk.py`) keep every chunk's intermediates for
autograd, which fla's kernels recompute in the backward: priced with them, a GDN layer held several times what
it holds on a GPU. The two autograd functions here stand in for fla 0.6's `ChunkGatedDeltaRuleFunction`
(`fla.ops.gated_delta_rule.chunk_gated_delta_rule`) and `ChunkSimpleGLAFunction` (`fla.ops.simple_gla.
chunk_simple_gla`, the Mamba-2 scan) for the arguments our GPU path passes: each allocates, in fla's order and
with fla's shapes and dtypes, what fla's Python code allocates around its Triton launches (outputs, the
chunk states `h`, the WY tensors `w` / `u` / `A`, the fp32 gate cumsums, the backward's `dh`, `dv`, ...), keeps
each alive as long as fla's code holds it, and saves for the backward exactly what fla saves
(`ctx.save_for_backward`). `input_guard`'s contiguous copies of strided inputs are made too. Values are never
computed (the tensors are fake); tests/kernels/test_fla_shapes.py checks the saved tensors and the outputs
against fla's own functions run under the Triton interpreter.

Where fla's sizes depend on the GPU they follow an H100 / H200 (Hopper): `chunk_bwd_dqkwg`'s key block
`BK = min(next_pow2(K), 128)`. The FLOPs are those of the kernels' matrix products (2 m n k each, at the
operands' dtype, elementwise work not counted, as torch's formulas count), reported to `count(flops, dtype)`.

Only the estimator selects these (`hylo.kernels.backend.fla_stand_in`), and only for fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# fla's chunk length for the simple-GLA kernel (our SSD passes none) and its GDN chunk lengths
SIMPLE_GLA_CHUNK = 64
HOPPER_TILING = 128

Counter = Callable[[int, torch.dtype], None]


def _contiguous(*xs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """fla's `input_guard`: every tensor argument contiguous (a copy where it is strided)."""
    return [x.contiguous() if isinstance(x, torch.Tensor) else x for x in xs]


def _chunks(T: int, BT: int, cu_seqlens_cpu: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> tuple[int, int]:
    """(sequences N, chunks NT) as fla counts them: ceil(T / BT), or the sum over documents."""
    if cu_seqlens is None:
        return 0, math.ceil(T / BT)
    src = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    lens = [b - a for a, b in zip(src.tolist()[:-1], src.tolist()[1:])]
    return len(lens), sum(math.ceil(n / BT) for n in lens)


def _chunk_indices(cu_seqlens: torch.Tensor | None, NT: int) -> torch.Tensor | None:
    # prepare_chunk_indices: [NT, 2] of cu_seqlens' dtype, on its device
    return None if cu_seqlens is None else cu_seqlens.new_empty(NT, 2)


def gdn_flops(B: int, T: int, H: int, K: int, V: int, BT: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of fla's chunked gated delta rule: the matrix products of its kernels.

    Forward: k k^T, the triangular inverse (BT^3 / 3 multiply-adds a chunk), w and u, the state pass (W S and
    K^T V' a chunk), the output (q S, q k^T, P V'). Backward: w, u and the states again, dv_local, the state
    gradients (q^T dO, W^T dV, K dH), dq / dk / dw / ds, and the WY backward."""
    n = B * H * T
    fwd = n * (2 * BT * K + 2 * BT * BT / 3 + 2 * BT * K + 2 * BT * V + 4 * K * V + 2 * K * V + 2 * BT * K + 2 * BT * V)
    bwd = n * (2 * BT * K + 2 * BT * V + 4 * K * V  # w, u, h recomputed
               + 2 * BT * K + 2 * BT * V  # dv_local
               + 6 * K * V  # dh, dv
               + 6 * K * V + 4 * BT * K + 2 * BT * V  # dq, dk, dw, ds
               + 4 * BT * K + 4 * BT * V + 4 * BT * BT / 3)  # WY backward
    return int(fwd), int(bwd)


def simple_gla_flops(B: int, T: int, H: int, K: int, V: int, BT: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of fla's chunked simple GLA: states K^T V, output q S + (q k^T) V; backward:
    states again, dh, dq / dk / ds, dv."""
    n = B * H * T
    fwd = n * (2 * K * V + 2 * K * V + 2 * BT * K + 2 * BT * V)
    bwd = n * (2 * K * V + 2 * K * V + 4 * K * V + 4 * BT * K + 2 * BT * V + 2 * K * V + 2 * BT * V + 2 * BT * K)
    return int(fwd), int(bwd)


class ChunkGatedDeltaRuleShapes(torch.autograd.Function):
    """fla 0.6's `ChunkGatedDeltaRuleFunction` (state K-first, gate and beta given, no context parallelism)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                use_qk_l2norm_in_kernel, chunk_size, count):  # type: ignore[override]
        q, k, v, g, beta, initial_state, cu_seqlens = _contiguous(q, k, v, g, beta, initial_state, cu_seqlens)
        B, T, H, K = k.shape
        V = v.shape[-1]
        BT = chunk_size
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:  # l2norm_fwd: y like x, rstd fp32 per row
            q, q_rstd = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
            k, k_rstd = torch.empty_like(k), k.new_empty(k.shape[:-1], dtype=torch.float32)
        N, NT = _chunks(T, BT, cu_seqlens_cpu, cu_seqlens)
        N = N or B
        chunk_indices = _chunk_indices(cu_seqlens, NT)
        g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum
        # chunk_gated_delta_rule_fwd_intra: A (fused kkt + solve at 64, else fp32 kkt then solve), w, u
        if BT == 64:
            A = k.new_zeros(B, T, H, BT)
        else:
            A32 = k.new_empty(B, T, H, BT, dtype=torch.float32)
            A = torch.empty_like(A32, dtype=k.dtype)
            del A32
        w, u = k.new_empty(B, T, H, K), torch.empty_like(v)
        # chunk_gated_delta_rule_fwd_h: the chunk states, the final state, the new values
        h = k.new_empty(B, NT, H, K, V)
        final_state = k.new_zeros(N, H, K, V, dtype=torch.float32) if output_final_state else None
        v_new = torch.empty_like(u)
        o = torch.empty_like(v_new)  # chunk_fwd_o
        del w, u, h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, beta, A, initial_state, cu_seqlens, chunk_indices)
        ctx.shape = (B, T, H, K, V, BT, NT)
        ctx.l2norm, ctx.count = use_qk_l2norm_in_kernel, count
        if count is not None:
            count(gdn_flops(B, T, H, K, V, BT)[0], k.dtype)
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        do, dht = _contiguous(do, dht)
        q, q_rstd, k, k_rstd, v, g, beta_raw, beta, A, initial_state, _cu, _ci = ctx.saved_tensors
        B, T, H, K, V, BT, NT = ctx.shape
        w, u = k.new_empty(B, T, H, K), torch.empty_like(v)  # recompute_w_u_fwd
        h, v_new = k.new_empty(B, NT, H, K, V), torch.empty_like(u)  # chunk_gated_delta_rule_fwd_h
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        # chunk_gated_delta_rule_bwd_dhu
        dh = q.new_empty(B, NT, H, K, V)
        dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
        dv = torch.empty_like(dv)
        # chunk_bwd_dqkwg (dg per key block, summed on return)
        NK = math.ceil(K / min(max(1 << (K - 1).bit_length(), 16), HOPPER_TILING))
        dq, dk = q.new_empty(B, T, H, K), k.new_empty(B, T, H, K)
        dg_k = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device)
        dw = torch.empty_like(w)
        dg = dg_k.sum(0)
        del dg_k
        # prepare_wy_repr_bwd
        dk2, dv, dg2, db = k.new_empty(B, T, H, K), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = torch.empty_like(dg, dtype=torch.float32)  # the reverse chunk_local_cumsum
        del w, u, h, v_new, dh, dw, dk2, dg2
        if ctx.l2norm:  # l2norm_bwd: dx like y, one after the other
            dq = torch.empty_like(q)
            dk = torch.empty_like(k)
        if ctx.count is not None:
            ctx.count(gdn_flops(B, T, H, K, V, BT)[1], k.dtype)
        return (dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta_raw), None, dh0, None, None, None, None, None,
                None)


class ChunkSimpleGLAShapes(torch.autograd.Function):
    """fla 0.6's `ChunkSimpleGLAFunction` (a per-token gate g, no g_gamma)."""

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens,
                cu_seqlens_cpu, chunk_size, count):  # type: ignore[override]
        q, k, v, g, initial_state, cu_seqlens = _contiguous(q, k, v, g, initial_state, cu_seqlens)
        BT = chunk_size or SIMPLE_GLA_CHUNK
        B, T, H, K = k.shape
        V = v.shape[-1]
        N, NT = _chunks(T, BT, cu_seqlens_cpu, cu_seqlens)
        N = N or B
        chunk_indices = _chunk_indices(cu_seqlens, NT)
        g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum
        state = (V, K) if state_v_first else (K, V)
        h = k.new_empty(B, NT, H, *state)  # chunk_fwd_h, states in k's dtype
        ht = k.new_empty(N, H, *state, dtype=torch.float32) if output_final_state else None
        o = torch.empty_like(v)  # chunk_fwd_o
        del h
        ctx.save_for_backward(q, k, v, g, None, initial_state, chunk_indices)
        ctx.shape, ctx.count = (B, T, H, K, V, BT, NT, state), count
        if count is not None:
            count(simple_gla_flops(B, T, H, K, V, BT)[0], k.dtype)
        return o.to(q.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        do, dht = _contiguous(do, dht)
        q, k, v, g, _gamma, initial_state, _ci = ctx.saved_tensors
        B, T, H, K, V, BT, NT, state = ctx.shape
        h = k.new_empty(B, NT, H, *state, dtype=torch.float32)  # chunk_fwd_h, fp32 states
        dh = k.new_empty(B, NT, H, *state, dtype=torch.float32)  # chunk_bwd_dh
        dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
        NK = math.ceil(K / min(max(1 << (K - 1).bit_length(), 16), HOPPER_TILING))
        dq, dk = q.new_empty(B, T, H, K), k.new_empty(B, T, H, K)  # chunk_bwd_dqkwg
        dg_k = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device)
        dg = dg_k.sum(0)
        del dg_k
        dv = torch.empty_like(do)  # chunk_bwd_dv
        del h, dh
        dg = torch.empty_like(dg, dtype=torch.float32).to(g)  # the reverse chunk_local_cumsum
        if ctx.count is not None:
            ctx.count(simple_gla_flops(B, T, H, K, V, BT)[1], k.dtype)
        return dq.to(q), dk.to(k), dv.to(v), dg, None, dh0, None, None, None, None, None, None


class FlaShapes:
    """The stand-in for fla's two functions our GPU path calls, with fla's signatures (the arguments we pass):
    `chunk_gated_delta_rule` and `chunk_simple_gla`. `count(flops, dtype)` receives each pass's FLOPs."""

    def __init__(self, count: Counter | None = None) -> None:
        self.count = count

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_size=64):
        if chunk_size not in (16, 32, 64):
            raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        return ChunkGatedDeltaRuleShapes.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                               cu_seqlens_cpu, use_qk_l2norm_in_kernel, chunk_size, self.count)

    def chunk_simple_gla(self, q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=None):
        if g is None:
            raise ValueError("the simple-GLA stand-in models a per-token gate g (our Mamba-2 scan's)")
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        return ChunkSimpleGLAShapes.apply(q, k, v, g, scale, initial_state, output_final_state, state_v_first,
                                          cu_seqlens, cu_seqlens_cpu, chunk_size, self.count)
