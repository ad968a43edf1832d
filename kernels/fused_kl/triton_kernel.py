"""Triton per-chunk steps of the fused KL: row logsumexp, KL and logit gradient over vocabulary tiles.

The matmuls stay in torch (`gemm.mm_f32`: bf16 tensor-core products with fp32 results, through cuBLAS /
hipBLASLt); the buffers here are fp32 whatever the inputs' dtype. What Triton fuses is the [C, V] work between them, which in torch
is a dozen passes. One program per row, streaming the row in BLOCK_V tiles:
* `_row_lse_kernel` (pass 1): per-lane running max / sum-exp of the tempered logits, folded into the
  row's logsumexp at the end; run on the student and on the teacher logits (dense), or on the student
  logits outside the top-k (top-k);
* `_dense_kl_kernel` (pass 2, dense): accumulates the KL and overwrites the student logits with the
  gradient grad_scale * (q - p), so the gradient needs no extra [C, V] buffer;
* `_tail_grad_kernel` (pass 2, top-k): outside the top-k the gradient is factor * exp(u - lse_out).
For top-k, torch gathers the k student logits at the teacher ids and sets those ids to -inf before the
launches (cheap: [C, k]); the [C, k + 1] bucket maths is `steps.bucket_kl`, shared with the torch step,
and torch scatters the k gradients back. Arithmetic is in the buffers' dtype (fp32, or fp64 for fp64
inputs). Temperature and grad scale come in through a small tensor so that fp64 runs are not rounded
to fp32 scalars.

Kernels are jitted lazily (`_kernels`) because Triton decides at decoration time whether to interpret
(TRITON_INTERPRET=1, the CPU test path) or compile; tests switch that per test. For the same reason a
kernel calls no jitted helper of ours (one jitted at import breaks under a later interpreter).

Legend: C rows (tokens) in the chunk, V vocabulary, k top-k width, B = k + 1 buckets.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from hylo.kernels.fused_kl.steps import StepParams, bucket_kl

# Largest vocabulary tile; tests lower it to exercise many tiles and a ragged last tile.
BLOCK_V_MAX = 2048


# Reductions go through tl.reduce with our own combine functions rather than tl.sum / tl.max: those
# are jitted when triton is imported, so they break under an interpreter switched on afterwards
# (the interpreter calls a combine function's Python body, which is why these two work).
@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


def _row_lse_kernel(X, LSE, PARAMS, V, stride, BLOCK_V: tl.constexpr, DTYPE: tl.constexpr):
    # LSE[row] = logsumexp_v X[row, v] / T; -inf for a row that is all -inf
    x_row = X + tl.program_id(0).to(tl.int64) * stride
    inv_temp = tl.load(PARAMS)
    neg_inf = float("-inf")
    m = tl.full([BLOCK_V], neg_inf, DTYPE)
    d = tl.full([BLOCK_V], 0.0, DTYPE)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + offs, mask=offs < V, other=neg_inf) * inv_temp
        m_new = tl.maximum(m, x)
        d = tl.where(m_new == neg_inf, 0.0, d * tl.exp(m - m_new) + tl.exp(x - m_new))
        m = m_new
    # Fold the lanes: lse = M + log(sum_lanes d * exp(m - M)); empty lanes (m = -inf) add nothing.
    row_m = tl.reduce(m, 0, _max_combine)
    empty = row_m == neg_inf
    lane = tl.where(m == neg_inf, 0.0, d * tl.exp(m - tl.where(empty, 0.0, row_m)))
    total = tl.reduce(lane, 0, _add_combine)
    tl.store(LSE + tl.program_id(0), tl.where(empty, neg_inf, row_m + tl.log(total)))


def _dense_kl_kernel(ZS, ZT, LSE_S, LSE_T, KL, PARAMS, V, stride_s, stride_t, BLOCK_V: tl.constexpr,
                     DTYPE: tl.constexpr, WRITE_GRAD: tl.constexpr):
    # KL terms p * (log p - log q) and, in place over ZS, the gradient grad_scale * (q - p)
    row = tl.program_id(0).to(tl.int64)
    zs_row = ZS + row * stride_s
    zt_row = ZT + row * stride_t
    inv_temp = tl.load(PARAMS)
    grad_scale = tl.load(PARAMS + 1)
    lse_s = tl.load(LSE_S + row)
    lse_t = tl.load(LSE_T + row)
    neg_inf = float("-inf")
    kl = tl.full([BLOCK_V], 0.0, DTYPE)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        logq = tl.load(zs_row + offs, mask=inside, other=neg_inf) * inv_temp - lse_s
        logp = tl.load(zt_row + offs, mask=inside, other=neg_inf) * inv_temp - lse_t
        p = tl.exp(logp)
        kl += tl.where(p > 0, p * (logp - logq), 0.0)
        if WRITE_GRAD:
            tl.store(zs_row + offs, grad_scale * (tl.exp(logq) - p), mask=inside)
    tl.store(KL + row, tl.reduce(kl, 0, _add_combine))


def _tail_grad_kernel(ZS, LSE_OUT, FACTOR, PARAMS, V, stride, BLOCK_V: tl.constexpr):
    # ZS[row, v] <- FACTOR[row] * exp(ZS[row, v] / T - LSE_OUT[row]); the top-k ids hold -inf and get 0
    row = tl.program_id(0).to(tl.int64)
    zs_row = ZS + row * stride
    inv_temp = tl.load(PARAMS)
    lse_out = tl.load(LSE_OUT + row)
    # no id outside the top-k (k = V): every entry is -inf, any finite shift gives 0
    lse_out = tl.where(lse_out == float("-inf"), 0.0, lse_out)
    factor = tl.load(FACTOR + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inside = offs < V
        u = tl.load(zs_row + offs, mask=inside, other=float("-inf")) * inv_temp
        tl.store(zs_row + offs, factor * tl.exp(u - lse_out), mask=inside)


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    # `interpret` is only the cache key: triton.jit reads TRITON_INTERPRET itself.
    del interpret
    return SimpleNamespace(lse=triton.jit(_row_lse_kernel), dense=triton.jit(_dense_kl_kernel),
                           tail_grad=triton.jit(_tail_grad_kernel))


def _get_kernels() -> SimpleNamespace:
    return _kernels(os.environ.get("TRITON_INTERPRET", "0") == "1")


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@functools.lru_cache(maxsize=32)
def _params(step: StepParams, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # One host-to-device copy per distinct (temperature, scale), not one per chunk: a copy from
    # pageable host memory synchronises the GPU. The kernels only read it.
    return torch.tensor([step.inv_temp, step.grad_scale], dtype=dtype, device=device)


def _check_buffer(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _TL_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"triton fused KL: {name} must be fp32/fp64 with unit last stride")


def _launch(kernel, x_CV: torch.Tensor, *args, **meta) -> None:
    """One program per row of x_CV, vocabulary tiles of up to BLOCK_V_MAX."""
    n_tokens, vocab = x_CV.shape
    block_v = min(BLOCK_V_MAX, triton.next_power_of_2(vocab))
    kernel[(n_tokens,)](*args, BLOCK_V=block_v, num_warps=8, **meta)


def _row_lse(x_CV: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    lse_C = torch.empty(x_CV.shape[0], dtype=x_CV.dtype, device=x_CV.device)
    _launch(_get_kernels().lse, x_CV, x_CV, lse_C, params, x_CV.shape[1], x_CV.stride(0),
            DTYPE=_TL_DTYPES[x_CV.dtype])
    return lse_C


def dense_kl_step(logits_CV: torch.Tensor, teacher_CV: torch.Tensor, teacher_owned: bool, step: StepParams,
                  workspace: object = None) -> torch.Tensor:
    """Same contract as `steps.dense_kl_step_torch` (teacher_CV is never modified here)."""
    del teacher_owned, workspace
    teacher_CV = teacher_CV.contiguous()
    _check_buffer("student logits", logits_CV)
    _check_buffer("teacher logits", teacher_CV)
    kl_C = torch.empty(logits_CV.shape[0], dtype=logits_CV.dtype, device=logits_CV.device)
    if logits_CV.shape[0] == 0:
        return kl_C
    params = _params(step, logits_CV.dtype, logits_CV.device)
    lse_s, lse_t = _row_lse(logits_CV, params), _row_lse(teacher_CV, params)
    _launch(_get_kernels().dense, logits_CV, logits_CV, teacher_CV, lse_s, lse_t, kl_C, params,
            logits_CV.shape[1], logits_CV.stride(0), teacher_CV.stride(0), DTYPE=_TL_DTYPES[logits_CV.dtype],
            WRITE_GRAD=step.need_grad)
    return kl_C


def topk_kl_step(logits_CV: torch.Tensor, indices_Ck: torch.Tensor, logp_CB: torch.Tensor, step: StepParams,
                 workspace: object = None) -> torch.Tensor:
    """Same contract as `steps.topk_kl_step_torch`."""
    del workspace
    _check_buffer("student logits", logits_CV)
    if logits_CV.shape[0] == 0:
        return torch.empty(0, dtype=logits_CV.dtype, device=logits_CV.device)
    params = _params(step, logits_CV.dtype, logits_CV.device)
    u_Ck = logits_CV.gather(1, indices_Ck).mul_(step.inv_temp)
    logits_CV.scatter_(1, indices_Ck, float("-inf"))
    lse_out_C = _row_lse(logits_CV, params)
    kl_C, grad_Ck, factor_C1 = bucket_kl(u_Ck, lse_out_C.unsqueeze(1), logp_CB.to(logits_CV.dtype), step)
    if step.need_grad:
        _launch(_get_kernels().tail_grad, logits_CV, logits_CV, lse_out_C, factor_C1.contiguous(), params,
                logits_CV.shape[1], logits_CV.stride(0))
        logits_CV.scatter_(1, indices_Ck, grad_Ck)
    return kl_C
