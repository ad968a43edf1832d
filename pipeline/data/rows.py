"""The packed row: its contract, its one check, its fields on disk and its id. Everything that reads or
receives rows (the training reader, the teacher, evaluation, placement) holds a `PackedRow`.

Legend: T tokens of a row, N documents.

The contract (the data pipeline writes it; the reader, the teacher, evaluation, the model and its layers
rely on it):
* A packed row is N >= 1 documents laid end to end: `input_ids` [T], T >= 1, token ids >= 0.
* `cu_seqlens` [N + 1] (integers; int32 on disk and in the model) under the one rule of
  `hylo.kernels.varlen.boundaries_problem`: starts at 0, ends at T, strictly increasing.
* `position_ids` [T]: each token's index inside its document, restarting at 0 at every boundary
  (`positions_from_cu_seqlens`); optional where a consumer can derive it, checked where given.
* `loss_mask` [T] bool (optional), label-aligned: set at t when the label `input_ids[t + 1]` is scored;
  never on a document's last token, whose next token belongs to another document.
* `doc_ids` [N] (optional; the packer's padding tail is its own last document, doc id `PAD_DOC_ID` = ""),
  `row_id` (optional; else `PackedRow.row_id` is a hash of the tokens and the boundaries).

Design choices:
* On disk a row is one record of a Parquet file with these fields as columns (`ROW_FIELDS`; list columns,
  `doc_ids` a list of strings, `row_id` a string): `rowfile.py` reads and writes them.
* A row is checked once, where it enters the process (`check_row`, naming the record and the field;
  `PackedRowError`): by the reader (`reader.RowReader`) for every row it yields, or by whoever receives
  rows from outside (a Serve replica, evaluation's chat records). `check_row` of a `PackedRow` returns it
  as is, so a consumer handed a checked row does not check it again, except with `received=True`: a
  row that crossed a process boundary (the client sends `PackedRow`s to the Serve replicas) is checked
  again, field by field, whatever its type.
* A `PackedRow` keeps its boundaries as host ints (`host`) beside its CPU tensors, so `bounds(device)`
  gives the model its `DocBounds` with no check and no device-to-host copy. `to(device)` is the same row
  with its tensors on a compute device (the host boundaries kept), for a training step's forward.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hylo.kernels.varlen import BoundaryError, DocBounds, host_cu_seqlens, positions_from_cu_seqlens

# the fields of a packed row, in the order the data pipeline writes them
ROW_FIELDS = ("input_ids", "position_ids", "cu_seqlens", "loss_mask", "doc_ids", "row_id")
REQUIRED_FIELDS = ("input_ids", "cu_seqlens")
# doc id of the packer's padding document at the end of a padded row; real documents never have an empty id
PAD_DOC_ID = ""


class PackedRowError(BoundaryError):
    """A packed row breaks the contract of this module; the message names the record and the field."""


@dataclass(frozen=True)
class PackedRow:
    """One checked packed row, as CPU tensors (`to(device)`: on a compute device); see the module docstring
    for the contract."""

    # [T] int64 token ids
    input_ids: torch.Tensor
    # [N + 1] int32 boundaries
    cu_seqlens: torch.Tensor
    # [T] int64 positions inside the documents
    position_ids: torch.Tensor
    # [T] bool, label-aligned; None when the row has none
    loss_mask: torch.Tensor | None = None
    doc_ids: tuple[str, ...] | None = None
    # the dataset's own id, when it has one
    given_id: str | None = None
    # the N + 1 boundaries as host ints (checked; derived from cu_seqlens when not given)
    host: tuple[int, ...] = ()
    # where the reader found the row (the global row index, `syn-<g>` for synthetic rows) and in which
    # pass over the data; not `row_id`, which names the row's content
    key: str | None = None
    epoch: int = 0

    def __post_init__(self) -> None:
        if not self.host:
            object.__setattr__(self, "host", tuple(self.cu_seqlens.tolist()))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @functools.cached_property
    def loss_tokens(self) -> int:
        """Tokens whose label is scored (a host count: the mask is a CPU tensor)."""
        return 0 if self.loss_mask is None else int(self.loss_mask.sum())

    @functools.cached_property
    def row_id(self) -> str:
        """The dataset's row id, else a hash of the tokens and the boundaries (the same data, the same id)."""
        if self.given_id is not None:
            return self.given_id
        h = hashlib.blake2b(digest_size=16)
        h.update(self.input_ids.cpu().to(torch.int64).numpy().tobytes())
        h.update(b"|")
        h.update(self.cu_seqlens.cpu().to(torch.int64).numpy().tobytes())
        return h.hexdigest()

    def documents(self) -> list[tuple[int, int]]:
        """(start, end) token spans of the row's documents."""
        return list(zip(self.host[:-1], self.host[1:]))

    def real_tokens(self) -> torch.Tensor:
        """[T] float32: 1.0 on the tokens of real documents, 0.0 on the packer's padding document."""
        keep = torch.ones(self.num_tokens, dtype=torch.float32)
        for doc_id, (s, e) in zip(self.doc_ids or (), self.documents()):
            if doc_id == PAD_DOC_ID:
                keep[s:e] = 0.0
        return keep

    def real_token_count(self) -> int:
        """`real_tokens().sum()` from the host boundaries (no tensor read)."""
        return self.num_tokens - sum(e - s for doc_id, (s, e) in zip(self.doc_ids or (), self.documents())
                                     if doc_id == PAD_DOC_ID)

    def bounds(self, device: torch.device | str | None = None) -> DocBounds:
        """The row's boundaries for a forward on `device`: checked already, so no check and no
        device-to-host copy (the positions are the row's own)."""
        return DocBounds.make(self.cu_seqlens.to(device), self.host, self.position_ids.to(device))

    def to(self, device: torch.device | str) -> PackedRow:
        """The same row with its tensors on `device` (host boundaries, ids, key and epoch kept); onto a GPU
        from pinned memory without blocking (a copy from pageable memory synchronises the GPU)."""
        pinned = torch.device(device).type == "cuda"

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.pin_memory().to(device, non_blocking=True) if pinned else t.to(device)

        return dataclasses.replace(self, input_ids=move(self.input_ids), cu_seqlens=move(self.cu_seqlens),
                                   position_ids=move(self.position_ids), loss_mask=move(self.loss_mask))


def _int_field(row: Mapping[str, Any], name: str, where: str) -> torch.Tensor:
    value = row[name]
    try:
        # a copy, never a view of the caller's array (which may be read-only, e.g. a Parquet buffer)
        t = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
    except (TypeError, ValueError, RuntimeError) as e:
        raise PackedRowError(f"{where}: field {name!r} is not an integer array ({e})") from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise PackedRowError(f"{where}: field {name!r} must be 1-D, got shape {tuple(t.shape)}")
    # a loss mask may come as bool, 0/1 integers or 0./1. floats
    if name != "loss_mask" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise PackedRowError(f"{where}: field {name!r} must hold integers, got {t.dtype}")
    return t


def _bad(where: str):
    def bad(message: str):
        raise PackedRowError(f"{where}: {message}")

    return bad


def row_fields(row: PackedRow) -> dict[str, Any]:
    """A `PackedRow`'s fields as the mapping `check_row` reads (to check a row that came from elsewhere)."""
    return {"input_ids": row.input_ids, "cu_seqlens": row.cu_seqlens, "position_ids": row.position_ids,
            "loss_mask": row.loss_mask, "doc_ids": row.doc_ids, "row_id": row.given_id, "row_key": row.key,
            "epoch": row.epoch}


def check_row(row: Mapping[str, Any] | PackedRow, where: str = "row", max_len: int | None = None,
              clear_crossing_labels: bool = False, max_len_from: str | None = None,
              vocab_size: int | None = None, received: bool = False) -> PackedRow:
    """Check a packed row against the contract and return it as a `PackedRow` (CPU tensors).

    `row`: a mapping with `input_ids` and `cu_seqlens`, optionally `position_ids` (derived when absent,
    checked when given), `loss_mask`, `doc_ids`, `row_id`, and the reader's `row_key` / `epoch`. A
    `PackedRow` is returned as is (checked already, by this process), unless `received`: a row that came
    from another process (a Serve replica's request) is checked whatever its type, its host boundaries
    against its `cu_seqlens` too. `where` names the record in errors; `max_len` bounds the row's length
    (`max_len_from` says where that bound comes from, for the message); `vocab_size` bounds its token ids.
    `clear_crossing_labels`: a loss mask set on a document's last token is cleared instead of refused
    (evaluation scoring rows it did not pack). Raises PackedRowError.
    """
    if isinstance(row, PackedRow):
        if not received:
            return row
        checked = check_row(row_fields(row), where, max_len, clear_crossing_labels, max_len_from, vocab_size)
        if tuple(row.host) != checked.host:
            raise PackedRowError(f"{where}: its document boundaries {list(row.host)[:8]} disagree with field "
                                 f"'cu_seqlens' {list(checked.host)[:8]}")
        return checked
    if not isinstance(row, Mapping):
        raise PackedRowError(f"{where}: a packed row must be a mapping, got {type(row).__name__}")
    missing = [c for c in REQUIRED_FIELDS if row.get(c) is None]
    if missing:
        raise PackedRowError(f"{where}: missing field {', '.join(repr(c) for c in missing)} "
                             f"(have {sorted(row)}); a packed row needs input_ids and cu_seqlens")
    ids = _int_field(row, "input_ids", where).to(torch.int64)
    T = int(ids.shape[0])
    if T == 0:
        raise PackedRowError(f"{where}: field 'input_ids' is empty")
    if max_len is not None and T > max_len:
        raise PackedRowError(f"{where}: {T} tokens, more than max_len={max_len}"
                             + (f" ({max_len_from})" if max_len_from else ""))
    if int(ids.min()) < 0:
        raise PackedRowError(f"{where}: field 'input_ids' holds a negative token id {int(ids.min())}")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        t = int((ids >= vocab_size).nonzero()[0, 0])
        raise PackedRowError(f"{where}: field 'input_ids' holds token id {int(ids[t])} at token {t}, outside the "
                             f"vocabulary [0, {vocab_size})")
    host = host_cu_seqlens(_int_field(row, "cu_seqlens", where), T, _bad(where))
    cu = torch.tensor(host, dtype=torch.int32)
    expected = positions_from_cu_seqlens(cu, T)
    pos = expected
    if row.get("position_ids") is not None:
        pos = _int_field(row, "position_ids", where).to(torch.int64)
        if pos.shape[0] != T:
            raise PackedRowError(f"{where}: field 'position_ids' has {pos.shape[0]} entries, input_ids {T}")
        if not torch.equal(pos, expected):
            t = int((pos != expected).nonzero()[0, 0])
            raise PackedRowError(f"{where}: field 'position_ids' must restart at 0 at each document of "
                                 f"cu_seqlens; token {t} has {int(pos[t])}, expected {int(expected[t])}")
    mask = None
    if row.get("loss_mask") is not None:
        mask = _int_field(row, "loss_mask", where).to(torch.bool)
        if mask.shape[0] != T:
            raise PackedRowError(f"{where}: field 'loss_mask' has {mask.shape[0]} entries for {T} tokens")
        last = cu[1:].long() - 1
        if clear_crossing_labels:
            mask = mask.clone()
            mask[last] = False
        elif bool(mask[last].any()):
            d = int(mask[last].nonzero()[0, 0])
            raise PackedRowError(f"{where}: field 'loss_mask' is set on the last token of document {d} "
                                 f"(tokens [{host[d]}, {host[d + 1]})): its label would cross documents")
    doc_ids = None
    if row.get("doc_ids") is not None:
        doc_ids = tuple(str(d) for d in row["doc_ids"])
        if len(doc_ids) != len(host) - 1:
            raise PackedRowError(f"{where}: field 'doc_ids' has {len(doc_ids)} entries for the {len(host) - 1} "
                                 "documents of cu_seqlens")
    rid, key = row.get("row_id"), row.get("row_key")
    return PackedRow(ids, cu, pos, mask, doc_ids, None if rid is None else str(rid), host,
                     None if key is None else str(key), int(row.get("epoch") or 0))
