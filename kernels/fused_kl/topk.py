"""The top-k teacher record: what the teacher pool, the offline cache and the fused KL all share.

For N tokens: `logprobs [N, k]` (teacher log-probabilities at temperature 1, stored fp16/bf16/fp32),
`indices [N, k]` (int32/int64 vocabulary ids), `tail_logmass [N]` (fp32, log(1 - sum(exp(logprobs))),
-inf when the top-k hold all the mass). Keeping the tail as one extra bucket keeps the target a
proper distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TeacherTopK(NamedTuple):
    """A teacher's top-k record of N tokens, what `fused_linear_kl_div(teacher_topk=...)` takes.

    `logprobs` `[N, k]`: the k largest log-probabilities at temperature 1; `indices` `[N, k]`: their token ids;
    `tail_logmass` `[N]` (optional): the log of the probability mass outside the k ids, so that the target
    stays a distribution (`tail_logmass_from_topk`).
    """

    logprobs: torch.Tensor
    indices: torch.Tensor
    tail_logmass: torch.Tensor | None = None

    def bytes_per_token(self) -> float:
        """The record's bytes per token, as stored or sent."""
        n = self.logprobs.shape[0]
        total = self.logprobs.numel() * self.logprobs.element_size() + self.indices.numel() * self.indices.element_size()
        if self.tail_logmass is not None:
            total += self.tail_logmass.numel() * self.tail_logmass.element_size()
        return total / max(n, 1)


def tail_logmass_from_topk(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(topk_logprobs)) computed stably in fp32; -inf where the top-k hold all mass."""
    lse = torch.logsumexp(topk_logprobs.float(), dim=-1).clamp(max=0.0)
    # log(1 - exp(lse)) = log(-expm1(lse)), stable for lse close to 0
    return torch.log(-torch.expm1(lse))


@torch.no_grad()
def topk_from_logits(
    logits: torch.Tensor, k: int, dtype: torch.dtype = torch.float16, index_dtype: torch.dtype = torch.int32
) -> TeacherTopK:
    """Top-k record of `logits [N, V]` (computed in fp32 whatever the input dtype)."""
    if logits.dim() != 2:
        raise ValueError(f"topk_from_logits: logits must be [N, V], got shape {tuple(logits.shape)}")
    if not 0 < k <= logits.shape[-1]:
        raise ValueError(f"topk_from_logits: k={k} must be in 1..{logits.shape[-1]}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = logp.topk(k, dim=-1)
    tail = tail_logmass_from_topk(vals)
    return TeacherTopK(vals.to(dtype), idx.to(index_dtype), tail)
