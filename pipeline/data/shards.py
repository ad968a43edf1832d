"""A prepared dataset on disk: Parquet shards of packed rows and the manifest that lists them.

Design choices:
* Shards: `shard-00000.parquet`, ... (the columns of `rowfile.ROW_SCHEMA`: input_ids int32, position_ids
  int32, cu_seqlens int32, loss_mask bool, doc_ids string), each written to a temp name and renamed, with
  Parquet page checksums (`page_checksums: true` in its manifest entry; the reader verifies them); the
  manifest (`manifest.json`) is written last, so a directory with a manifest is complete.
* The manifest is the source of what the rows are: their split, their length bound `max_len` (the data
  job's `packing.max_len`; training takes it from here), the hash of the config that made them, and the
  shards with their row counts (checked against each shard's footer when it is opened).
* A shard is a file of the dataset's own directory, listed once (`hylo.manifest_paths.confined_paths`, checked when
  the manifest is read, before any row): a manifest naming `../other/shard-00000.parquet`, an absolute path,
  `shard-00000.parquet/.`, a link that leads out of the directory, one shard twice, or a directory or FIFO
  where a shard should be is refused, naming the entry and why. The manifest itself is the dataset's own
  file: one that is a link to another dataset's is refused as such (`hylo.manifest_paths.own_file`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from hylo.atomic import atomic_path, atomic_write
from hylo.json_files import read_json
from hylo.manifest_paths import confined_paths, own_file
from hylo.pipeline.data.rowfile import PAGE_CHECKSUMS, DataFormatError, rows_to_table

MANIFEST = "manifest.json"
FORMAT = "hylo-packed-rows/1"


class ShardWriter:
    """Buffers rows and writes `shard-NNNNN.parquet` files atomically; `finish()` returns their list."""

    def __init__(self, directory: str | Path, rows_per_shard: int, row_group_rows: int) -> None:
        if rows_per_shard < 1 or row_group_rows < 1:
            raise ValueError("rows_per_shard and row_group_rows must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows_per_shard = rows_per_shard
        self.row_group_rows = row_group_rows
        self.shards: list[dict[str, Any]] = []
        self._buf: list[dict[str, Any]] = []
        # rows added so far (written or buffered)
        self.rows = 0

    def add(self, row: dict[str, Any]) -> None:
        self._buf.append(row)
        self.rows += 1
        if len(self._buf) >= self.rows_per_shard:
            self._write()

    def finish(self) -> list[dict[str, Any]]:
        if self._buf:
            self._write()
        return self.shards

    def _write(self) -> None:
        rows, self._buf = self._buf, []
        name = f"shard-{len(self.shards):05d}.parquet"
        with atomic_path(self.dir / name) as tmp:
            pq.write_table(rows_to_table(rows), tmp, row_group_size=self.row_group_rows, compression="zstd",
                           **PAGE_CHECKSUMS)
        self.shards.append({
            "file": name,
            "rows": len(rows),
            "tokens": int(sum(len(r["input_ids"]) for r in rows)),
            # every data page carries its CRC-32, verified by the reader (rowfile.PAGE_CHECKSUMS)
            "page_checksums": True,
        })


def write_manifest(directory: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(directory) / MANIFEST
    atomic_write(path, json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=False))
    return path


def read_manifest(directory: str | Path) -> dict[str, Any]:
    # the dataset's own manifest: never another dataset's through a link, never a pipe or a directory
    path = own_file(directory, MANIFEST, DataFormatError)
    if not path.is_file():
        raise DataFormatError(f"{path} not found: not a packed-data directory, or its job did not finish")
    m = read_json(path, DataFormatError)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataFormatError(f"{path}: format is {m.get('format') if isinstance(m, dict) else m!r}, expected {FORMAT}")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) and "file" in s and "rows" in s for s in shards):
        raise DataFormatError(f"{path}: field 'shards' must be a list of {{file, rows}}")
    # every shard a file of this dataset, each once: never another dataset's rows read as this one's
    confined_paths(directory, [s["file"] for s in shards], path, "shards", DataFormatError)
    max_len = m.get("max_len")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
        raise DataFormatError(f"{path}: field 'max_len' must be a positive integer (the rows' length bound), "
                              f"got {max_len!r}")
    return m
