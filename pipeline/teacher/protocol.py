"""The teacher as one object: for a step's rows, the teacher arguments of `fused_linear_kl_div`.

Legend: T tokens of a row, H' teacher hidden size, V vocabulary, k top-k width, C tokens per chunk.

Design choices:
* Every source implements `targets(rows, spec, token_range=None)` (`TeacherSource`): `TeacherModel`
  (in-process), `TeacherClient` (the Serve pool) and `TopKCacheReader` (the offline cache). It yields, in row
  order and one row at a time (a slow teacher holds the step, not memory), one dict of keyword arguments per row:
    topk   {"teacher_topk": TeacherTopK}           logprobs [T, k], indices [T, k] int32, tail_logmass [T]
    hidden {"teacher_hidden": [T, H'], "teacher_weight": [V, H']}     (the exact teacher: in-process, or the
           pool's hidden states with the LM head the trainer read from the teacher's checkpoint)
    logits {"teacher_logits_fn": StreamedLogits}   full-vocabulary chunks [C, V], pulled in order
* `token_range=(start, end)`: a rank of a sequence-parallel group holds tokens [start, end) of every row
  (hylo/seq_parallel.py), and gets only those tokens' targets: the unsplit row's targets restricted to them
  (T above becomes end - start; a stream's index 0 is token `start`). The teacher still sees the whole row
  (a token's targets depend on its whole prefix). One rule, `check_token_range`: 0 <= start < end <= T of
  every row, else ValueError naming the row and the range. A source whose `targets` takes no `token_range`
  (one registered from outside) still works: `BoundTeacher` cuts its whole-row targets (`restrict`).
* `shards` (a list of `RowShard`, one per row, all of one range): the rank's rows as its sequence-parallel group
  splits them. A source whose `targets` takes `shards` splits its teacher with the group: the in-process teacher
  runs this rank's tokens only (its attention sees the row through `seq_parallel.split_attention`), the Serve pool
  runs each row once per group. Others get the shards' range as `token_range`. A shard's `teacher` of "whole"
  (`train.sequence_parallel_teacher`) takes the range path for every source.
* What is asked for is a `TargetSpec` (k, form) resolved once from the config (`target_form` in
  teacher/sources, from what each source says it gives); a source refuses a form it cannot give (the
  config check makes that unreachable).
* Rows reaching a source in-process are checked `PackedRow`s (the reader checked them); only the pool's
  server checks rows again, since it receives them over the network: every row of every request, whatever
  its type (the client sends `PackedRow`s; `check_row(received=True)`), ids against its vocabulary.
* `BoundTeacher` (built by `sources.open_teacher` from stage 2's `teacher` section) binds a source to its spec
  and places each row's targets on the trainer's device; the step zips rows and targets. A source whose `targets`
  takes `device` is told it (the pool's client gives its LM head there, one copy, not one a row).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import PackedRow

if TYPE_CHECKING:
    from hylo.seq_parallel import RowShard


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
    """The teacher protocol: a step's rows in, the fused KL's teacher arguments out, one row at a time.

    Three sources implement it, one per `teacher.source` of stage 2: `TeacherModel` (the teacher in the
    trainer's process), `TeacherClient` (the Ray Serve pool) and `TopKCacheReader` (the offline top-k cache).
    `targets` yields one dict of keyword arguments of `fused_linear_kl_div` per row, in row order:

    * top-k: `{"teacher_topk": TeacherTopK}`;
    * hidden: `{"teacher_hidden": [T, H'], "teacher_weight": [V, H']}` (the exact teacher, in-process or the
      pool's hidden states with the trainer's copy of the LM head);
    * logits: `{"teacher_logits_fn": StreamedLogits}`, full-vocabulary chunks `[C, V]` pulled in order.

    With `token_range=(start, end)` a rank of a sequence-parallel group gets the targets of tokens
    `[start, end)` of every row only; the teacher still sees the whole row. `BoundTeacher` binds a source to
    the `TargetSpec` stage 2 asks for and places the targets on the trainer's device.
    """

    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec,
                token_range: tuple[int, int] | None = None) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher keyword arguments of each row, in order (of tokens [start, end) only, when a
        `token_range` is given)."""
        ...


def check_token_range(token_range: Any, rows: Sequence[PackedRow], who: str = "teacher targets") \
        -> tuple[int, int] | None:
    """The one rule for a token range: None (the whole rows), or (start, end) with 0 <= start < end <= T of
    every row; returns it as two ints, else ValueError naming the row (its index, row_id and T) and the range."""
    if token_range is None:
        return None
    try:
        if any(isinstance(v, bool) for v in token_range):
            raise TypeError
        start, end = (operator.index(v) for v in token_range)
    except (TypeError, ValueError):
        raise ValueError(f"{who}: token_range={token_range!r} must be two integers (start, end)") from None
    for i, row in enumerate(rows):
        if not 0 <= start < end <= row.num_tokens:
            raise ValueError(f"{who}: token_range ({start}, {end}) does not fit row {i} (row_id {row.row_id}, "
                             f"{row.num_tokens} tokens): it needs 0 <= start < end <= {row.num_tokens}")
    return start, end


def in_range(chunks: Iterator[torch.Tensor], start: int, end: int) -> Iterator[torch.Tensor]:
    """The parts of a row's chunks [C, V] (from token 0 on) that fall in tokens [start, end), in order."""
    pos = 0
    for c in chunks:
        s, e = max(start - pos, 0), min(end - pos, c.shape[0])
        pos += c.shape[0]
        if s < e:
            yield c[s:e]
        if pos >= end:
            return


def restrict(targets: dict[str, Any], start: int, end: int) -> dict[str, Any]:
    """One row's whole-row targets cut to tokens [start, end) (for a source that cannot give a range)."""
    out: dict[str, Any] = {}
    for name, v in targets.items():
        if isinstance(v, TeacherTopK):
            v = TeacherTopK(*(x[start:end] if x is not None else None for x in v))
        elif isinstance(v, StreamedLogits):
            v = StreamedLogits(in_range(v.chunks, start, end), v.device)
        elif name == "teacher_hidden":
            v = v[start:end]
        out[name] = v
    return out


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

    def targets(self, rows: Sequence[PackedRow], device: torch.device | str,
                token_range: tuple[int, int] | None = None,
                shards: Sequence[RowShard] | None = None) -> Iterator[dict[str, Any]]:
        """`token_range=(start, end)`: only those tokens' targets of every row (see `TeacherSource`).
        `shards`: the rows' shards of a sequence-parallel group, one per row (their range is the token range);
        a source whose `targets` takes them splits its teacher with the group (the in-process teacher runs this
        rank's tokens only; the Serve pool runs each row once per group)."""
        if shards is not None:
            token_range = shards_range(shards, rows)
        rng = check_token_range(token_range, rows)
        at = {"device": device} if _takes(self.source, "device") else {}
        if rng is None:
            yield from (place(t, device) for t in self.source.targets(rows, self.spec, **at))
        elif shards is not None and shards[0].teacher != "whole" and _takes(self.source, "shards"):
            yield from (place(t, device) for t in self.source.targets(rows, self.spec, shards=shards, **at))
        elif _takes(self.source, "token_range"):
            yield from (place(t, device) for t in self.source.targets(rows, self.spec, token_range=rng, **at))
        else:
            yield from (place(restrict(t, *rng), device) for t in self.source.targets(rows, self.spec, **at))


def shards_range(shards: Sequence[RowShard], rows: Sequence[PackedRow]) -> tuple[int, int]:
    """The one token range of a step's shards (one per row, every one of the same group and range), else
    ValueError."""
    if len(shards) != len(rows) or len({(s.start, s.end, s.rank, s.sequence_parallel) for s in shards}) != 1:
        raise ValueError(f"teacher targets: {len(shards)} shard(s) for {len(rows)} row(s), of ranges "
                         f"{sorted({(s.start, s.end) for s in shards})}: one shard per row, all of one range")
    return shards[0].start, shards[0].end


def _takes(source: Any, name: str) -> bool:
    params = inspect.signature(source.targets).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
