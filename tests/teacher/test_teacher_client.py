"""TeacherClient against a scripted fake handle (no Ray): order, retries, timeouts, back-pressure."""

from __future__ import annotations

import random

import pytest
import ray.exceptions as rx
import torch

from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.teacher.client import TeacherClient, TeacherUnavailableError

from tests.helpers.teacher import make_packed_row

VOCAB = 50


def _record(row) -> dict[str, torch.Tensor]:
    # Deterministic per-row content: any mix-up of rows shows in the values.
    ids = row.input_ids
    return {"logprobs": ids[:, None].to(torch.float16).expand(-1, 2).clone(),
            "indices": ids[:, None].to(torch.int32).expand(-1, 2).clone(),
            "tail_logmass": torch.full((ids.shape[0],), float(row.num_tokens))}


class FakeResponse:
    def __init__(self, handle: FakeHandle, row, outcome: str) -> None:
        self.handle, self.row, self.outcome, self.done = handle, row, outcome, False
        handle.outstanding += 1
        handle.max_outstanding = max(handle.max_outstanding, handle.outstanding)

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.handle.outstanding -= 1

    def result(self, timeout_s=None):
        self.handle.waits.append(timeout_s)
        if self.outcome == "timeout":
            raise rx.GetTimeoutError("scripted timeout")
        self._finish()
        if self.outcome == "die":
            raise rx.ActorDiedError()
        if self.outcome == "bad":
            raise ValueError("scripted user error: bad row")
        return [_record(self.row)]

    def cancel(self) -> None:
        self.handle.cancelled += 1
        self._finish()


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class FakeHandle:
    """`topk.remote(row, k, dtype)`; `script[(row_id, attempt)]` = 'die' | 'timeout' | 'bad'."""

    def __init__(self, script: dict | None = None) -> None:
        self.script = script or {}
        self.attempts: dict[str, int] = {}
        self.outstanding = self.max_outstanding = self.cancelled = 0
        self.waits: list = []
        self.topk = _Method(self._topk)

    def _topk(self, row, k, dtype):
        n = self.attempts[row.row_id] = self.attempts.get(row.row_id, 0) + 1
        return FakeResponse(self, row, self.script.get((row.row_id, n), "ok"))


def _rows(n: int, seed: int = 0) -> list[PackedRow]:
    # the reader's rows: checked (a bad row is refused where it is read, and again by the pool's server)
    rng = random.Random(seed)
    return [check_row(make_packed_row([rng.randint(2, 9) for _ in range(rng.randint(1, 3))], VOCAB, seed=seed * 100 + i))
            for i in range(n)]


def _check_in_order(rows, results: list[TeacherTopK]) -> None:
    assert len(results) == len(rows)
    for row, rec in zip(rows, results):
        exp = _record(check_row(row))
        assert torch.equal(rec.indices, exp["indices"]) and torch.equal(rec.tail_logmass, exp["tail_logmass"])


@pytest.mark.parametrize("inflight", [1, 3, 8], ids=lambda n: f"inflight{n}")
def test_results_in_order_and_inflight_bounded(inflight):
    rows = _rows(12)
    h = FakeHandle()
    res = TeacherClient(h, max_inflight_rows=inflight, retry_backoff_s=0).topk_all(rows, 2)
    _check_in_order(rows, res)
    assert h.max_outstanding == min(inflight, len(rows)) and h.outstanding == 0


def test_failures_and_timeouts_are_retried_without_drop_or_duplicate():
    rows = _rows(10, seed=1)
    ids = [check_row(r).row_id for r in rows]
    script = {(ids[0], 1): "die", (ids[3], 1): "timeout", (ids[3], 2): "die", (ids[7], 1): "timeout",
              (ids[9], 1): "die", (ids[9], 2): "die", (ids[9], 3): "die"}
    h = FakeHandle(script)
    client = TeacherClient(h, max_inflight_rows=4, max_retries=3, timeout_s=5.0, retry_backoff_s=0)
    res = client.topk_all(rows, 2)
    _check_in_order(rows, res)
    assert client.stats.rows == 10 and client.stats.retries == 7 and client.stats.timeouts == 2
    # Each timed-out request was cancelled before its row was resent.
    assert h.cancelled == 2 and h.outstanding == 0
    assert all(w is not None and 0 < w <= 5.0 for w in h.waits)


def test_gives_up_after_max_retries_naming_the_row():
    rows = _rows(3, seed=2)
    rid = check_row(rows[1]).row_id
    h = FakeHandle({(rid, n): "die" for n in range(1, 10)})
    client = TeacherClient(h, max_inflight_rows=2, max_retries=2, retry_backoff_s=0)
    it = client.topk(rows, 2)
    next(it)
    with pytest.raises(TeacherUnavailableError, match=f"teacher row 1 \\(row_id {rid}\\) failed 3 time"):
        next(it)


def test_user_errors_are_not_retried():
    rows = _rows(2, seed=3)
    h = FakeHandle({(check_row(rows[0]).row_id, 1): "bad"})
    with pytest.raises(ValueError, match="scripted user error"):
        TeacherClient(h, retry_backoff_s=0).topk_all(rows, 2)
    assert h.attempts[check_row(rows[0]).row_id] == 1


def test_backpressure_pulls_input_lazily():
    rows = _rows(20, seed=4)
    pulled = []

    def source():
        for i, r in enumerate(rows):
            pulled.append(i)
            yield r

    h = FakeHandle()
    it = TeacherClient(h, max_inflight_rows=3).topk(source(), 2)
    next(it)
    # One result consumed: only the in-flight window has been read from the source.
    assert len(pulled) == 3
    next(it)
    assert len(pulled) == 4
    # A consumer that stops early cancels what is still in flight.
    it.close()
    assert h.outstanding == 0 and h.cancelled == 2


class FakeStream:
    """Async iterator over chunk-sized slices of a fake [T, 3] logit table (value = token index)."""

    def __init__(self, h: FakeStreamHandle, row, c: int, start: int, end: int, outcome: tuple) -> None:
        self.h, self.c, self.pos, self.end, self.outcome, self.sent = h, c, start, end, outcome, 0
        h.open_windows += 1
        h.max_open = max(h.max_open, h.open_windows)
        h.windows.append((start, end))
        self.closed = False

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.h.open_windows -= 1

    async def __anext__(self):
        import asyncio

        kind, after = self.outcome
        if kind != "ok" and self.sent == after:
            if kind == "hang":
                await asyncio.sleep(30)
            self._close()
            raise rx.ActorDiedError()
        if self.pos >= self.end:
            self._close()
            raise StopAsyncIteration
        e = min(self.pos + self.c, self.end)
        chunk = torch.arange(self.pos, e, dtype=torch.float32)[:, None].expand(-1, 3).clone()
        self.pos, self.sent = e, self.sent + 1
        return chunk

    def cancel(self) -> None:
        self._close()


class FakeStreamHandle:
    """`script[(start, attempt)]` = ('die' | 'hang', after_n_chunks)."""

    def __init__(self, script: dict | None = None) -> None:
        self.script, self.attempts = script or {}, {}
        self.open_windows = self.max_open = 0
        self.windows: list = []
        self.stream = _Method(self._stream)
        self.options_seen: list = []

    def options(self, **kw):
        self.options_seen.append(kw)
        return self

    def _stream(self, row, c, start, end, dtype):
        n = self.attempts[start] = self.attempts.get(start, 0) + 1
        return FakeStream(self, row, c, start, end, self.script.get((start, n), ("ok", 0)))


@pytest.mark.parametrize("script", [{}, {(9, 1): ("die", 1), (0, 1): ("die", 0)}, {(18, 1): ("hang", 1)}],
                         ids=["clean", "deaths", "hang"])
def test_stream_windows_in_order_exactly_once_bounded(script):
    row = check_row(make_packed_row([13, 12], VOCAB, seed=9))
    h = FakeStreamHandle(script)
    client = TeacherClient(h, timeout_s=0.3, max_retries=2, retry_backoff_s=0, chunk_tokens=3, window_chunks=3)
    chunks = list(client.stream(row))
    got = torch.cat(chunks)[:, 0]
    assert torch.equal(got, torch.arange(25, dtype=torch.float32))
    # At most the current window and one prefetched window are ever open.
    assert h.max_open <= 2 and h.open_windows == 0
    assert h.options_seen[0]["stream"] is True and h.options_seen[0]["multiplexed_model_id"]
    assert client.stats.retries == len(script) and client.stats.timeouts == sum(v[0] == "hang" for v in script.values())
