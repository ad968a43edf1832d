"""The per-chunk step of the fused KL: its contract, the top-k bucket maths, and the pure-torch steps.

A step gets one chunk of C rows: the student logits [C, V] (fp32, or fp64 for fp64 inputs) and the
teacher (logits [C, V], or top-k ids [C, k] with bucket log-probs [C, B]); it returns the per-row KL [C]
(unscaled) and, when `StepParams.need_grad`, overwrites the student logits with d(loss)/d(logits).
Two implementations keep this contract: the torch steps here (CPU, fallback) and the Triton steps in
`triton_kernel.py`; `chunked.py` picks one (`hylo.kernels.backend.use_gpu_kernels`). Both top-k steps
share `bucket_kl`, the [C, k + 1] part of the maths; only the [C, V] passes differ. Maths: README.md.

Legend: C rows in a chunk, V vocabulary, k top-k width, B = k + 1 teacher buckets (top-k plus tail).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class StepParams:
    """The same for every chunk of one call: 1 / T, the gradient's factor, whether to write it."""

    inv_temp: float
    # d(loss)/d(student logits) = grad_scale * (q - p): the loss's reduction weight times 1 / T
    grad_scale: float
    need_grad: bool


class Workspace:
    """[C, V] buffers reused by every chunk of one call.

    A fresh multi-megabyte CPU allocation is returned to the OS when freed and page-faulted in again
    (zeroed by the kernel) on the next chunk; reusing the buffers removes that cost. The peak is the
    same as allocating per chunk; the buffers live until the call returns.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.vocab, self.dtype, self.device = rows, vocab, dtype, device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = torch.empty(self.rows, self.vocab, dtype=self.dtype, device=self.device)
        return buf[:rows]


# (student logits [C, V], teacher logits [C, V], teacher logits may be overwritten, params, workspace)
DenseStep = Callable[[torch.Tensor, torch.Tensor, bool, StepParams, "Workspace | None"], torch.Tensor]
# (student logits [C, V], teacher top-k ids [C, k] int64, teacher bucket log-probs [C, B], params, workspace)
TopkStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepParams, "Workspace | None"], torch.Tensor]


def teacher_bucket_logprobs(
    logprobs_Ck: torch.Tensor, tail_C: torch.Tensor | None, inv_temp: float, vocab: int, dtype: torch.dtype
) -> torch.Tensor:
    """Teacher log-probs of the k+1 buckets at temperature T, renormalised: [C, k + 1] (tail last).

    The tail is -inf (zero mass) when absent or when k = V (no token lies outside the top-k).
    """
    n, k = logprobs_Ck.shape
    buckets_CB = torch.empty(n, k + 1, dtype=dtype, device=logprobs_Ck.device)
    buckets_CB[:, :k] = logprobs_Ck
    if tail_C is None or k == vocab:
        buckets_CB[:, k] = float("-inf")
    else:
        buckets_CB[:, k] = tail_C
    if inv_temp != 1.0:
        buckets_CB.mul_(inv_temp)
    return torch.log_softmax(buckets_CB, dim=-1)


def bucket_kl(
    u_Ck: torch.Tensor, lse_out_C1: torch.Tensor, logp_CB: torch.Tensor, step: StepParams
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(k+1)-bucket KL per row [C], the gradient at the top-k ids [C, k], and the factor [C, 1] that
    gives the gradient outside them, `factor * exp(u_v - lse_out)` (None, None without need_grad).

    u_Ck: the tempered student logits at the teacher's ids; lse_out_C1: logsumexp of the tempered
    logits outside them (-inf when k = V), both relative to the same shift. log Q_tail is
    lse_out - lse_all, never log(1 - sum), which cancels when the top-k hold almost all the mass.
    """
    k = u_Ck.shape[1]
    lse_all_C1 = torch.logaddexp(u_Ck.logsumexp(dim=-1, keepdim=True), lse_out_C1)
    logq_Ck = u_Ck - lse_all_C1
    logq_tail_C1 = lse_out_C1 - lse_all_C1
    logq_CB = torch.cat([logq_Ck, logq_tail_C1], dim=1)
    p_CB = logp_CB.exp()
    kl_C = torch.where(p_CB > 0, p_CB * (logp_CB - logq_CB), torch.zeros_like(p_CB)).sum(dim=-1)
    if not step.need_grad:
        return kl_C, None, None
    grad_Ck = (logq_Ck.exp() - p_CB[:, :k]).mul_(step.grad_scale)
    factor_C1 = (logq_tail_C1.exp() - p_CB[:, k:]).mul_(step.grad_scale)
    return kl_C, grad_Ck, factor_C1


def _scratch(workspace: Workspace | None, name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like) if workspace is None else workspace.get(name, like.shape[0])


def dense_kl_step_torch(logits_CV: torch.Tensor, teacher_CV: torch.Tensor, teacher_owned: bool, step: StepParams,
                        workspace: Workspace | None = None) -> torch.Tensor:
    """KL(softmax(t/T) || softmax(s/T)) per row; logits_CV <- grad_scale * (q - p) when need_grad.

    With s' = s/T - max, t' = t/T - max, Zs = sum exp(s'), Zt = sum exp(t'), e = exp(s'), r = exp(t'):
        KL = (r . t' - r . s') / Zt - log Zt + log Zs,     q - p = e / Zs - r / Zt.
    Everything is in place on logits_CV and the t' buffer (teacher_CV itself when `teacher_owned`)
    plus one buffer for r: three [C, V] buffers, about a dozen cheap passes (the row dot products
    go through the t' buffer as scratch: a bmm-based dot product is several times slower on CPU).
    Teacher logits must not hold -inf (the chunk loop clamps them: same zero probability).
    """
    t_max_C1 = teacher_CV.amax(dim=-1, keepdim=True)
    if teacher_owned:
        t_CV = teacher_CV.sub_(t_max_C1)
    else:
        t_CV = torch.sub(teacher_CV, t_max_C1, out=_scratch(workspace, "teacher", teacher_CV))
    if step.inv_temp != 1.0:
        t_CV.mul_(step.inv_temp)
    r_CV = torch.exp(t_CV, out=_scratch(workspace, "teacher_probs", t_CV))
    z_t_C = r_CV.sum(dim=-1)
    r_dot_t_C = t_CV.mul_(r_CV).sum(dim=-1)

    s_CV = logits_CV.sub_(logits_CV.amax(dim=-1, keepdim=True))
    if step.inv_temp != 1.0:
        s_CV.mul_(step.inv_temp)
    r_dot_s_C = torch.mul(r_CV, s_CV, out=t_CV).sum(dim=-1)
    del t_CV
    e_CV = s_CV.exp_()
    z_s_C = e_CV.sum(dim=-1)
    kl_C = (r_dot_t_C - r_dot_s_C) / z_t_C - z_t_C.log() + z_s_C.log()
    if step.need_grad:
        e_CV.mul_((step.grad_scale / z_s_C).unsqueeze(1))
        e_CV.addcmul_(r_CV, (-step.grad_scale / z_t_C).unsqueeze(1))
    return kl_C


def topk_kl_step_torch(logits_CV: torch.Tensor, indices_Ck: torch.Tensor, logp_CB: torch.Tensor, step: StepParams,
                       workspace: Workspace | None = None) -> torch.Tensor:
    """(k+1)-bucket KL per row against teacher bucket log-probs logp_CB [C, k + 1] (tail last).

    The student's sum outside the top-k is taken directly over those ids (`bucket_kl`). One [C, V]
    buffer, in place: the shifted tempered logits u, then exp(u) with the top-k ids zeroed, then the
    gradient.
    """
    u_CV = logits_CV.sub_(logits_CV.amax(dim=-1, keepdim=True))
    if step.inv_temp != 1.0:
        u_CV.mul_(step.inv_temp)
    u_Ck = u_CV.gather(1, indices_Ck)
    e_CV = u_CV.exp_()
    e_CV.scatter_(1, indices_Ck, 0.0)
    z_out_C1 = e_CV.sum(dim=-1, keepdim=True)
    kl_C, grad_Ck, factor_C1 = bucket_kl(u_Ck, z_out_C1.log(), logp_CB, step)
    if step.need_grad:
        if indices_Ck.shape[1] < logits_CV.shape[1]:
            # exp(u_v - lse_out) = e_v / z_out
            e_CV.mul_(factor_C1 / z_out_C1)
        e_CV.scatter_(1, indices_Ck, grad_Ck)
    return kl_C
