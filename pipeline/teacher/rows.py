"""Packed rows as the teacher sees them: validation, stable row ids, and reading them from Parquet.

Legend: T tokens in a row, N documents in a row.

A packed row (see the shared contract) is a mapping with `input_ids [T]`, `position_ids [T]`
(restarting at 0 per document), `cu_seqlens [N+1]` (0 ... T), and optionally `loss_mask [T]`,
`doc_ids [N]` and `row_id`. Design choices:
* One validator (`as_packed_row`) used by the in-process teacher, the Serve replicas and the offline
  cache, so every entry point rejects the same bad input with the same message naming the record
  and the field.
* `position_ids` may be omitted (derived from `cu_seqlens`); when given they must restart at 0 per
  document, because the teacher's document isolation and the student's must agree.
* The row id is the dataset's own `row_id` when it has one, else a content hash of
  `input_ids` + `cu_seqlens`: a cache lookup then also proves the row is the same data.
* Parquet list columns are turned into numpy through their offsets/values buffers, not `to_pylist`,
  which would box every token of a 64K row into a Python int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REQUIRED_COLUMNS = ("input_ids", "cu_seqlens")


class RowError(ValueError):
    """A packed row is malformed; the message names the record and the field."""


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    row_id: str

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def documents(self) -> list[tuple[int, int]]:
        """(start, end) token spans of the row's documents."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))


def _as_1d_int(value: Any, name: str, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        try:
            t = torch.from_numpy(np.array(value))
        except (TypeError, ValueError) as e:
            raise RowError(f"{where}: field {name!r} is not an integer array ({e})") from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise RowError(f"{where}: field {name!r} must be 1-D, got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise RowError(f"{where}: field {name!r} must hold integers, got {t.dtype}")
    return t.to(torch.int64)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Positions restarting at 0 at each document start: [T] int64."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    return torch.arange(num_tokens, dtype=torch.int64) - starts


def row_content_id(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> str:
    """Stable id of a row's content (tokens and document boundaries)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(input_ids.to(torch.int64).numpy().tobytes())
    h.update(b"|")
    h.update(cu_seqlens.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def as_packed_row(row: Mapping[str, Any] | PackedRow, where: str = "row") -> PackedRow:
    """Validate a packed row and return it as int64 CPU tensors plus its row id."""
    if isinstance(row, PackedRow):
        return row
    if not isinstance(row, Mapping):
        raise RowError(f"{where}: a packed row must be a mapping, got {type(row).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if row.get(c) is None]
    if missing:
        raise RowError(f"{where}: missing field(s) {', '.join(missing)}; a packed row needs "
                       f"input_ids and cu_seqlens (position_ids optional)")
    ids = _as_1d_int(row["input_ids"], "input_ids", where)
    cu = _as_1d_int(row["cu_seqlens"], "cu_seqlens", where)
    t = int(ids.shape[0])
    if t == 0:
        raise RowError(f"{where}: field 'input_ids' is empty")
    if cu.shape[0] < 2 or int(cu[0]) != 0 or int(cu[-1]) != t:
        raise RowError(f"{where}: field 'cu_seqlens' must start at 0 and end at len(input_ids)={t}, "
                       f"got {cu.tolist()[:8]}{'...' if cu.shape[0] > 8 else ''}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise RowError(f"{where}: field 'cu_seqlens' must be strictly increasing (no empty documents)")
    if int(ids.min()) < 0:
        raise RowError(f"{where}: field 'input_ids' holds a negative token id {int(ids.min())}")
    expected_pos = positions_from_cu_seqlens(cu, t)
    if row.get("position_ids") is None:
        pos = expected_pos
    else:
        pos = _as_1d_int(row["position_ids"], "position_ids", where)
        if pos.shape[0] != t:
            raise RowError(f"{where}: field 'position_ids' has {pos.shape[0]} entries, input_ids {t}")
        if not torch.equal(pos, expected_pos):
            bad = int((pos != expected_pos).nonzero()[0, 0])
            raise RowError(f"{where}: field 'position_ids' must restart at 0 at each document of "
                           f"cu_seqlens; token {bad} has {int(pos[bad])}, expected {int(expected_pos[bad])}")
    rid = row.get("row_id")
    row_id = str(rid) if rid is not None else row_content_id(ids, cu)
    return PackedRow(ids, pos, cu.to(torch.int32), row_id)


def _list_cell(column: Any, i: int) -> np.ndarray:
    """Row `i` of a pyarrow (large_)list column as a numpy array without boxing the elements."""
    start = column.offsets[i].as_py()
    end = column.offsets[i + 1].as_py()
    return column.values.slice(start, end - start).to_numpy(zero_copy_only=False)


def read_packed_rows(path: str | Path, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
    """Rows [start, end) of a Parquet file of packed rows, as dicts of numpy arrays (+ row_id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise RowError(f"{path}: not a readable Parquet file ({e})") from None
    names = set(pf.schema_arrow.names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise RowError(f"{path}: missing column(s) {', '.join(missing)}; found {sorted(names)}")
    wanted = [c for c in ("input_ids", "position_ids", "cu_seqlens", "loss_mask", "doc_ids", "row_id") if c in names]
    n = pf.metadata.num_rows
    end = n if end is None else min(end, n)
    try:
        table = pf.read(columns=wanted).slice(start, end - start)
    except (pa.ArrowException, OSError) as e:
        raise RowError(f"{path}: unreadable Parquet data ({e})") from None
    cols = {c: table.column(c).combine_chunks() for c in wanted}
    rows = []
    for i in range(end - start):
        row: dict[str, Any] = {}
        for c, col in cols.items():
            if not col[i].is_valid:
                raise RowError(f"{path} row {start + i}: field {c!r} is null")
            row[c] = col[i].as_py() if c in ("row_id", "doc_ids") else _list_cell(col, i)
        rows.append(row)
    return rows
