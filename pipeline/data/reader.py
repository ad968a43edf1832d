"""The one reader of packed rows: strided over workers, resumable at an exact position, yielding checked rows.

Legend: T tokens of a row, W workers (world size), r a worker's rank, N rows of one pass over the data.

Design choices:
* A `RowSource` says what the rows are: how many, the row at a global index as read, where that is (for
  errors), what bounds a row's length and what fingerprints the data. `ShardRows` is a prepared dataset
  (shards + manifest, each shard read through `rowfile.PackedRowFile`); training's synthetic rows are
  another source (`hylo.pipeline.train.rows`).
* `RowReader(source, rank, world_size, start)`: worker r reads global rows r, r + W, r + 2W, ...; with
  `drop_last` the tail that does not divide by W is left out of every pass, so every worker takes the
  same number of steps. `position` is the number of rows this worker consumed: saving it and giving it
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
from pathlib import Path
from typing import Any, Protocol

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


class ShardRows:
    """The rows of a prepared dataset directory (shards + manifest.json), in manifest order."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self.manifest = read_manifest(self.dir)
        self._cum = [0]
        for s in self.manifest["shards"]:
            self._cum.append(self._cum[-1] + int(s["rows"]))
        self.num_rows = self._cum[-1]
        self.max_len: int | None = self.manifest.get("max_len")
        self.max_len_from: str | None = f"packing.max_len of {self.dir / MANIFEST}"
        self.fingerprint = str(self.manifest.get("config_hash"))
        self._files: dict[int, PackedRowFile] = {}
        # the shard whose row group is cached (one row group in memory at a time)
        self._current: PackedRowFile | None = None

    def _file(self, k: int) -> PackedRowFile:
        if k not in self._files:
            meta = self.manifest["shards"][k]
            path = self.dir / meta["file"]
            if not path.is_file():
                raise DataFormatError(f"{path}: listed in {self.dir / MANIFEST} but missing")
            f = PackedRowFile(path, noun="shard", remedy="restore the shard or rerun jobs/prepare_data.py")
            if f.num_rows != int(meta["rows"]):
                raise DataFormatError(f"{path}: has {f.num_rows} rows, manifest says {meta['rows']}")
            self._files[k] = f
        return self._files[k]

    def check_shards(self) -> None:
        """Open every shard's footer: a missing, truncated or miscounted shard is named now, before a run."""
        for k in range(len(self.manifest["shards"])):
            self._file(k)

    def max_token_ids(self) -> list[tuple[str, int]]:
        """(shard file, its largest token id) from the shards' footer statistics, no row read; a shard
        whose footer has no statistics for `input_ids` is left out."""
        out = []
        for k in range(len(self.manifest["shards"])):
            md = self._file(k).pf.metadata
            col = [md.schema.column(i).path.split(".")[0] for i in range(md.num_columns)].index("input_ids")
            highs = [st.max for st in (md.row_group(rg).column(col).statistics for rg in range(md.num_row_groups))
                     if st is not None and st.has_min_max]
            if highs:
                out.append((self.manifest["shards"][k]["file"], int(max(highs))))
        return out

    def raw(self, g: int) -> dict[str, Any]:
        k = bisect.bisect_right(self._cum, g) - 1
        f = self._file(k)
        if self._current is not None and self._current is not f:
            self._current.drop_cache()
        self._current = f
        return f.row(g - self._cum[k])

    def where(self, g: int) -> str:
        return f"{self.dir} row {g}"


class RowReader:
    """Deterministic, resumable reader of a row source (or a prepared dataset directory) for one worker;
    yields checked `PackedRow`s (see the module docstring)."""

    def __init__(self, source: RowSource | str | Path, rank: int = 0, world_size: int = 1, start: int = 0,
                 drop_last: bool = True, clear_crossing_labels: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        self.source: RowSource = ShardRows(source) if isinstance(source, (str, Path)) else source
        self.rank, self.world_size = rank, world_size
        self.clear_crossing_labels = clear_crossing_labels
        total = self.source.num_rows
        # the global rows of one pass, and this worker's share of them
        self.global_rows = total // world_size * world_size if drop_last else total
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
