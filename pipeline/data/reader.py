"""The one reader of packed rows: strided over workers, resumable at an exact position, yielding checked rows.

Legend: T tokens of a row, W workers (world size), r a worker's rank, N rows of one pass over the data.

Design choices:
* Every consumer of packed rows on disk reads them here: training, evaluation, placement's held-out rows and
  the teacher-cache job, so each gets the same `PackedRow` from the same file.
* A `RowSource` says what the rows are: how many, the row at a global index as read, where that is (for
  errors), what bounds a row's length and what fingerprints the data. `ParquetRows` is any list of
  Parquet files of packed rows, file after file (each read through `rowfile.PackedRowFile`, with its
  page checksums verified); `ShardRows` is a prepared dataset (shards + manifest: the manifest's order,
  row counts and length bound); training's synthetic rows are another source
  (`hylo.pipeline.train.row_sources`).
* `RowReader(source, rank, world_size, start)`: worker r reads global rows r, r + W, r + 2W, ...; with
  `drop_last` the tail that does not divide by W is left out of every pass, so every worker takes the
  same number of steps (`drop_to`: by a multiple of W instead, so that the pass does not depend on how many
  readers share it: training's sequence-parallel groups). `position` is the number of rows this worker consumed: saving it and giving it
  back (`start`, `seek`) resumes at exactly the next row (Ray Data iterators do not resume mid-epoch).
  `next_row()` runs on into the next pass (the same order; the row's `epoch` says which pass);
  iterating the reader gives the rest of one pass.
* Every row is checked once, here (`rows.check_row`, against the source's length bound; PackedRowError
  names the file and the row), and yielded as a `PackedRow` that carries its host boundaries on to the
  model: no consumer checks or converts it again. A bad row stops the reader: skipping it would shift
  every position and a resume after it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from hylo.bounded_read import not_regular
from hylo.pipeline.data.rowfile import DataFormatError, PackedRowFile
from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.data.shards import MANIFEST, read_manifest


class RowSource(Protocol):
    """Rows by global index; `max_len` bounds a row's length (None: unbounded), `max_len_from` says where
    that bound comes from (for the error), `fingerprint` what decides the rows."""

    num_rows: int
    max_len: int | None
    max_len_from: str | None
    fingerprint: str

    def raw(self, g: int) -> dict[str, Any]: ...

    def where(self, g: int) -> str: ...


class ParquetRows:
    """The rows of Parquet files of packed rows, file after file in the given order (a `RowSource`): global
    row g is row g - (rows of the files before) of the file it falls in. No length bound. Every footer is
    read now (the row counts); rows are read through `rowfile.PackedRowFile`, one row group in memory at
    a time."""

    max_len: int | None = None
    max_len_from: str | None = None

    def __init__(self, paths: Sequence[str | Path], noun: str = "file",
                 remedy: str = "restore the file or write it again") -> None:
        self.paths = [Path(p) for p in paths]
        self.noun, self.remedy = noun, remedy
        self._files: dict[int, PackedRowFile] = {}
        # the file whose row group is cached
        self._current: PackedRowFile | None = None
        self._cum = [0]
        for n in self._row_counts():
            self._cum.append(self._cum[-1] + n)
        self.num_rows = self._cum[-1]

    def _row_counts(self) -> list[int]:
        return [self._file(k).num_rows for k in range(len(self.paths))]

    def _open(self, k: int) -> PackedRowFile:
        return PackedRowFile(self.paths[k], noun=self.noun, remedy=self.remedy)

    def _file(self, k: int) -> PackedRowFile:
        if k not in self._files:
            self._files[k] = self._open(k)
        return self._files[k]

    @property
    def fingerprint(self) -> str:
        """A hash of the files' paths, sizes and row counts."""
        blob = json.dumps([[str(p), p.stat().st_size] for p in self.paths] + [self._cum]).encode()
        return "files-" + hashlib.sha256(blob).hexdigest()[:16]

    def locate(self, g: int) -> tuple[Path, int]:
        """(file, row inside it) of global row `g`."""
        k = bisect.bisect_right(self._cum, g) - 1
        return self.paths[k], g - self._cum[k]

    def raw(self, g: int) -> dict[str, Any]:
        k = bisect.bisect_right(self._cum, g) - 1
        f = self._file(k)
        if self._current is not None and self._current is not f:
            self._current.drop_cache()
        self._current = f
        return f.row(g - self._cum[k])

    def where(self, g: int) -> str:
        path, r = self.locate(g)
        return f"{path} row {r}"


class ShardRows(ParquetRows):
    """The rows of a prepared dataset directory (shards + manifest.json), in manifest order; the manifest
    gives the row counts (each checked against its shard's footer when the shard is first read) and the
    length bound."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self.manifest = read_manifest(self.dir)
        super().__init__([self.dir / s["file"] for s in self.manifest["shards"]], noun="shard",
                         remedy="restore the shard or rerun jobs/prepare_data.py")
        self.max_len = self.manifest.get("max_len")
        self.max_len_from = f"packing.max_len of {self.dir / MANIFEST}"

    @property
    def fingerprint(self) -> str:
        return str(self.manifest.get("config_hash"))

    def _row_counts(self) -> list[int]:
        return [int(s["rows"]) for s in self.manifest["shards"]]

    def _open(self, k: int) -> PackedRowFile:
        meta, path = self.manifest["shards"][k], self.paths[k]
        if not path.exists():
            raise DataFormatError(f"{path}: listed in {self.dir / MANIFEST} but missing")
        if (kind := not_regular(path)) is not None:
            raise DataFormatError(f"{path}: listed in {self.dir / MANIFEST} as a shard, but it is {kind}, not a file "
                                  f"(restore the shard or rerun jobs/prepare_data.py)")
        f = super()._open(k)
        if f.num_rows != int(meta["rows"]):
            raise DataFormatError(f"{path}: has {f.num_rows} rows, manifest says {meta['rows']}")
        return f

    def check_shards(self) -> None:
        """Open every shard's footer: a missing, truncated or miscounted shard is named now, before a run."""
        for k in range(len(self.paths)):
            self._file(k)

    def max_token_ids(self) -> list[tuple[str, int]]:
        """(shard file, its largest token id) from the shards' footer statistics, no row read; a shard
        whose footer has no statistics for `input_ids` is left out."""
        out = []
        for k in range(len(self.paths)):
            md = self._file(k).pf.metadata
            col = [md.schema.column(i).path.split(".")[0] for i in range(md.num_columns)].index("input_ids")
            highs = [st.max for st in (md.row_group(rg).column(col).statistics for rg in range(md.num_row_groups))
                     if st is not None and st.has_min_max]
            if highs:
                out.append((self.manifest["shards"][k]["file"], int(max(highs))))
        return out

    def where(self, g: int) -> str:
        return f"{self.dir} row {g}"


class RowReader:
    """Deterministic, resumable reader of a row source (or a prepared dataset directory) for one worker;
    yields checked `PackedRow`s (see the module docstring)."""

    def __init__(self, source: RowSource | str | Path, rank: int = 0, world_size: int = 1, start: int = 0,
                 drop_last: bool = True, clear_crossing_labels: bool = False, drop_to: int | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        drop_to = drop_to or world_size
        if drop_to % world_size:
            raise ValueError(f"drop_to {drop_to} is not a multiple of world_size {world_size}")
        self.source: RowSource = ShardRows(source) if isinstance(source, (str, Path)) else source
        self.rank, self.world_size = rank, world_size
        self.clear_crossing_labels = clear_crossing_labels
        total = self.source.num_rows
        # the global rows of one pass (cut to a multiple of drop_to, default the readers), and this worker's share
        self.global_rows = total // drop_to * drop_to if drop_last else total
        self.num_rows = len(range(rank, self.global_rows, world_size))
        if not 0 <= start <= self.num_rows:
            raise ValueError(f"start {start} outside [0, {self.num_rows}] rows for rank {rank}/{world_size}")
        self.position = start

    def __len__(self) -> int:
        return self.num_rows

    @property
    def manifest(self) -> dict[str, Any]:
        return getattr(self.source, "manifest", {})

    @property
    def fingerprint(self) -> str:
        """What decides the rows; a resumed run must read the same data."""
        return self.source.fingerprint

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError(f"position {position} < 0")
        self.position = int(position)

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "rank": self.rank, "world_size": self.world_size,
                "num_rows": self.global_rows}

    def read(self, g: int, epoch: int = 0) -> PackedRow:
        """Global row `g` of the source, checked."""
        raw = self.source.raw(g)
        raw.setdefault("row_key", str(g))
        raw["epoch"] = epoch
        return check_row(raw, self.source.where(g), self.source.max_len, self.clear_crossing_labels,
                         self.source.max_len_from)

    def next_row(self) -> PackedRow:
        """This worker's next row, running on into the next pass over the data."""
        if self.global_rows == 0:
            raise DataFormatError(f"{self.source.where(0)}: no rows for worker {self.rank} of {self.world_size}")
        g = self.position * self.world_size + self.rank
        row = self.read(g % self.global_rows, g // self.global_rows)
        self.position += 1
        return row

    def __iter__(self):
        while self.position < self.num_rows:
            yield self.next_row()
