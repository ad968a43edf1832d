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
* `stream(row)` asks for windows of `window_chunks` chunks (one Serve streaming call each), and
  prefetches at most one window ahead, so at most two windows of [C, V] chunks are ever in flight.
  A window that fails is re-requested from its first chunk not yet yielded.
* Waiting on a stream chunk uses the handle's async iterator under `asyncio.wait_for` on a private
  event loop, which is what gives stream chunks a timeout (the sync iterator has none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.teacher.config import TeacherClientConfig
from hylo.pipeline.teacher.protocol import StreamedLogits, TargetSpec, check_token_range, unsupported


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


def _topk_from_wire(out: Mapping[str, torch.Tensor]) -> TeacherTopK:
    return TeacherTopK(out["logprobs"], out["indices"], out["tail_logmass"])


class TeacherClient:
    def __init__(self, handle_or_app_name: Any, cfg: TeacherClientConfig | None = None, chunk_tokens: int = 1024,
                 **settings: Any) -> None:
        """`chunk_tokens`: tokens per streamed logits chunk (teacher.model.logits_chunk_tokens); `cfg` and/or
        `settings`: TeacherClientConfig's fields (in-flight rows, timeout, retries, wire dtype, windows), checked
        by its rules. The top-k width is the caller's, per request (`topk(rows, k)`; stage 2: teacher.k)."""
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

    @classmethod
    def from_config(cls, handle_or_app_name: Any, cfg: TeacherClientConfig, chunk_tokens: int) -> TeacherClient:
        """`cfg`: stage 2's teacher.client; `chunk_tokens`: its teacher.model.logits_chunk_tokens."""
        return cls(handle_or_app_name, cfg, chunk_tokens)

    def targets(self, rows: Sequence[PackedRow], spec: TargetSpec,
                token_range: tuple[int, int] | None = None) -> Iterator[dict[str, Any]]:
        """The fused KL's teacher arguments of each row (protocol.TeacherSource): a step's top-k requests
        are in flight together; an exact row is streamed window by window as the loss reads it. With
        `token_range=(start, end)` every request asks for those tokens only (the replica runs the whole row)."""
        if spec.form not in ("topk", "logits"):
            raise unsupported("pool", spec)
        rng = check_token_range(token_range, rows)
        if spec.form == "topk":
            for rec in self.topk(rows, spec.k, rng):
                yield {"teacher_topk": rec}
        else:
            for row in rows:
                yield {"teacher_logits_fn": StreamedLogits(self.stream(row, token_range=rng))}

    # ---------------------------------------------------------------- top-k
    def _submit(self, row: PackedRow, k: int, token_range: tuple[int, int] | None = None) -> Any:
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
        print(f"[teacher] {what}: {type(err).__name__}; sending it again ({attempts} of max_retries="
              f"{self.cfg.max_retries}) in {wait:g} s", flush=True)
        time.sleep(wait)

    def _wait(self, p: _Pending) -> TeacherTopK:
        while True:
            remaining = self.cfg.timeout_s - (time.monotonic() - p.started)
            try:
                out = p.response.result(timeout_s=max(remaining, 1e-3))
            except self._retryable as e:
                if isinstance(e, TimeoutError):
                    self.stats.timeouts += 1
                    p.response.cancel()
                self._retry_or_raise(f"teacher row {p.index} (row_id {p.row.row_id})", p.attempts, e)
                p.response, p.started = self._submit(p.row, p.k, p.token_range), time.monotonic()
                p.attempts += 1
                continue
            rec = _topk_from_wire(out[0])
            start, end = p.token_range or (0, p.row.num_tokens)
            if rec.logprobs.shape[0] != end - start:
                raise RuntimeError(f"teacher row {p.index}: got {rec.logprobs.shape[0]} tokens back, "
                                   f"asked for {end - start} (tokens {start}..{end} of {p.row.num_tokens})")
            return rec

    def topk(self, rows: Iterable[PackedRow], k: int,
             token_range: tuple[int, int] | None = None) -> Iterator[TeacherTopK]:
        """Top-k records of width `k` of (checked) `rows`, in order, with at most `max_inflight_rows` outstanding;
        `token_range`: of tokens [start, end) of each row only (checked by the caller and by the replica)."""
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
        prow = row
        c = chunk_tokens or self.chunk_tokens
        window = c * (window_chunks or self.cfg.window_chunks)
        first, t = check_token_range(token_range, [prow]) or (0, prow.num_tokens)
        session = f"{prow.row_id}-{uuid.uuid4().hex[:8]}"
        handle = self.handle.options(stream=True, multiplexed_model_id=session)

        def open_window(start: int) -> Any:
            return handle.stream.remote(prow, c, start, min(start + window, t), dtype)

        pos, cur_end = first, min(first + window, t)
        current, prefetched = open_window(first), None
        attempts = 1
        while pos < t:
            try:
                chunk = self._next_chunk(current, self.cfg.timeout_s)
            except self._retryable as e:
                if isinstance(e, TimeoutError):
                    self.stats.timeouts += 1
                current.cancel()
                self._retry_or_raise(f"teacher stream of row {prow.row_id} at token {pos}", attempts, e)
                attempts += 1
                current = handle.stream.remote(prow, c, pos, cur_end, dtype)
                continue
            if chunk is None:
                if pos != cur_end:
                    raise RuntimeError(f"teacher stream of row {prow.row_id}: window ended at token {pos}, "
                                       f"expected {cur_end}")
                current = prefetched if prefetched is not None else open_window(pos)
                prefetched, cur_end = None, min(pos + window, t)
                continue
            if prefetched is None and cur_end < t:
                # The first chunk proves the session holds the hidden states: the next window reuses them.
                prefetched = open_window(cur_end)
            attempts = 1
            pos += chunk.shape[0]
            yield chunk
        # All tokens arrived; release the (finished) last window and any unused prefetch.
        current.cancel()
        if prefetched is not None:
            prefetched.cancel()
