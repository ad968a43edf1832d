"""The training side of the teacher pool: ordered, bounded, retrying requests through a Serve handle.

Legend: T tokens of a row, V vocabulary, C tokens per chunk, K top-k.

Design choices:
* `topk(rows)` is a generator over an iterable of rows: it keeps at most `max_inflight_rows`
  requests outstanding and yields results strictly in input order. It pulls the next input row
  only when a slot frees up, so a slow teacher blocks the trainer's `next()` instead of letting
  requests (and their results) pile up in memory.
* One row per request: the replica's token-budget batching merges rows from all clients, and a
  failure costs one row's recomputation.
* A replica death, an unavailable replica, back-pressure or a timeout resubmits that row (Serve
  routes it to a live replica) with exponential back-off, up to `max_retries` times, then raises;
  a row is never dropped, and since only the head-of-line result is ever yielded and each row
  occupies one slot, no row is duplicated or reordered. An error raised by the teacher's own code
  (bad row, k too large) is not retried: it is re-raised at once.
* A token range (`targets(rows, spec, token_range)`, a sequence-parallel rank's tokens [start, end)) goes in
  the request: the replica runs the whole row and sends back the range's top-k records or logit chunks only.
  A request without a range is the protocol before ranges (`topk.remote(row, k, dtype)`).
* Shards (`targets(rows, spec, shards=)`, the rows as a sequence-parallel group of N ranks splits them): the
  group asks the pool ONCE per row. Row i is asked by one rank, its owner (the group's rows are dealt out in
  turn, so every rank owns one row in N), for all N ranks' ranges (`ranges=`); the replica runs one forward
  and answers every range. The owner keeps its range and sends each other rank its own over the group
  (a broadcast of a small header, then a scatter of bytes: gloo on CPU, CUDA tensors on NCCL). Every rank
  relays row i when row i's targets are yielded, the same point of the step on every rank, never in a thread.
  A failed owner (retries spent, a bad row) still sends the header, marked failed: the others raise too.
  Top-k: each rank keeps up to `max_inflight_rows` of its own rows in flight. Streamed logits: the owner
  streams the row's chunks window by window from the pool and relays chunk j of every range before chunk
  j + 1; each rank keeps its range's chunks on the host, and the loss moves them to the device one at a
  time. The relay runs when the row is yielded, not as the loss reads chunks: the loss skips chunks whose
  tokens are all masked, so the ranks of a group read different numbers of chunks.
* The exact teacher as hidden states (`exact_form: hidden`): `hidden(rows)` runs as `topk` does (bounded, ordered,
  retried; a group's rows relayed as bytes), one [T, H'] tensor per row in the teacher's dtype; the client holds
  the teacher's LM head (`head`, read from the checkpoint by teacher/head.py), checks it against the pool's
  (`check_head`, once, before the first row) and gives it with each row, on the trainer's device (one copy per
  device), so the fused KL computes the logits chunk by chunk as for the in-process teacher.
* `stream(row)` asks for windows of `window_chunks` chunks (one Serve streaming call each), and
  prefetches at most one window ahead, so at most two windows of [C, V] chunks are ever in flight.
  A window that fails is re-requested from its first chunk not yet yielded.
* Waiting on a stream chunk uses the handle's async iterator under `asyncio.wait_for` on a private
  event loop, which is what gives stream chunks a timeout (the sync iterator has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.logs import get_logger
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.teacher.config import TeacherClientConfig
from hylo.pipeline.teacher.protocol import (
    StreamedLogits,
    TargetSpec,
    check_token_range,
    shards_range,
    unsupported,
)

logger = get_logger(__name__)


class TeacherUnavailableError(RuntimeError):
    """A row could not be served within the retry budget; names the row and the last error."""


def _retryable_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rx  # lazy: ray
    import ray.serve.exceptions as sx  # lazy: ray

    return (TimeoutError, rx.RayActorError, rx.ObjectLostError, rx.RaySystemError,
            sx.BackPressureError, sx.DeploymentUnavailableError, sx.ReplicaUnavailableError)


@dataclass
class ClientStats:
    rows: int = 0
    retries: int = 0
    timeouts: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class _Pending:
    index: int
    row: PackedRow
    response: Any
    started: float
    k: int
    token_range: tuple[int, int] | None = None
    attempts: int = 1
    # a sequence-parallel group's ranges of the row (one request answers them all)
    ranges: list[tuple[int, int]] | None = None


def _topk_from_wire(out: Mapping[str, torch.Tensor]) -> TeacherTopK:
    return TeacherTopK(out["logprobs"], out["indices"], out["tail_logmass"])


# ------------------------------------------------------------------------ the relay over a group
# dtypes a relayed piece may hold, by their code in the header
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32)


def relay_device(group: Any) -> torch.device:
    """Where the collectives of `group` take their tensors: the current CUDA device on NCCL, else the host."""
    import torch.distributed as dist  # lazy: torch.distributed

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class _Group:
    """This rank's sequence-parallel group, as a step's shards give it: where it stands and every rank's range."""

    group: Any
    rank: int
    size: int
    ranges: list[tuple[int, int]]
    device: torch.device

    @classmethod
    def of(cls, shard: Any) -> _Group:
        from hylo.seq_parallel import shard_range  # lazy: the student's kernels

        n = shard.sequence_parallel
        return cls(shard.group, shard.rank, n, [shard_range(shard.total, r, n) for r in range(n)],
                   relay_device(shard.group))

    @property
    def tokens(self) -> int:
        s, e = self.ranges[self.rank]
        return e - s

    def _head(self, owner: int, status: int, nbytes: int = 0, meta: tuple[int, int] = (0, 0)) -> list[int]:
        import torch.distributed as dist  # lazy: torch.distributed

        head = torch.tensor([status, nbytes, *meta], dtype=torch.int64, device=self.device)
        dist.broadcast(head, group=self.group, group_src=owner)
        return head.tolist()

    def send(self, pieces: list[torch.Tensor], meta: tuple[int, int]) -> None:
        """The owner's side: piece r (a uint8 tensor, all of one size) to rank r; `meta`: two ints for the header."""
        import torch.distributed as dist  # lazy: torch.distributed

        self._head(self.rank, 0, pieces[0].numel(), meta)
        mine = torch.empty_like(pieces[0], device=self.device)
        dist.scatter(mine, [p.to(self.device) for p in pieces], group=self.group, group_src=self.rank)

    def send_failure(self) -> None:
        """The owner's side when it cannot send: the header alone, marked failed (the others raise)."""
        with contextlib.suppress(Exception):
            self._head(self.rank, 1)

    def receive(self, owner: int, what: str) -> tuple[torch.Tensor, tuple[int, int]]:
        """A rank's side: its piece from `owner` (uint8 on the relay device) and the header's two ints."""
        import torch.distributed as dist  # lazy: torch.distributed

        status, nbytes, a, b = self._head(owner, 0)
        if status:
            raise TeacherUnavailableError(f"{what}: rank {owner} of this sequence-parallel group asks the pool for "
                                          f"it and failed (its error is in that rank's output)")
        mine = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.scatter(mine, None, group=self.group, group_src=owner)
        return mine, (a, b)


def _as_bytes(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.contiguous().reshape(-1).view(torch.uint8) for x in xs])


def _hidden_from_wire(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise RuntimeError(f"teacher replica answered {type(out).__name__} for hidden states, expected a [T, H] "
                           f"tensor")
    return out


def _hidden_of_bytes(b: torch.Tensor, t: int, width: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    if b.numel() != t * width * dtype.itemsize:
        raise RuntimeError(f"{what}: got {b.numel()} bytes from the group, expected {t * width * dtype.itemsize} "
                           f"({t} tokens x {width} hidden, {dtype})")
    return b.view(dtype).view(t, width)


def _topk_bytes(rec: TeacherTopK) -> torch.Tensor:
    """A record as bytes: tail fp32 [t], indices int32 [t, K], logprobs [t, K] (4-byte aligned offsets)."""
    return _as_bytes(rec.tail_logmass.to(torch.float32), rec.indices.to(torch.int32), rec.logprobs)


def _topk_of_bytes(b: torch.Tensor, t: int, k: int, dtype: torch.dtype, what: str) -> TeacherTopK:
    n_tail, n_idx = t * 4, t * k * 4
    want = n_tail + n_idx + t * k * dtype.itemsize
    if b.numel() != want:
        raise RuntimeError(f"{what}: got {b.numel()} bytes from the group, expected {want} ({t} tokens, k={k}, "
                           f"{dtype})")
    return TeacherTopK(b[n_tail + n_idx:].view(dtype).view(t, k), b[n_tail:n_tail + n_idx].view(torch.int32).view(t, k),
                       b[:n_tail].view(torch.float32))


class _Failed:
    """A request that could not be sent: its error comes out where its result is waited for (so a group's owner
    tells the others, see `_records_group`)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self, timeout_s: float | None = None) -> Any:
        raise self.error

    def cancel(self) -> None:
        pass


def _drain(held: deque[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The held chunks in order, each let go once read."""
    while held:
        yield held.popleft()


class TeacherClient:
    def __init__(self, handle_or_app_name: Any, cfg: TeacherClientConfig | None = None, chunk_tokens: int = 1024,
                 head: torch.Tensor | None = None, **settings: Any) -> None:
        """`chunk_tokens`: tokens per streamed logits chunk (teacher.model.logits_chunk_tokens); `head`: the
        teacher's LM head [V, H'] for the hidden-state form (teacher/head.py `load_head`; None: that form is not
        given); `cfg` and/or `settings`: TeacherClientConfig's fields (in-flight rows, timeout, retries, wire dtype,
        windows), checked by its rules. The top-k width is the caller's, per request (`topk(rows, k)`; stage 2:
        teacher.k)."""
        if isinstance(handle_or_app_name, str):
            from ray import serve  # lazy: ray

            handle_or_app_name = serve.get_app_handle(handle_or_app_name)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        self.handle, self.chunk_tokens = handle_or_app_name, chunk_tokens
        self.cfg = dataclasses.replace(cfg or TeacherClientConfig(), **settings)
        self.stats = ClientStats()
        self._retryable = _retryable_errors()
        self._loop: asyncio.AbstractEventLoop | None = None
        # rows asked with shards so far: row n of a group is asked by its rank n % N (the same count on every rank)
        self._group_rows = 0
        self.head = head
        # the head on each device it was asked on (the trainer's: one copy, made once)
        self._heads: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, handle_or_app_name: Any, cfg: TeacherClientConfig, chunk_tokens: int,
                    head: torch.Tensor | None = None) -> TeacherClient:
        """`cfg`: stage 2's teacher.client; `chunk_tokens`: its teacher.model.logits_chunk_tokens; `head`: the
        teacher's LM head (exact_form: hidden)."""
        return cls(handle_or_app_name, cfg, chunk_tokens, head)

    def check_head(self, where: str) -> None:
        """That the pool's replica holds the LM head this client holds (read from `where`): shape, dtype and
        digest (teacher/head.py); HeadError naming what differs."""
        from hylo.pipeline.teacher.head import check_same_head, head_info  # lazy: hashlib only

        if self.head is None:
            raise ValueError("teacher client: no LM head to check (exact_form: hidden needs one)")
        theirs = self.handle.head_info.remote().result(timeout_s=self.cfg.timeout_s)
        check_same_head(head_info(self.head), theirs, where)

    def _head_at(self, device: torch.device | str | None) -> torch.Tensor:
        if self.head is None:
            raise ValueError("teacher client: hidden-state targets need the teacher's LM head (exact_form: hidden)")
        key = str(torch.device(device)) if device is not None else str(self.head.device)
        if key not in self._heads:
            self._heads[key] = self.head if device is None else self.head.to(device)
        return self._heads[key]

    def _hidden_targets(self, hs: Iterable[torch.Tensor], device: torch.device | str | None) \
            -> Iterator[dict[str, Any]]:
        for h in hs:
            yield {"teacher_hidden": h, "teacher_weight": self._head_at(device)}

    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec, token_range: tuple[int, int] | None = None,
                shards: Sequence[Any] | None = None,
                device: torch.device | str | None = None) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher arguments of each row (protocol.TeacherSource): a step's top-k requests
        are in flight together; an exact row is streamed window by window as the loss reads it. With
        `token_range=(start, end)` every request asks for those tokens only (the replica runs the whole row).
        With `shards` (one `RowShard` per row, all of one range: protocol.BoundTeacher's) the group asks the
        pool once per row and each rank gets its own tokens' targets (see the module docstring). `device`: where
        the LM head of hidden-state targets is given (the trainer's; None: where it was loaded)."""
        if spec.form not in ("topk", "logits", "hidden") or spec.form == "hidden" and self.head is None:
            raise unsupported("pool", spec)
        if shards is not None:
            token_range = shards_range(shards, rows)
            if shards[0].sequence_parallel > 1:
                check_token_range(token_range, rows)
                g = _Group.of(shards[0])
                if spec.form == "hidden":
                    yield from self._hidden_targets(self._records_group(rows, 0, g), device)
                else:
                    yield from self._group_targets(rows, spec, g)
                return
        rng = check_token_range(token_range, rows)
        if spec.form == "hidden":
            yield from self._hidden_targets(self.hidden(rows, rng), device)
        elif spec.form == "topk":
            for rec in self.topk(rows, spec.k, rng):
                yield {"teacher_topk": rec}
        else:
            for row in rows:
                yield {"teacher_logits_fn": StreamedLogits(self.stream(row, token_range=rng))}

    # ---------------------------------------------------------------- a sequence-parallel group
    def _owner(self, g: _Group) -> int:
        owner = self._group_rows % g.size
        self._group_rows += 1
        return owner

    def _group_targets(self, rows: Sequence[PackedRow], spec: TargetSpec, g: _Group) -> Iterator[dict[str, Any]]:
        if spec.form == "topk":
            for rec in self._records_group(rows, spec.k, g):
                yield {"teacher_topk": rec}
        else:
            for i, row in enumerate(rows):
                yield {"teacher_logits_fn": self._logits_group(row, i, g)}

    def _records_group(self, rows: Iterable[PackedRow], k: int, g: _Group) -> Iterator[Any]:
        """This rank's top-k records (k > 0) or hidden states (k = 0) of `rows`, in order: the rows it owns asked
        for every range of the group (at most `max_inflight_rows` of them outstanding), each row relayed from its
        owner as it is yielded."""
        inflight: deque[tuple[int, PackedRow, int, _Pending | None]] = deque()
        source = iter(enumerate(rows))
        exhausted, mine = False, 0
        dtype = getattr(torch, self.cfg.dtype)
        try:
            while True:
                while not exhausted and mine < self.cfg.max_inflight_rows:
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        break
                    i, row = nxt
                    owner, p = self._owner(g), None
                    if owner == g.rank:
                        try:
                            response = self._submit(row, k, ranges=g.ranges)
                        except Exception as e:
                            response = _Failed(e)
                        p = _Pending(i, row, response, time.monotonic(), k, ranges=g.ranges)
                        mine += 1
                    inflight.append((i, row, owner, p))
                if not inflight:
                    return
                i, row, owner, p = inflight[0]
                what = f"teacher row {i} (row_id {row.row_id})"
                if p is None:
                    piece, (width, code) = g.receive(owner, what)
                    if k:
                        rec = _topk_of_bytes(piece, g.tokens, k, dtype, what)
                    else:
                        rec = _hidden_of_bytes(piece, g.tokens, width, _DTYPES[code], what)
                else:
                    try:
                        recs = self._wait(p)
                    except BaseException:
                        g.send_failure()
                        raise
                    if k:
                        g.send([_topk_bytes(r) for r in recs], (k, _DTYPES.index(dtype)))
                    else:
                        g.send([_as_bytes(r) for r in recs], (recs[0].shape[1], _DTYPES.index(recs[0].dtype)))
                    rec, mine = recs[g.rank], mine - 1
                inflight.popleft()
                self.stats.rows += 1
                yield rec
        finally:
            for _, _, _, p in inflight:
                if p is not None:
                    p.response.cancel()

    def _logits_group(self, row: PackedRow, i: int, g: _Group) -> StreamedLogits:
        """This rank's streamed logits of `row`: its owner streams every range's chunks from the pool and relays
        them in chunk order; each rank holds its own range's chunks [C, V] on the host."""
        owner, c = self._owner(g), self.chunk_tokens
        n = math.ceil(g.tokens / c)
        what = f"teacher stream of row {i} (row_id {row.row_id})"
        held: deque[torch.Tensor] = deque()
        if owner != g.rank:
            for j in range(n):
                piece, (vocab, code) = g.receive(owner, f"{what}, chunk {j}")
                rows_j = min(c, g.tokens - j * c)
                held.append(piece.view(_DTYPES[code]).view(rows_j, vocab).cpu())
            return StreamedLogits(_drain(held))
        sent = 0
        try:
            for parts in self._stream_parts(row, c, 0, g.tokens, ranges=g.ranges):
                g.send([_as_bytes(x) for x in parts], (parts[0].shape[1], _DTYPES.index(parts[0].dtype)))
                sent += 1
                held.append(parts[g.rank])
        except BaseException:
            if sent < n:
                g.send_failure()
            raise
        if sent != n:
            raise RuntimeError(f"{what}: {sent} chunks of every range came back, expected {n}")
        return StreamedLogits(_drain(held))

    # ---------------------------------------------------------------- top-k and hidden states
    def _submit(self, row: PackedRow, k: int, token_range: tuple[int, int] | None = None,
                ranges: list[tuple[int, int]] | None = None) -> Any:
        """A request for the row's top-k records of width k, or (k = 0) its hidden states."""
        if not k:
            return self.handle.hidden.remote(row, token_range=token_range, ranges=ranges)
        if ranges is not None:
            return self.handle.topk.remote(row, k, self.cfg.dtype, ranges=ranges)
        if token_range is None:
            return self.handle.topk.remote(row, k, self.cfg.dtype)
        return self.handle.topk.remote(row, k, self.cfg.dtype, token_range=token_range)

    def _retry_or_raise(self, what: str, attempts: int, err: BaseException) -> None:
        self.stats.errors.append(f"{what}: {type(err).__name__}")
        if attempts > self.cfg.max_retries:
            raise TeacherUnavailableError(
                f"{what} failed {attempts} time(s) (max_retries={self.cfg.max_retries}); last error: {err!r}"
            ) from err
        self.stats.retries += 1
        wait = self.cfg.retry_backoff_s * 2 ** (attempts - 1)
        logger.warning(f"[teacher] {what}: {type(err).__name__}; sending it again ({attempts} of max_retries="
                       f"{self.cfg.max_retries}) in {wait:g} s")
        time.sleep(wait)

    def _wait(self, p: _Pending) -> Any:
        """The request's record (its ranges' records, a list, with `p.ranges`), each of the tokens asked."""
        while True:
            remaining = self.cfg.timeout_s - (time.monotonic() - p.started)
            try:
                out = p.response.result(timeout_s=max(remaining, 1e-3))
            except self._retryable as e:
                if isinstance(e, TimeoutError):
                    self.stats.timeouts += 1
                    p.response.cancel()
                self._retry_or_raise(f"teacher row {p.index} (row_id {p.row.row_id})", p.attempts, e)
                p.response, p.started = self._submit(p.row, p.k, p.token_range, p.ranges), time.monotonic()
                p.attempts += 1
                continue
            wire = _topk_from_wire if p.k else _hidden_from_wire
            if p.ranges is None:
                return self._checked(p, wire(out[0]), p.token_range or (0, p.row.num_tokens))
            if len(out[0]) != len(p.ranges):
                raise RuntimeError(f"teacher row {p.index}: got {len(out[0])} records back, asked for "
                                   f"{len(p.ranges)} ranges")
            return [self._checked(p, wire(o), r) for o, r in zip(out[0], p.ranges)]

    @staticmethod
    def _checked(p: _Pending, rec: Any, rng: tuple[int, int]) -> Any:
        start, end = rng
        got = (rec.logprobs if isinstance(rec, TeacherTopK) else rec).shape[0]
        if got != end - start:
            raise RuntimeError(f"teacher row {p.index}: got {got} tokens back, "
                               f"asked for {end - start} (tokens {start}..{end} of {p.row.num_tokens})")
        return rec

    def topk(self, rows: Iterable[PackedRow], k: int,
             token_range: tuple[int, int] | None = None) -> Iterator[TeacherTopK]:
        """Top-k records of width `k` of (checked) `rows`, in order, with at most `max_inflight_rows` outstanding;
        `token_range`: of tokens [start, end) of each row only (checked by the caller and by the replica)."""
        if k < 1:
            raise ValueError(f"teacher client: top-k width k={k} must be >= 1")
        return self._records(rows, k, token_range)

    def hidden(self, rows: Iterable[PackedRow], token_range: tuple[int, int] | None = None) -> Iterator[torch.Tensor]:
        """Final hidden states [T, H'] of (checked) `rows` in the teacher's dtype, in order, as `topk` gives
        records (bounded, ordered, retried)."""
        return self._records(rows, 0, token_range)

    def _records(self, rows: Iterable[PackedRow], k: int, token_range: tuple[int, int] | None) -> Iterator[Any]:
        inflight: deque[_Pending] = deque()
        source = iter(enumerate(rows))
        exhausted = False
        try:
            while True:
                while not exhausted and len(inflight) < self.cfg.max_inflight_rows:
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                        break
                    i, row = nxt
                    inflight.append(_Pending(i, row, self._submit(row, k, token_range), time.monotonic(), k,
                                             token_range))
                if not inflight:
                    return
                rec = self._wait(inflight[0])
                inflight.popleft()
                self.stats.rows += 1
                yield rec
        finally:
            # The consumer stopped early or an error escaped: do not leave work running for nobody.
            for p in inflight:
                p.response.cancel()

    def topk_all(self, rows: Iterable[PackedRow], k: int) -> list[TeacherTopK]:
        return list(self.topk(rows, k))

    # ---------------------------------------------------------------- stream
    def _next_chunk(self, gen: Any, timeout_s: float) -> torch.Tensor | None:
        """Next chunk of a streaming response, None at its end; raises TimeoutError after timeout_s."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()

        async def nxt() -> torch.Tensor | None:
            try:
                return await asyncio.wait_for(gen.__anext__(), timeout_s)
            except StopAsyncIteration:
                return None
            except TimeoutError:
                raise TimeoutError(f"no stream chunk within {timeout_s:.1f} s") from None

        return self._loop.run_until_complete(nxt())

    def stream(
        self, row: PackedRow, chunk_tokens: int | None = None,
        window_chunks: int | None = None, dtype: str | None = None, token_range: tuple[int, int] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Full-logit chunks [C, V] of one (checked) row, in order, each exactly once; `token_range`: of tokens
        [start, end) only (the first chunk starts at token `start`)."""
        first, t = check_token_range(token_range, [row]) or (0, row.num_tokens)
        for (chunk,) in self._stream_parts(row, chunk_tokens or self.chunk_tokens, first, t, window_chunks, dtype):
            yield chunk

    def _stream_parts(
        self, prow: PackedRow, c: int, first: int, t: int, window_chunks: int | None = None,
        dtype: str | None = None, ranges: list[tuple[int, int]] | None = None,
    ) -> Iterator[list[torch.Tensor]]:
        """Tokens [first, t) of one row as lists of chunks [C, V], in order, each exactly once: one chunk a list,
        or with `ranges` (a group's ranges, all of one length) chunk j of every range ([first, t) then are
        offsets into each range)."""
        parts = 1 if ranges is None else len(ranges)
        window = c * (window_chunks or self.cfg.window_chunks)
        session = f"{prow.row_id}-{uuid.uuid4().hex[:8]}"
        handle = self.handle.options(stream=True, multiplexed_model_id=session)

        def request(start: int, end: int) -> Any:
            if ranges is None:
                return handle.stream.remote(prow, c, start, end, dtype)
            return handle.stream.remote(prow, c, start, end, dtype, ranges=ranges)

        pos, cur_end = first, min(first + window, t)
        current, prefetched = request(first, cur_end), None
        attempts = 1
        got: list[torch.Tensor] = []
        while pos < t:
            try:
                chunk = self._next_chunk(current, self.cfg.timeout_s)
            except self._retryable as e:
                if isinstance(e, TimeoutError):
                    self.stats.timeouts += 1
                current.cancel()
                self._retry_or_raise(f"teacher stream of row {prow.row_id} at token {pos}", attempts, e)
                attempts += 1
                # a chunk of some ranges only is asked again with the others
                got = []
                current = request(pos, cur_end)
                continue
            if chunk is None:
                if pos != cur_end or got:
                    raise RuntimeError(f"teacher stream of row {prow.row_id}: window ended at token {pos}"
                                       f"{f' after {len(got)} of {parts} ranges' if got else ''}, expected {cur_end}")
                current = prefetched if prefetched is not None else request(pos, min(pos + window, t))
                prefetched, cur_end = None, min(pos + window, t)
                continue
            if prefetched is None and cur_end < t:
                # The first chunk proves the session holds the hidden states: the next window reuses them.
                prefetched = request(cur_end, min(cur_end + window, t))
            attempts = 1
            got.append(chunk)
            if len(got) < parts:
                continue
            if len({x.shape[0] for x in got}) != 1:
                raise RuntimeError(f"teacher stream of row {prow.row_id} at token {pos}: chunks of "
                                   f"{[x.shape[0] for x in got]} tokens for the ranges, expected one size")
            pos += got[0].shape[0]
            yield got
            got = []
        # All tokens arrived; release the (finished) last window and any unused prefetch.
        current.cancel()
        if prefetched is not None:
            prefetched.cancel()
