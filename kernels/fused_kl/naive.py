"""References for the LM-head losses: plain torch, every [N, V] tensor materialised, autograd does the rest.

They stand alone (nothing of the fast path is imported, inputs are taken as given and not checked),
so that the tests compare two independent computations. `naive_kl_div` is what published
distillation code does (`F.kl_div(log_softmax(s), softmax(t), 'batchmean')`), with these deliberate
differences (README.md): `mask` drops tokens and "mean" divides by the unmasked ones; temperature T
divides both logits (its convention: README.md, "The loss"); logits are fp32 (fp64 for fp64 inputs);
a top-k teacher is a distribution over its k ids plus, with a tail, one bucket for everything else.

Legend: N tokens, H student hidden, H' teacher hidden, V vocabulary, k top-k width, B buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def naive_kl_div(student_hidden: Tensor, student_weight: Tensor, *, teacher_hidden: Tensor | None = None,
                 teacher_weight: Tensor | None = None, teacher_topk: tuple | None = None,
                 teacher_logits_fn: Callable[[int, int], Tensor] | None = None, mask: Tensor | None = None,
                 temperature: float = 1.0, reduction: str = "mean") -> Tensor:
    """KL(teacher || student) per token, summed ("sum") or averaged over unmasked tokens ("mean").

    student_hidden [N, H], student_weight [V, H]; one teacher: teacher_hidden [N, H'] + teacher_weight
    [V, H'], teacher_topk (logprobs [N, k], indices [N, k][, tail_logmass [N] or None]) or
    teacher_logits_fn(0, N) -> [N, V]; mask [N] bool or 0/1.
    """
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    logq_NV = F.log_softmax((student_hidden.to(dtype) @ student_weight.to(dtype).t()) / temperature, dim=-1)
    if teacher_topk is not None:
        kl_N = _bucket_kl(logq_NV, *teacher_topk, temperature=temperature)
    else:
        with torch.no_grad():
            if teacher_logits_fn is not None:
                t_NV = teacher_logits_fn(0, logq_NV.shape[0]).to(dtype)
            else:
                t_NV = teacher_hidden.to(dtype) @ teacher_weight.to(dtype).t()
        kl_N = F.kl_div(logq_NV, F.softmax(t_NV / temperature, dim=-1), reduction="none").sum(-1)
    if mask is not None:
        kl_N = kl_N[mask.bool()]
    return kl_N.sum() if reduction == "sum" else kl_N.sum() / max(kl_N.shape[0], 1)


def _bucket_kl(logq_NV: Tensor, logprobs_Nk: Tensor, indices_Nk: Tensor, tail_N: Tensor | None = None, *,
               temperature: float) -> Tensor:
    """KL over the teacher's buckets: its k ids and, with a tail (and k < V), everything else."""
    idx_Nk = indices_Nk.long()
    logq_NB = logq_NV.gather(1, idx_Nk)
    t_NB = logprobs_Nk.to(logq_NV.dtype)
    if tail_N is not None and idx_Nk.shape[1] < logq_NV.shape[1]:
        # the student's probability outside the teacher's top-k is the tail bucket
        outside_NV = logq_NV.scatter(1, idx_Nk, float("-inf"))
        logq_NB = torch.cat([logq_NB, outside_NV.logsumexp(-1, keepdim=True)], dim=1)
        t_NB = torch.cat([t_NB, tail_N.to(logq_NV.dtype)[:, None]], dim=1)
    # the buckets are tempered as units and renormalised; without a tail the top-k are renormalised
    p_NB = torch.softmax(t_NB / temperature, dim=-1)
    return F.kl_div(logq_NB, p_NB, reduction="none").sum(-1)


def naive_cross_entropy(student_hidden: Tensor, student_weight: Tensor, labels: Tensor, *,
                        mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """-log softmax(student_hidden @ student_weight.T)[label] per unmasked token, summed or averaged."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    logits_NV = student_hidden.to(dtype) @ student_weight.to(dtype).t()
    nll_N = F.cross_entropy(logits_NV, labels.long(), reduction="none")
    if mask is not None:
        nll_N = nll_N[mask.bool()]
    return nll_N.sum() if reduction == "sum" else nll_N.sum() / max(nll_N.shape[0], 1)
