"""The teacher as one object: for a step's rows, the teacher arguments of `fused_linear_kl_div`.

Legend: T tokens of a row, H' teacher hidden size, V vocabulary, k top-k width, C tokens per chunk.

Design choices:
* Every source implements `targets(rows, spec)` (`TeacherSource`): `TeacherModel` (in-process),
  `TeacherClient` (the Serve pool) and `TopKCacheReader` (the offline cache). It yields, in row order and
  one row at a time (a slow teacher holds the step, not memory), one dict of keyword arguments per row:
    topk   {"teacher_topk": TeacherTopK}           logprobs [T, k], indices [T, k] int32, tail_logmass [T]
    hidden {"teacher_hidden": [T, H'], "teacher_weight": [V, H']}     (the exact teacher, in-process)
    logits {"teacher_logits_fn": StreamedLogits}   full-vocabulary chunks [C, V], pulled in order
* What is asked for is a `TargetSpec` (k, form) resolved once from the config (`target_form` in
  teacher/sources, from what each source says it gives); a source refuses a form it cannot give (the
  config check makes that unreachable).
* Rows reaching a source in-process are checked `PackedRow`s (the reader checked them); only the pool's
  server checks rows again, since it receives them over the network: every row of every request, whatever
  its type (the client sends `PackedRow`s; `check_row(received=True)`), ids against its vocabulary.
* `BoundTeacher` (built by `sources.open_teacher` from stage 2's `teacher` section) binds a source to its spec
  and places each row's targets on the trainer's device; the step zips rows and targets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import PackedRow


@dataclass(frozen=True)
class TargetSpec:
    """What the teacher gives: k > 0 = top-k records; k = 0 = exact, as `hidden` states or streamed `logits`."""

    k: int
    form: str

    def __post_init__(self) -> None:
        if (self.form == "topk") != (self.k > 0) or self.form not in ("topk", "hidden", "logits"):
            raise ValueError(f"teacher targets: form {self.form!r} with k={self.k} (topk needs k > 0, "
                             f"hidden and logits k = 0)")


class TeacherSource(Protocol):
    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher keyword arguments of each row, in order."""
        ...


def unsupported(source: str, spec: TargetSpec) -> ValueError:
    return ValueError(f"the {source} teacher cannot give {spec.form} targets (k={spec.k})")


def check_k_fits(k: int, vocab_size: int, who: str) -> None:
    """A top-k width the teacher's vocabulary can give (0 = exact)."""
    if not 0 <= k <= vocab_size:
        raise ValueError(f"{who}: k={k} must be in 0..{vocab_size} (the teacher's vocabulary; 0 = exact)")


class StreamedLogits:
    """`teacher_logits_fn(i, j)` over an iterator of [C, V] chunks (calls come in increasing order)."""

    def __init__(self, chunks: Iterator[torch.Tensor], device: torch.device | str | None = None) -> None:
        self.chunks, self.device = chunks, device
        self.buf, self.start = None, 0

    def __call__(self, i: int, j: int) -> torch.Tensor:
        while self.buf is None or self.start + self.buf.shape[0] < j:
            nxt = next(self.chunks).to(self.device)
            if self.buf is None:
                self.buf = nxt
            else:
                keep = self.buf[max(0, i - self.start):]
                self.start += self.buf.shape[0] - keep.shape[0]
                self.buf = torch.cat([keep, nxt])
        return self.buf[i - self.start: j - self.start]


def place(targets: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """One row's targets on `device` (a stream is moved chunk by chunk as it is read)."""
    out: dict[str, Any] = {}
    for name, v in targets.items():
        if isinstance(v, TeacherTopK):
            v = TeacherTopK(*(x.to(device) if x is not None else None for x in v))
        elif isinstance(v, StreamedLogits):
            v.device = device
        else:
            v = v.to(device)
        out[name] = v
    return out


@dataclass
class BoundTeacher:
    """A source bound to what stage 2 asks of it: `targets(rows, device)` yields one row's targets at a time."""

    source: TeacherSource
    spec: TargetSpec
    vocab_size: int | None = None

    def targets(self, rows: Sequence[PackedRow], device: torch.device | str) -> Iterator[dict[str, Any]]:
        for t in self.source.targets(rows, self.spec):
            yield place(t, device)
