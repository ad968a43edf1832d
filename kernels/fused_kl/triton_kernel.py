"""Triton per-chunk step of the fused KL: online softmax, KL and logit gradient over vocabulary tiles.

The matmuls stay in torch (cuBLAS); what Triton fuses is everything between them, which in torch is a
dozen passes over [C, V]. One program per row:
* pass 1 streams the row in BLOCK_V tiles and keeps per-lane running max / sum-exp (for student and
  teacher; for top-k, over the ids outside the top-k), folded into a logsumexp at the end;
* pass 2 streams again, accumulates the KL and overwrites the student logits with the gradient
  grad_scale * (q - p), so the gradient needs no extra [C, V] buffer.
For top-k, the k student logits at the teacher ids are gathered and those ids set to -inf by torch
before the launch (cheap: [C, k]); the kernel writes their gradients to a [C, k] buffer that torch
scatters back. Arithmetic is in the buffers' dtype (fp32, or fp64 for fp64 inputs). Temperature and
grad scale come in through a small tensor so that fp64 runs are not rounded to fp32 scalars.

Kernels are jitted lazily (`_kernels`) because Triton decides at decoration time whether to interpret
(TRITON_INTERPRET=1, the CPU test path) or compile; tests switch that per test.

Legend: C rows in the chunk, V vocabulary, k top-k width, B = k + 1 buckets.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

# Largest vocabulary tile; tests lower it to exercise many tiles and a ragged last tile.
BLOCK_V_MAX = 2048
BLOCK_K_MAX = 256


# Reductions go through tl.reduce with our own combine functions rather than tl.sum / tl.max: those
# are jitted when triton is imported, so they break under an interpreter switched on afterwards.
@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _dense_kl_kernel(
    ZS,
    ZT,
    KL,
    PARAMS,
    V,
    stride_s,
    stride_t,
    BLOCK_V: tl.constexpr,
    DTYPE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    zs_row = ZS + row * stride_s
    zt_row = ZT + row * stride_t
    inv_temp = tl.load(PARAMS)
    grad_scale = tl.load(PARAMS + 1)
    neg_inf = float("-inf")

    # Pass 1: per-lane online max / sum-exp of the tempered student and teacher logits.
    m_s = tl.full([BLOCK_V], neg_inf, DTYPE)
    d_s = tl.full([BLOCK_V], 0.0, DTYPE)
    m_t = tl.full([BLOCK_V], neg_inf, DTYPE)
    d_t = tl.full([BLOCK_V], 0.0, DTYPE)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        s = tl.load(zs_row + offs, mask=inside, other=neg_inf) * inv_temp
        t = tl.load(zt_row + offs, mask=inside, other=neg_inf) * inv_temp
        m_s_new = tl.maximum(m_s, s)
        empty_s = m_s_new == neg_inf
        d_s = tl.where(empty_s, 0.0, d_s * tl.exp(m_s - m_s_new) + tl.exp(s - m_s_new))
        m_s = m_s_new
        m_t_new = tl.maximum(m_t, t)
        empty_t = m_t_new == neg_inf
        d_t = tl.where(empty_t, 0.0, d_t * tl.exp(m_t - m_t_new) + tl.exp(t - m_t_new))
        m_t = m_t_new
    # Fold the lanes: lse = M + log(sum_lanes d * exp(m - M)); empty lanes (m = -inf) add nothing.
    row_m_s = tl.reduce(m_s, 0, _max_combine)
    lane_s = tl.where(m_s == neg_inf, 0.0, d_s * tl.exp(m_s - row_m_s))
    lse_s = row_m_s + tl.log(tl.reduce(lane_s, 0, _add_combine))
    row_m_t = tl.reduce(m_t, 0, _max_combine)
    lane_t = tl.where(m_t == neg_inf, 0.0, d_t * tl.exp(m_t - row_m_t))
    lse_t = row_m_t + tl.log(tl.reduce(lane_t, 0, _add_combine))

    # Pass 2: KL terms p * (log p - log q) and, in place, the gradient grad_scale * (q - p).
    kl = tl.full([BLOCK_V], 0.0, DTYPE)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        s = tl.load(zs_row + offs, mask=inside, other=neg_inf) * inv_temp
        t = tl.load(zt_row + offs, mask=inside, other=neg_inf) * inv_temp
        logq = s - lse_s
        logp = t - lse_t
        p = tl.exp(logp)
        kl += tl.where(p > 0, p * (logp - logq), 0.0)
        if WRITE_GRAD:
            tl.store(zs_row + offs, grad_scale * (tl.exp(logq) - p), mask=inside)
    tl.store(KL + row, tl.reduce(kl, 0, _add_combine))


def _topk_kl_kernel(
    ZS,
    ZK,
    LPB,
    DZK,
    KL,
    PARAMS,
    V,
    K,
    stride_s,
    stride_k,
    stride_b,
    stride_dk,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    # ZS [C, V]: student logits with the top-k ids set to -inf (overwritten by the gradient);
    # ZK [C, k]: student logits at the top-k ids; LPB [C, k + 1]: teacher bucket log-probs (tail last).
    row = tl.program_id(0).to(tl.int64)
    zs_row = ZS + row * stride_s
    zk_row = ZK + row * stride_k
    lpb_row = LPB + row * stride_b
    dzk_row = DZK + row * stride_dk
    inv_temp = tl.load(PARAMS)
    grad_scale = tl.load(PARAMS + 1)
    neg_inf = float("-inf")

    # Pass 1: logsumexp over the ids outside the top-k (-inf when k = V).
    m_o = tl.full([BLOCK_V], neg_inf, DTYPE)
    d_o = tl.full([BLOCK_V], 0.0, DTYPE)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        u = tl.load(zs_row + offs, mask=offs < V, other=neg_inf) * inv_temp
        m_new = tl.maximum(m_o, u)
        d_o = tl.where(m_new == neg_inf, 0.0, d_o * tl.exp(m_o - m_new) + tl.exp(u - m_new))
        m_o = m_new
    row_m_o = tl.reduce(m_o, 0, _max_combine)
    out_empty = row_m_o == neg_inf
    lane_o = tl.where(m_o == neg_inf, 0.0, d_o * tl.exp(m_o - tl.where(out_empty, 0.0, row_m_o)))
    sum_o = tl.reduce(lane_o, 0, _add_combine)
    lse_out = tl.where(out_empty, neg_inf, row_m_o + tl.log(sum_o))

    # Logsumexp over the top-k ids, then over everything.
    m_k = tl.full([BLOCK_K], neg_inf, DTYPE)
    d_k = tl.full([BLOCK_K], 0.0, DTYPE)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        u = tl.load(zk_row + offs, mask=offs < K, other=neg_inf) * inv_temp
        m_new = tl.maximum(m_k, u)
        d_k = tl.where(m_new == neg_inf, 0.0, d_k * tl.exp(m_k - m_new) + tl.exp(u - m_new))
        m_k = m_new
    row_m_k = tl.reduce(m_k, 0, _max_combine)
    lane_k = tl.where(m_k == neg_inf, 0.0, d_k * tl.exp(m_k - row_m_k))
    lse_in = row_m_k + tl.log(tl.reduce(lane_k, 0, _add_combine))
    m_all = tl.maximum(lse_in, lse_out)
    lse_all = m_all + tl.log(tl.exp(lse_in - m_all) + tl.exp(lse_out - m_all))

    # Bucket KL: the k top-k buckets, then the tail bucket.
    kl = tl.full([BLOCK_K], 0.0, DTYPE)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        inside = offs < K
        logq = tl.load(zk_row + offs, mask=inside, other=neg_inf) * inv_temp - lse_all
        logp = tl.load(lpb_row + offs, mask=inside, other=neg_inf)
        p = tl.exp(logp)
        kl += tl.where(p > 0, p * (logp - logq), 0.0)
        if WRITE_GRAD:
            tl.store(dzk_row + offs, grad_scale * (tl.exp(logq) - p), mask=inside)
    logp_tail = tl.load(lpb_row + K)
    p_tail = tl.exp(logp_tail)
    logq_tail = lse_out - lse_all
    kl_tail = tl.where(p_tail > 0, p_tail * (logp_tail - logq_tail), 0.0)
    tl.store(KL + row, tl.reduce(kl, 0, _add_combine) + kl_tail)

    # Pass 2: outside the top-k, d/du = exp(u - lse_out) * (q_tail - p_tail); the top-k ids hold -inf
    # here and get 0, torch scatters their gradient from DZK afterwards.
    if WRITE_GRAD:
        coef = grad_scale * (tl.exp(logq_tail) - p_tail)
        lse_out_safe = tl.where(out_empty, 0.0, lse_out)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            inside = offs < V
            u = tl.load(zs_row + offs, mask=inside, other=neg_inf) * inv_temp
            tl.store(zs_row + offs, coef * tl.exp(u - lse_out_safe), mask=inside)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    # `interpret` is only the cache key: triton.jit reads TRITON_INTERPRET itself.
    del interpret
    return SimpleNamespace(dense=triton.jit(_dense_kl_kernel), topk=triton.jit(_topk_kl_kernel))


def _get_kernels() -> SimpleNamespace:
    return _kernels(os.environ.get("TRITON_INTERPRET", "0") == "1")


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def _params(x: torch.Tensor, inv_temp: float, grad_scale: float) -> torch.Tensor:
    return _params_on(inv_temp, grad_scale, x.dtype, x.device)


@functools.lru_cache(maxsize=32)
def _params_on(inv_temp: float, grad_scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # One host-to-device copy per distinct (temperature, scale), not one per chunk: a copy from
    # pageable host memory synchronises the GPU. The kernels only read it.
    return torch.tensor([inv_temp, grad_scale], dtype=dtype, device=device)


def _check_buffer(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _TL_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"triton fused KL: {name} must be fp32/fp64 with unit last stride")


def dense_kl_step(
    logits_CV: torch.Tensor,
    teacher_CV: torch.Tensor,
    teacher_owned: bool,
    grad_scale: float,
    inv_temp: float,
    need_grad: bool,
    workspace: object = None,
) -> torch.Tensor:
    """Same contract as `chunked.dense_kl_step_torch` (teacher_CV is never modified here)."""
    del teacher_owned, workspace
    teacher_CV = teacher_CV.contiguous()
    _check_buffer("student logits", logits_CV)
    _check_buffer("teacher logits", teacher_CV)
    n_rows, vocab = logits_CV.shape
    kl_C = torch.empty(n_rows, dtype=logits_CV.dtype, device=logits_CV.device)
    if n_rows == 0:
        return kl_C
    block_v = min(BLOCK_V_MAX, triton.next_power_of_2(vocab))
    _get_kernels().dense[(n_rows,)](
        logits_CV,
        teacher_CV,
        kl_C,
        _params(logits_CV, inv_temp, grad_scale),
        vocab,
        logits_CV.stride(0),
        teacher_CV.stride(0),
        BLOCK_V=block_v,
        DTYPE=_TL_DTYPES[logits_CV.dtype],
        WRITE_GRAD=need_grad,
        num_warps=8,
    )
    return kl_C


def topk_kl_step(
    logits_CV: torch.Tensor,
    indices_Ck: torch.Tensor,
    logp_CB: torch.Tensor,
    grad_scale: float,
    inv_temp: float,
    need_grad: bool,
    workspace: object = None,
) -> torch.Tensor:
    """Same contract as `chunked.topk_kl_step_torch`."""
    del workspace
    _check_buffer("student logits", logits_CV)
    n_rows, vocab = logits_CV.shape
    k = indices_Ck.shape[1]
    kl_C = torch.empty(n_rows, dtype=logits_CV.dtype, device=logits_CV.device)
    if n_rows == 0:
        return kl_C
    logits_Ck = logits_CV.gather(1, indices_Ck)
    logits_CV.scatter_(1, indices_Ck, float("-inf"))
    logp_CB = logp_CB.to(logits_CV.dtype).contiguous()
    grad_Ck = torch.empty_like(logits_Ck)
    block_v = min(BLOCK_V_MAX, triton.next_power_of_2(vocab))
    block_k = min(BLOCK_K_MAX, triton.next_power_of_2(k))
    _get_kernels().topk[(n_rows,)](
        logits_CV,
        logits_Ck,
        logp_CB,
        grad_Ck,
        kl_C,
        _params(logits_CV, inv_temp, grad_scale),
        vocab,
        k,
        logits_CV.stride(0),
        logits_Ck.stride(0),
        logp_CB.stride(0),
        grad_Ck.stride(0),
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        DTYPE=_TL_DTYPES[logits_CV.dtype],
        WRITE_GRAD=need_grad,
        num_warps=8,
    )
    if need_grad:
        logits_CV.scatter_(1, indices_Ck, grad_Ck)
    return kl_C
