"""Where each training worker gets its packed rows, with an exact, saveable position.

Legend: T tokens of a row, W workers, N rows in the split.

Design choices:
* Worker `r` of `W` reads global rows `r, r + W, r + 2W, ...` of the split (strided sharding): every
  worker sees the same number of rows per step and the union over workers is the split in order.
  Row `g >= N` wraps to `g mod N` (the next epoch, same order).
* The position of a worker is the number of rows it has consumed, so a resumed worker calls
  `seek(position)` and reads exactly the rows it would have read. Ray Data iterators do not resume
  mid-epoch (design.md §5); this does, and costs one Parquet row-group read per row at most.
* `SyntheticRows` makes deterministic random rows (tests, benches, smoke runs); `ParquetRows` reads
  the data pipeline's shards (any `*.parquet` under the split directory, sorted by name).
* Every row gets a `row_id` (synthetic: `syn-<g>`; Parquet: `<file>:<index>`) so runs can be compared
  row by row ("identical rows consumed").
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.train.config import DataSection


class RowsError(ValueError):
    """The training data is missing or malformed; the message names the file and row."""


class RowStream:
    """Base class: strided, seekable stream of packed rows for one worker."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.position = 0

    @property
    def num_rows(self) -> int:
        raise NotImplementedError

    def _row(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def seek(self, position: int) -> None:
        self.position = int(position)

    def global_index(self, position: int | None = None) -> int:
        p = self.position if position is None else position
        return p * self.world_size + self.rank

    def next_row(self) -> dict[str, Any]:
        g = self.global_index()
        row = self._row(g % self.num_rows)
        row["epoch"] = g // self.num_rows
        self.position += 1
        return row

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "rank": self.rank, "world_size": self.world_size,
                "num_rows": self.num_rows}


class SyntheticRows(RowStream):
    """Deterministic random packed rows: documents of random length filling exactly `seq_len` tokens."""

    def __init__(self, data: DataSection, seed: int, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.cfg = data
        self.seed = seed

    @property
    def num_rows(self) -> int:
        return self.cfg.synthetic.rows

    def _row(self, index: int) -> dict[str, Any]:
        syn, T = self.cfg.synthetic, self.cfg.seq_len
        g = np.random.default_rng([self.seed, index])
        lengths: list[int] = []
        while sum(lengths) < T:
            lengths.append(int(g.integers(syn.min_doc_len, syn.max_doc_len + 1)))
        lengths[-1] -= sum(lengths) - T
        lengths = [n for n in lengths if n > 0]
        ids = g.integers(0, syn.vocab_size, size=T, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
        # Half of each document is "assistant": the loss covers its second half except its last token.
        mask = np.zeros(T, dtype=np.int8)
        for s, e in zip(cu[:-1], cu[1:]):
            mask[s + (e - s) // 2: e - 1] = 1
        return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
                "doc_ids": [f"syn-{index}-{j}" for j in range(len(lengths))], "row_id": f"syn-{index}"}


class ParquetRows(RowStream):
    """Packed rows from the Parquet shards of a prepared split."""

    COLUMNS = ("input_ids", "position_ids", "cu_seqlens", "loss_mask", "doc_ids")

    def __init__(self, data: DataSection, rank: int, world_size: int) -> None:
        import pyarrow.parquet as pq

        super().__init__(rank, world_size)
        if not data.path:
            raise RowsError("data.path is not set: point it at a dataset prepared by jobs/prepare_data.py")
        root = Path(data.path).expanduser()
        split_dir = root / data.split if (root / data.split).is_dir() else root
        self.files = sorted(split_dir.glob("*.parquet")) or sorted(split_dir.glob("**/*.parquet"))
        if not self.files:
            raise RowsError(f"{split_dir}: no *.parquet shards found for split {data.split!r}")
        self.seq_len = data.seq_len
        self._meta = []
        counts = []
        for f in self.files:
            try:
                md = pq.ParquetFile(f).metadata
            except Exception as e:
                raise RowsError(f"{f}: not a readable Parquet file ({type(e).__name__}: {e})") from e
            names = set(pq.ParquetFile(f).schema_arrow.names)
            missing = [c for c in self.COLUMNS if c not in names]
            if missing:
                raise RowsError(f"{f}: missing column(s) {', '.join(missing)} of the packed-row contract")
            rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
            self._meta.append(np.cumsum([0] + rg_rows))
            counts.append(md.num_rows)
        self._file_starts = np.cumsum([0] + counts)
        if self._file_starts[-1] < world_size:
            raise RowsError(f"{split_dir}: {int(self._file_starts[-1])} rows for {world_size} workers")
        self._cache: tuple[int, int, Any] | None = None

    @property
    def num_rows(self) -> int:
        return int(self._file_starts[-1])

    def _row(self, index: int) -> dict[str, Any]:
        import pyarrow.parquet as pq

        fi = bisect.bisect_right(self._file_starts, index) - 1
        local = index - int(self._file_starts[fi])
        rg_starts = self._meta[fi]
        rg = bisect.bisect_right(rg_starts, local) - 1
        if self._cache is None or self._cache[:2] != (fi, rg):
            table = pq.ParquetFile(self.files[fi]).read_row_group(rg, columns=list(self.COLUMNS))
            self._cache = (fi, rg, table)
        table = self._cache[2]
        i = local - int(rg_starts[rg])
        where = f"{self.files[fi]} row {local}"
        row = {c: table.column(c)[i].as_py() for c in self.COLUMNS}
        out = {
            "input_ids": np.asarray(row["input_ids"], dtype=np.int64),
            "position_ids": np.asarray(row["position_ids"], dtype=np.int64),
            "cu_seqlens": np.asarray(row["cu_seqlens"], dtype=np.int32),
            "loss_mask": np.asarray(row["loss_mask"], dtype=np.int8),
            "doc_ids": list(row["doc_ids"]),
            "row_id": f"{self.files[fi].name}:{local}",
        }
        check_row(out, where, self.seq_len)
        return out


def check_row(row: dict[str, Any], where: str, seq_len: int | None = None) -> None:
    """The packed-row contract, checked cheaply on every row; errors name the row."""
    T = len(row["input_ids"])
    cu = row["cu_seqlens"]
    if len(row["position_ids"]) != T or len(row["loss_mask"]) != T:
        raise RowsError(f"{where}: input_ids, position_ids and loss_mask lengths differ")
    if seq_len is not None and T > seq_len:
        raise RowsError(f"{where}: {T} tokens > data.seq_len {seq_len}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) <= 0):
        raise RowsError(f"{where}: cu_seqlens must start at 0, increase strictly and end at T={T}")
    if np.any(np.asarray(row["loss_mask"])[np.asarray(cu[1:]) - 1]):
        raise RowsError(f"{where}: loss_mask is set on the last token of a document")


def open_rows(data: DataSection, seed: int, rank: int, world_size: int) -> RowStream:
    if data.source == "synthetic":
        return SyntheticRows(data, seed, rank, world_size)
    return ParquetRows(data, rank, world_size)
