"""Where each training worker gets its packed rows, with an exact, saveable position.

Legend: T tokens of a row, W workers, N rows in the split.

Design choices:
* Worker `r` of `W` reads global rows `r, r + W, r + 2W, ...` of the split (strided sharding): every
  worker sees the same number of rows per step and the union over workers is the split in order.
  Row `g >= N` wraps to `g mod N` (the next epoch, same order).
* The position of a worker is the number of rows it has consumed, so a resumed worker calls
  `seek(position)` and reads exactly the rows it would have read. Ray Data iterators do not resume
  mid-epoch; this does, and costs one Parquet row-group read per row at most.
* `SyntheticRows` makes deterministic random rows (tests, benches, smoke runs); `ParquetRows` reads
  the data pipeline's shards (any `*.parquet` under the split directory, sorted by name).
* Every row gets a `row_key` (synthetic: `syn-<g>`; Parquet: the global row index) so runs can be
  compared row by row ("identical rows consumed"). It is not `row_id`: the teacher cache keys rows by
  content hash when the data has no `row_id` column.
* Parquet rows come from the data pipeline's `RowReader` (same strided sharding, drop_last), whose
  manifest is checked against `data.split` and `data.seq_len` (`DataFormatError` otherwise). Every row
  read is checked against the packed-row contract (`hylo.kernels.varlen.check_row`; `PackedRowError` names
  the shard directory and the row): a bad row stops the run, since skipping it would shift every
  position and resume after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from hylo.kernels.varlen import check_row, positions_from_cu_seqlens
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.train.config import DataSection


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

    @property
    def fingerprint(self) -> str:
        """What decides the rows; a resumed run must read the same data."""
        raise NotImplementedError

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

    @property
    def fingerprint(self) -> str:
        from hylo.pipeline.config import config_hash

        return "synthetic-" + config_hash({"seed": self.seed, "seq_len": self.cfg.seq_len, **vars(self.cfg.synthetic)})

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
        pos = positions_from_cu_seqlens(torch.from_numpy(cu), T).numpy()
        # Half of each document is "assistant": the loss covers its second half except its last token.
        mask = np.zeros(T, dtype=np.int8)
        for s, e in zip(cu[:-1], cu[1:]):
            mask[s + (e - s) // 2: e - 1] = 1
        return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
                "doc_ids": [f"syn-{index}-{j}" for j in range(len(lengths))], "row_key": f"syn-{index}"}


class ParquetRows(RowStream):
    """Packed rows of a split prepared by the data pipeline (shards + manifest.json), via its RowReader."""

    def __init__(self, data: DataSection, rank: int, world_size: int) -> None:
        from hylo.pipeline.data.dataset import MANIFEST, RowReader

        super().__init__(rank, world_size)
        if not data.path:
            raise ConfigError("data.path is not set: point it at a split prepared by jobs/prepare_data.py",
                              "data.path")
        root = Path(data.path).expanduser()
        if not (root / MANIFEST).is_file():
            raise DataFormatError(f"{root}: no {MANIFEST}; data.path must be a directory written by "
                                  "jobs/prepare_data.py")
        self.reader = RowReader(root, rank=rank, world_size=world_size, as_numpy=True)
        man = self.reader.manifest
        if man.get("split") not in (None, data.split):
            raise DataFormatError(f"{root / MANIFEST}: this is the {man.get('split')!r} split, the config reads "
                                  f"data.split={data.split!r}")
        if man.get("max_len") not in (None, data.seq_len):
            raise DataFormatError(f"{root / MANIFEST}: rows were packed to {man.get('max_len')} tokens, the "
                                  f"config says data.seq_len={data.seq_len}")
        if self.reader.num_rows == 0:
            raise DataFormatError(f"{root}: fewer rows than the {world_size} workers")
        self.root, self.seq_len = root, data.seq_len

    @property
    def num_rows(self) -> int:
        return self.reader.num_rows * self.world_size

    @property
    def fingerprint(self) -> str:
        return str(self.reader.manifest.get("config_hash"))

    def _row(self, index: int) -> dict[str, Any]:
        row = self.reader.read_global(index)
        row["input_ids"] = row["input_ids"].astype(np.int64)
        row["position_ids"] = row["position_ids"].astype(np.int64)
        row["cu_seqlens"] = row["cu_seqlens"].astype(np.int32)
        row["loss_mask"] = row["loss_mask"].astype(np.int8)
        row["row_key"] = str(index)
        check_row(row, f"{self.root} row {index}", self.seq_len, max_len_name="data.seq_len")
        return row


def open_rows(data: DataSection, seed: int, rank: int, world_size: int) -> RowStream:
    if data.source == "synthetic":
        return SyntheticRows(data, seed, rank, world_size)
    return ParquetRows(data, rank, world_size)
