"""Packed rows in Parquet: the columns' types (`ROW_SCHEMA`), a table of rows to write (`rows_to_table`),
and the one reader of a file (`PackedRowFile`): a shard of the data pipeline or any file with the row columns.

The one reader of rows (`reader.RowReader`, for training, evaluation, placement and the teacher-cache
job) reads files through `PackedRowFile`, one per file. What it returns is a row as read (a dict of numpy
arrays, `doc_ids` / `row_id` as Python values); the `RowReader` checks each row against the contract
(`hylo.pipeline.data.rows.check_row`, naming the file and the row).

Design choices:
* Row groups are the I/O unit: a row is read with its whole row group, which stays cached, so reading
  rows in order decodes each row group once and a random row costs one row-group read.
* List columns (list or large_list) become numpy through their offsets/values buffers, not `to_pylist`,
  which would box every token of a 64K row into a Python int.
* Damage is named, never skipped: an unreadable file, a missing column, an unreadable row group (with the
  rows it holds) or a null cell raises `DataFormatError` naming the file (and row group or row). Training
  rows cannot be skipped (positions and resume would shift), and a silently shorter evaluation or cache
  is worse than a stop.
* Corruption is found, not trained on: the project's Parquet files (shards, teacher-cache shards) are
  written with page checksums (`PAGE_CHECKSUMS`: a CRC-32 of every data page, Parquet's own) and read
  with their verification on, so a flipped byte in a page is an error naming the file and row group
  (zstd alone let ~60 % of one-byte flips through as changed token ids). Verifying costs the reader
  little (bench/shard_checksums.py). A file written without checksums (a dataset prepared before they
  were written) reads as before, unverified: Parquet skips the check of a page that has no checksum.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hylo.pipeline.data.rows import REQUIRED_FIELDS, ROW_FIELDS

# fields read as Python values (strings), not as numpy arrays
_PY_FIELDS = ("doc_ids", "row_id")
# `pq.write_table` options of every Parquet file the project writes: a CRC-32 of each data page
PAGE_CHECKSUMS: dict[str, Any] = {"write_page_checksum": True}


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A Parquet file opened for reading with its page checksums verified (pages without one: unverified)."""
    return pq.ParquetFile(path, page_checksum_verification=True)


def damage(e: BaseException) -> str:
    """pyarrow's words for an unreadable page, with a checksum mismatch said plainly."""
    text = _one_line(e)
    if "CRC checksum verification failed" in text:
        return f"a page's checksum does not match its bytes: the file changed after it was written ({text})"
    return text


# the columns the data pipeline writes (a file may add `row_id`)
ROW_SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("position_ids", pa.list_(pa.int32())),
    ("cu_seqlens", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.bool_())),
    ("doc_ids", pa.list_(pa.string())),
])


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Packed rows (mappings of arrays, as the packer gives them) as a table of `ROW_SCHEMA`."""
    cols = {}
    for name in ("input_ids", "position_ids", "cu_seqlens", "loss_mask"):
        typ = ROW_SCHEMA.field(name).type
        arrays = [np.asarray(r[name]) for r in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        vals = np.concatenate(arrays) if arrays else np.zeros(0)
        cols[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals, type=typ.value_type))
    cols["doc_ids"] = pa.array([list(r["doc_ids"]) for r in rows], ROW_SCHEMA.field("doc_ids").type)
    return pa.table(cols, schema=ROW_SCHEMA)


class DataFormatError(ValueError):
    """A file or directory of packed rows is missing, incomplete, inconsistent or unreadable; names the file."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


class PackedRowFile:
    """One Parquet file of packed rows (at least `input_ids` and `cu_seqlens` list columns).

    `remedy` ends the message of an unreadable row group (what the user can do about it); `noun` names the
    file in it ("shard" for the data pipeline's shards).
    """

    def __init__(self, path: str | Path, noun: str = "file", remedy: str = "restore the file or write it again"):
        self.path = Path(path)
        self.noun, self.remedy = noun, remedy
        if not self.path.is_file():
            raise DataFormatError(f"{self.path}: no such file")
        try:
            self.pf = open_parquet(self.path)
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(f"{self.path}: not a readable Parquet {noun} ({_one_line(e)})") from None
        names = set(self.pf.schema_arrow.names)
        missing = [c for c in REQUIRED_FIELDS if c not in names]
        if missing:
            raise DataFormatError(f"{self.path}: not packed rows, missing column(s) {sorted(missing)}; "
                                  f"found {sorted(names)}")
        self.columns = [c for c in ROW_FIELDS if c in names]
        self.num_rows = self.pf.metadata.num_rows
        self._group_start = [0]
        for rg in range(self.pf.num_row_groups):
            self._group_start.append(self._group_start[-1] + self.pf.metadata.row_group(rg).num_rows)
        self._cached: tuple[int, dict[str, pa.Array]] | None = None

    def __len__(self) -> int:
        return self.num_rows

    def _row_group(self, rg: int) -> dict[str, pa.Array]:
        if self._cached is None or self._cached[0] != rg:
            try:
                table = self.pf.read_row_group(rg, columns=self.columns)
            except (pa.ArrowException, OSError) as e:
                first, end = self._group_start[rg], self._group_start[rg + 1]
                raise DataFormatError(
                    f"{self.path}: row group {rg} (rows {first}..{end - 1} of the {self.noun}) is unreadable "
                    f"({damage(e)}); {self.remedy}") from None
            self._cached = (rg, {c: table.column(c).combine_chunks() for c in self.columns})
        return self._cached[1]

    def drop_cache(self) -> None:
        """Free the cached row group (a reader moving on to another file)."""
        self._cached = None

    def row(self, r: int) -> dict[str, Any]:
        """Row `r` of the file (0-based) as read: numpy arrays, plus `doc_ids` / `row_id` as Python values."""
        if not 0 <= r < self.num_rows:
            raise IndexError(f"{self.path}: row {r} outside [0, {self.num_rows})")
        rg = bisect.bisect_right(self._group_start, r) - 1
        cols = self._row_group(rg)
        i = r - self._group_start[rg]
        row: dict[str, Any] = {}
        for c, col in cols.items():
            if not col[i].is_valid:
                raise DataFormatError(f"{self.path} row {r}: field {c!r} is null")
            if c in _PY_FIELDS:
                row[c] = col[i].as_py()
            else:
                start, end = col.offsets[i].as_py(), col.offsets[i + 1].as_py()
                row[c] = col.values.slice(start, end - start).to_numpy(zero_copy_only=False)
        return row

    def rows(self, start: int = 0, end: int | None = None) -> Iterator[dict[str, Any]]:
        """Rows [start, end) in order (each row group decoded once)."""
        end = self.num_rows if end is None else min(end, self.num_rows)
        for r in range(start, end):
            yield self.row(r)
