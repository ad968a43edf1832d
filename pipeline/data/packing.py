"""Best-fit packing of tokenised documents into fixed-capacity rows, streaming.

Legend: L = tokens of one document, T = tokens of one row (== max_len when padded), N = documents
in a row (the padding tail, if any, counts as one).

Design choices:
* Best-fit decreasing inside a streaming window: documents are buffered `window` at a time, sorted
  longest first and each put into the open row with the least free space that still holds it (a new
  row when none does). Rows stay open across windows so later small documents fill earlier gaps;
  a row closes when full, when its free space is at most `close_slack` tokens, or when more than
  `max_open_rows` rows are open (then the fullest close first). Every decision depends only on the
  input order, so the same input gives the same rows.
* Documents are never cut to fill a row. Only a document longer than `max_len` is split into
  `max_len` windows, truncated or dropped (`long_doc_policy`), and each case is counted.
* `min_loss_tokens` > 0 drops every piece (a document, or one window of a split one) with fewer loss
  tokens, counted in `pieces_without_loss` / `tokens_without_loss`: a loss computed on assistant tokens
  only (stage 2's KL) spends nothing but compute on them, and a window's segment gives no context to the
  next one. With 512-token rows about 18 % of ShareGPT's tokens sit in such windows of long user turns.
* The loss mask is label-aligned: `loss_mask[t] = 1` when the label of position t, i.e.
  `input_ids[t + 1]`, is an assistant token of the same document. The last token of every document
  (and of every piece of a split document) is 0, so no label crosses a document boundary.
* Rows follow the packed-row contract of `pipeline/data/rows.py` (checked by `hylo.pipeline.data.rows.check_row`):
  positions restart at 0 per document; `cu_seqlens` (int32) starts at 0, ends exactly at T and never
  holds an empty document; a padded tail is its own final segment (doc id `PAD_DOC_ID`, loss mask 0),
  because varlen kernels leave anything after `cu_seqlens[-1]` unwritten.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hylo.pipeline.data.config import LONG_DOC_POLICIES
from hylo.pipeline.data.rows import PAD_DOC_ID


@dataclass
class Document:
    """One tokenised document: `input_ids` [L] and `assistant_mask` [L] (token belongs to an assistant reply)."""

    doc_id: str
    input_ids: np.ndarray
    assistant_mask: np.ndarray

    def __post_init__(self) -> None:
        if not self.doc_id:
            raise ValueError("document has an empty doc_id")
        if self.input_ids.ndim != 1 or self.assistant_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"document {self.doc_id!r}: input_ids {tuple(self.input_ids.shape)} and assistant_mask "
                f"{tuple(self.assistant_mask.shape)} must be 1-D of the same length"
            )
        if len(self.input_ids) == 0:
            raise ValueError(f"document {self.doc_id!r} has no tokens")


@dataclass
class _Piece:
    """A document (or one window of a long one) ready to place: ids, label-aligned loss mask."""

    doc_id: str
    input_ids_L: np.ndarray
    loss_mask_L: np.ndarray
    seq: int

    def __len__(self) -> int:
        return len(self.input_ids_L)


@dataclass
class _OpenRow:
    seq: int
    free: int
    pieces: list[_Piece] = field(default_factory=list)


@dataclass
class PackingStats:
    """Counts of one packing run; `efficiency` = non-padding tokens / (rows * max_len)."""

    max_len: int = 0
    documents: int = 0
    tokens_in: int = 0
    pieces: int = 0
    tokens_packed: int = 0
    loss_tokens: int = 0
    rows: int = 0
    pad_tokens: int = 0
    docs_split: int = 0
    docs_truncated: int = 0
    tokens_truncated: int = 0
    docs_dropped: int = 0
    tokens_dropped: int = 0
    pieces_without_loss: int = 0
    tokens_without_loss: int = 0

    @property
    def efficiency(self) -> float:
        return self.tokens_packed / (self.rows * self.max_len) if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["efficiency"] = self.efficiency
        return d


def label_aligned_mask(assistant_mask_L: np.ndarray) -> np.ndarray:
    """loss_mask[t] = assistant_mask[t + 1]; the last position has no label in this document."""
    loss_L = np.zeros(len(assistant_mask_L), dtype=np.bool_)
    loss_L[:-1] = assistant_mask_L[1:].astype(np.bool_)
    return loss_L


def build_row(pieces: list[_Piece] | list[Document], max_len: int, pad_id: int, pad: bool) -> dict[str, Any]:
    """Concatenate documents into one row dict (numpy arrays); pad the tail as its own segment."""
    ids, pos, mask, lens, doc_ids = [], [], [], [], []
    for p in pieces:
        if isinstance(p, Document):
            p_ids, p_mask = p.input_ids, label_aligned_mask(p.assistant_mask)
        else:
            p_ids, p_mask = p.input_ids_L, p.loss_mask_L
        ids.append(p_ids.astype(np.int32, copy=False))
        mask.append(p_mask)
        pos.append(np.arange(len(p_ids), dtype=np.int32))
        lens.append(len(p_ids))
        doc_ids.append(p.doc_id)
    used = sum(lens)
    if used > max_len:
        raise ValueError(f"row of {used} tokens exceeds max_len {max_len}")
    if pad and used < max_len:
        n_pad = max_len - used
        ids.append(np.full(n_pad, pad_id, dtype=np.int32))
        mask.append(np.zeros(n_pad, dtype=np.bool_))
        pos.append(np.arange(n_pad, dtype=np.int32))
        lens.append(n_pad)
        doc_ids.append(PAD_DOC_ID)
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=cu[1:])
    return {
        "input_ids": np.concatenate(ids),
        "position_ids": np.concatenate(pos),
        "cu_seqlens": cu,
        "loss_mask": np.concatenate(mask),
        "doc_ids": doc_ids,
    }


class BestFitPacker:
    """Streaming best-fit-decreasing packer. `add(doc)` / `flush()` return the rows that closed.

    Rows are dicts of numpy arrays: input_ids [T] int32, position_ids [T] int32, cu_seqlens [N+1]
    int32, loss_mask [T] bool, doc_ids list[str] (N entries).
    """

    def __init__(
        self,
        max_len: int,
        window: int = 1024,
        max_open_rows: int = 64,
        close_slack: int = 0,
        long_doc_policy: str = "split",
        pad_id: int = 0,
        pad_to_max_len: bool = True,
        min_loss_tokens: int = 0,
    ) -> None:
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        if window < 1 or max_open_rows < 1:
            raise ValueError(f"window ({window}) and max_open_rows ({max_open_rows}) must be >= 1")
        if long_doc_policy not in LONG_DOC_POLICIES:
            raise ValueError(f"long_doc_policy {long_doc_policy!r} is not one of {LONG_DOC_POLICIES}")
        if min_loss_tokens < 0:
            raise ValueError(f"min_loss_tokens must be >= 0, got {min_loss_tokens}")
        self.max_len = max_len
        self.window = window
        self.max_open_rows = max_open_rows
        self.close_slack = close_slack
        self.long_doc_policy = long_doc_policy
        self.pad_id = pad_id
        self.pad_to_max_len = pad_to_max_len
        self.min_loss_tokens = min_loss_tokens
        self.stats = PackingStats(max_len=max_len)
        self._pending: list[_Piece] = []
        self._open: dict[int, _OpenRow] = {}
        # Sorted (free, row seq) of open rows: bisect finds the tightest row that still fits.
        self._by_free: list[tuple[int, int]] = []
        self._piece_seq = 0
        self._row_seq = 0

    # -- input -------------------------------------------------------------------------------
    def add(self, doc: Document) -> list[dict[str, Any]]:
        st = self.stats
        st.documents += 1
        n = len(doc.input_ids)
        st.tokens_in += n
        loss_L = label_aligned_mask(doc.assistant_mask)
        ids_L = doc.input_ids
        if n <= self.max_len:
            self._push(doc.doc_id, ids_L, loss_L)
        elif self.long_doc_policy == "drop":
            st.docs_dropped += 1
            st.tokens_dropped += n
        elif self.long_doc_policy == "truncate":
            st.docs_truncated += 1
            st.tokens_truncated += n - self.max_len
            self._push(doc.doc_id, ids_L[: self.max_len], self._cut(loss_L[: self.max_len]))
        else:
            st.docs_split += 1
            for k, s in enumerate(range(0, n, self.max_len)):
                e = min(s + self.max_len, n)
                self._push(f"{doc.doc_id}@{k}", ids_L[s:e], self._cut(loss_L[s:e]))
        if len(self._pending) >= self.window:
            return self._pack_window()
        return []

    def add_many(self, docs: Iterable[Document]) -> Iterator[dict[str, Any]]:
        for d in docs:
            yield from self.add(d)
        yield from self.flush()

    def flush(self) -> list[dict[str, Any]]:
        """Place what is pending and close every open row (end of stream)."""
        rows = self._pack_window()
        for seq in sorted(self._open):
            rows.append(self._close(seq))
        return rows

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _cut(loss_L: np.ndarray) -> np.ndarray:
        # A window's last label would be the next window's first token, which sits in another
        # segment (possibly another row): it has no valid label here.
        out = loss_L.copy()
        out[-1] = False
        return out

    def _push(self, doc_id: str, ids_L: np.ndarray, loss_L: np.ndarray) -> None:
        if self.min_loss_tokens and int(loss_L.sum()) < self.min_loss_tokens:
            self.stats.pieces_without_loss += 1
            self.stats.tokens_without_loss += len(ids_L)
            return
        self._pending.append(_Piece(doc_id, ids_L, loss_L, self._piece_seq))
        self._piece_seq += 1
        self.stats.pieces += 1

    def _pack_window(self) -> list[dict[str, Any]]:
        pending, self._pending = self._pending, []
        pending.sort(key=lambda p: (-len(p), p.seq))
        for p in pending:
            n = len(p)
            i = bisect.bisect_left(self._by_free, (n, -1))
            if i < len(self._by_free):
                free, seq = self._by_free.pop(i)
                row = self._open[seq]
            else:
                seq = self._row_seq
                self._row_seq += 1
                row = self._open[seq] = _OpenRow(seq=seq, free=self.max_len)
            row.pieces.append(p)
            row.free -= n
            bisect.insort(self._by_free, (row.free, seq))
        closed: list[dict[str, Any]] = []
        # Full (or nearly full) rows close now; then the fullest close until few enough stay open.
        while self._by_free and (
            self._by_free[0][0] <= self.close_slack or len(self._by_free) > self.max_open_rows
        ):
            _, seq = self._by_free[0]
            closed.append(self._close(seq))
        return closed

    def _close(self, seq: int) -> dict[str, Any]:
        row = self._open.pop(seq)
        self._by_free.remove((row.free, seq))
        st = self.stats
        st.rows += 1
        used = self.max_len - row.free
        st.tokens_packed += used
        st.pad_tokens += row.free if self.pad_to_max_len else 0
        st.loss_tokens += int(sum(int(p.loss_mask_L.sum()) for p in row.pieces))
        # Inside a row, documents keep their arrival order (not the size order used to place them).
        pieces = sorted(row.pieces, key=lambda p: p.seq)
        return build_row(pieces, self.max_len, self.pad_id, self.pad_to_max_len)

