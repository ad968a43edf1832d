"""Fused linear cross-entropy: the KL against a one-hot teacher, through the same chunked op.

Cross-entropy is KL(one-hot || q): with the teacher's whole mass on the label, KL = -log q_label. As a
top-k record that is k = 1, log-probability 0 at the label, no tail (README.md: the bucket loss then
has the label's term only, and the gradient q - onehot). So the eval NLL, the stage-2 CE term and the
KL share one implementation: chunks, masks, fp32 logits, the Triton path and the no-host-read rule
of `fused_linear_kl_div`. The reference is `naive.naive_cross_entropy` (full logits + F.cross_entropy).

Legend: N tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch

from hylo.kernels.fused_kl.chunked import fused_linear_kl_div
from hylo.kernels.fused_kl.topk import TeacherTopK


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    precision: str = "accurate",
) -> torch.Tensor:
    """-log softmax(hidden @ weight.T)[label] per unmasked token, summed ("sum") or averaged ("mean").

    hidden: [N, H], weight: [V, H], labels: [N] integer ids in 0..V-1 (their value at a masked token is
    ignored), mask: [N] bool or 0/1. No [N, V] tensor; gradients flow to hidden and weight, computed in
    this call (as `fused_linear_kl_div`, whose argument checks, errors and `precision` apply). Returns fp32 (fp64
    for fp64 inputs); 0 when no token is unmasked.
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.dtype.is_floating_point:
        raise ValueError(f"fused_linear_cross_entropy: labels must be a [N] integer tensor, got {labels!r}")
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        # a masked token's label may be anything (e.g. -100): give the range check a valid id
        labels = torch.where(mask.bool(), labels, torch.zeros_like(labels))
    ids_N1 = labels.unsqueeze(1)
    device = hidden.device if isinstance(hidden, torch.Tensor) else labels.device
    onehot = TeacherTopK(torch.zeros(ids_N1.shape, device=device), ids_N1)
    try:
        return fused_linear_kl_div(hidden, weight, teacher_topk=onehot, mask=mask, reduction=reduction,
                                   chunk_size=chunk_size, precision=precision)
    except ValueError as e:
        # the checks speak of the one-hot teacher: say labels (a deferred device check keeps its words)
        msg = str(e).replace("fused_linear_kl_div", "fused_linear_cross_entropy")
        for name, label in (("teacher_topk.indices", "labels"), ("teacher_topk", "labels"), ("student_", "")):
            msg = msg.replace(name, label)
        raise ValueError(msg) from e
