"""The matrix products of the fused losses: operands in their input dtype, fp32 accumulation, fp32 result.

Design choices:
* `mm_f32` is the one place every product of the loss goes through (student and teacher logits, and the
  two gradient products). bf16 / fp16 operands are multiplied as they are, on tensor cores, with fp32
  accumulation and an fp32 result: `torch.addmm(..., out_dtype=torch.float32)` (cuBLAS / hipBLASLt;
  an fp32 accumulator as `self` needs torch >= 2.10). fp32 and fp64 operands take the usual product.
* CPU has no bf16 x bf16 -> fp32 kernel (torch 2.13: `aten::mm.dtype` is not registered for CPU). There the
  operands are upcast to fp32 first: the same arithmetic, because the product of two bf16 (or fp16)
  numbers is exact in fp32; only the order of the fp32 additions differs. Fake tensors (the step
  estimate) take the accelerator's call, so the estimate sees the products in their real dtype.
* `split_operands` turns the fp32 logit gradient into the operands of the two gradient products:
  one rounding to the input dtype (`fast`), or a hi + lo pair whose sum is the gradient to about 2^-16
  relative (`accurate`, the default). Each half is one product; their results add in fp32.

Legend: C rows of a chunk, V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

PRECISIONS = ("accurate", "fast")
LOW_PRECISION = (torch.bfloat16, torch.float16)
# fp16 has a narrow exponent range: the step writes (q - p) * 2^14 (|q - p| <= 1, so at most 16,384 of
# fp16's 65,504) and the products' alpha takes the true factor back out, so small gradients do not
# flush to zero. bf16 has fp32's range and needs no shift.
SPLIT_SHIFT = {torch.bfloat16: 1.0, torch.float16: 2.0**14}


def mm_f32(a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor, *, accumulate: bool = False,
           alpha: float = 1.0) -> torch.Tensor:
    """out <- alpha * a @ b (+ out when `accumulate`), in fp32 (fp64 for fp64 operands); a and b share a dtype.

    bf16 / fp16 operands: their products summed in fp32 (tensor cores), never rounded to the input dtype."""
    if a_MK.dtype in LOW_PRECISION:
        if a_MK.device.type != "cpu" or is_fake(a_MK):
            if not accumulate and alpha == 1.0:
                return torch.mm(a_MK, b_KN, out_dtype=torch.float32, out=out_MN)
            return torch.addmm(out_MN, a_MK, b_KN, beta=1 if accumulate else 0, alpha=alpha,
                               out_dtype=torch.float32, out=out_MN)
        # CPU: no native kernel; exact upcast, then the fp32 product (the module docstring)
        a_MK, b_KN = a_MK.float(), b_KN.float()
    if accumulate:
        return out_MN.addmm_(a_MK, b_KN, alpha=alpha)
    torch.mm(a_MK, b_KN, out=out_MN)
    return out_MN if alpha == 1.0 else out_MN.mul_(alpha)


def split_operands(grad_CV: torch.Tensor, dtype: torch.dtype, precision: str,
                   scratch_CV: torch.Tensor) -> list[torch.Tensor]:
    """The fp32 gradient [C, V] as operands of `dtype` for the gradient products: [hi] (`fast`) or [hi, lo]
    (`accurate`), hi = grad rounded to `dtype`, lo = (grad - hi) rounded to `dtype`.

    `scratch_CV`: an fp32 [C, V] buffer whose bytes hold both halves (viewed as [C, 2V] of `dtype`), so the
    split allocates nothing. `grad_CV` is overwritten (with grad - hi) in accurate mode."""
    vocab = grad_CV.shape[1]
    halves = scratch_CV.view(dtype)
    hi_CV = halves[:, :vocab].copy_(grad_CV)
    if precision == "fast":
        return [hi_CV]
    lo_CV = halves[:, vocab:].copy_(grad_CV.sub_(hi_CV))
    return [hi_CV, lo_CV]
