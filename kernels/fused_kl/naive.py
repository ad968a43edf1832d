"""Reference KL(teacher || student) that materialises every [N, V] tensor; plain autograd does the rest.

This is what published distillation code does (`F.kl_div(log_softmax(s), softmax(t), 'batchmean')`)
and what the fused path is tested against. Differences from that one-liner, all deliberate:
* `mask`: masked tokens are dropped and "mean" divides by the number of unmasked tokens (with no
  mask, "mean" is exactly 'batchmean');
* temperature T divides both logits; the loss is NOT multiplied by T^2 (see README.md);
* logits are computed in fp32 (fp64 for fp64 inputs) whatever the input dtype;
* the top-k teacher is handled as a (k+1)-bucket distribution (README.md), built here densely.

Legend: N tokens, H student hidden, H' teacher hidden, V vocabulary, k top-k width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hylo.kernels.fused_kl.inputs import LogitsFn, Teacher, check_inputs, check_teacher_logits
from hylo.kernels.fused_kl.topk import TeacherTopK


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits and softmax run in fp64 for fp64 inputs, otherwise in fp32 (never bf16/fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def naive_kl_div(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    *,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_topk: TeacherTopK | tuple | None = None,
    teacher_logits_fn: LogitsFn | None = None,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """KL(teacher || student), materialising the full logits. Same arguments as `fused_linear_kl_div`.

    student_hidden: [N, H], student_weight: [V, H]; teacher_hidden: [N, H'], teacher_weight: [V, H'];
    teacher_topk: (logprobs [N, k], indices [N, k], tail_logmass [N] or None);
    teacher_logits_fn(i, j) -> [j - i, V] (called once with (0, N)); mask: [N] bool.
    Returns a scalar in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    where = "naive_kl_div"
    teacher, mask = check_inputs(
        where, student_hidden, student_weight, teacher_hidden, teacher_weight, teacher_topk,
        teacher_logits_fn, mask, temperature, reduction, None,
    )
    n_rows, vocab = student_hidden.shape[0], student_weight.shape[0]
    cdtype = compute_dtype(student_hidden.dtype)
    logits_NV = student_hidden.to(cdtype) @ student_weight.to(cdtype).t()
    logq_NV = F.log_softmax(logits_NV / temperature, dim=-1)

    if teacher.kind == "topk":
        kl_N = _topk_kl_dense(logq_NV, teacher.topk, temperature)
    else:
        teacher_NV = _teacher_logits(where, teacher, n_rows, vocab).to(cdtype)
        p_NV = F.softmax(teacher_NV / temperature, dim=-1)
        # The published reference, per token: F.kl_div(log_softmax(s), softmax(t)) summed over V.
        kl_N = F.kl_div(logq_NV, p_NV, reduction="none").sum(-1)

    if mask is not None:
        kl_N = kl_N[mask]
    total = kl_N.sum()
    if reduction == "sum":
        return total
    return total / max(kl_N.shape[0], 1)


@torch.no_grad()
def _teacher_logits(where: str, teacher: Teacher, n_rows: int, vocab: int) -> torch.Tensor:
    if teacher.kind == "hidden":
        cdtype = compute_dtype(teacher.hidden_NH.dtype)
        return teacher.hidden_NH.to(cdtype) @ teacher.weight_VH.to(cdtype).t()
    return check_teacher_logits(where, teacher.logits_fn(0, n_rows), 0, n_rows, vocab)


def _topk_kl_dense(logq_NV: torch.Tensor, topk: TeacherTopK, temperature: float) -> torch.Tensor:
    """(k+1)-bucket KL built densely: teacher top-k probs scattered into [N, V], student tail by masking."""
    logprobs_Nk, indices_Nk, tail_N = topk
    n_rows, vocab = logq_NV.shape
    k = logprobs_Nk.shape[1]
    cdtype = logq_NV.dtype
    idx_Nk = indices_Nk.long()
    # Teacher buckets at temperature T: p_i ∝ exp(lp_i / T), p_tail ∝ exp(tail / T), renormalised.
    with torch.no_grad():
        w_Nk = torch.exp(logprobs_Nk.to(cdtype) / temperature)
        if tail_N is not None and k < vocab:
            w_tail_N = torch.exp(tail_N.to(cdtype) / temperature)
        else:
            w_tail_N = torch.zeros(n_rows, dtype=cdtype, device=logq_NV.device)
        z_N = w_Nk.sum(-1) + w_tail_N
        p_Nk = w_Nk / z_N[:, None]
        p_tail_N = w_tail_N / z_N
        p_NV = torch.zeros(n_rows, vocab, dtype=cdtype, device=logq_NV.device).scatter_(1, idx_Nk, p_Nk)
        in_topk_NV = torch.zeros(n_rows, vocab, dtype=torch.bool, device=logq_NV.device)
        in_topk_NV.scatter_(1, idx_Nk, True)
    kl_N = F.kl_div(logq_NV, p_NV, reduction="none").sum(-1)
    if k == vocab:
        return kl_N
    # Student tail bucket: its probability outside the teacher's top-k.
    logq_tail_N = torch.logsumexp(logq_NV.masked_fill(in_topk_NV, float("-inf")), dim=-1)
    tail_term_N = torch.where(
        p_tail_N > 0, p_tail_N * (torch.log(p_tail_N) - logq_tail_N), torch.zeros_like(p_tail_N)
    )
    return kl_N + tail_term_N
