"""The data section of a stage's config, turned into the one row reader (`hylo.pipeline.data.reader.RowReader`).

Legend: T tokens of a row, W workers, N rows in the split.

Design choices:
* `data.source: parquet` reads a split prepared by jobs/prepare_data.py. The reader leaves out the tail that
  does not divide by W, so every worker takes the same number of steps. The manifest's `max_len` is the
  rows' length; `data.seq_len`, when set, must agree with it.
* `data.source: synthetic` gives deterministic random rows of exactly `data.seq_len` tokens, for tests,
  benches and smoke runs.
* Rows carry a `key` (synthetic: `syn-<g>`; Parquet: the global row index), so runs compare row by row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from hylo.kernels.varlen import positions_from_cu_seqlens
from hylo.pipeline.config import ConfigError, config_hash
from hylo.pipeline.data.reader import RowReader, ShardRows
from hylo.pipeline.data.rowfile import DataFormatError
from hylo.pipeline.data.shards import MANIFEST
from hylo.pipeline.train.config import DataSection


class SyntheticRows:
    """Deterministic random packed rows (a `RowSource`): documents of random length filling exactly
    `data.seq_len` tokens."""

    def __init__(self, data: DataSection, seed: int) -> None:
        if data.seq_len is None:
            raise ConfigError("data.seq_len is not set: synthetic rows need a length (parquet rows take "
                              "theirs from the dataset's manifest)", "data.seq_len")
        self.cfg, self.seed = data, seed
        self.num_rows = data.synthetic.rows
        self.max_len: int | None = data.seq_len
        self.max_len_from: str | None = "data.seq_len"

    @property
    def fingerprint(self) -> str:
        return "synthetic-" + config_hash({"seed": self.seed, "seq_len": self.cfg.seq_len, **vars(self.cfg.synthetic)})

    def where(self, g: int) -> str:
        return f"synthetic row {g}"

    def raw(self, g: int) -> dict[str, Any]:
        syn, T = self.cfg.synthetic, self.cfg.seq_len
        rng = np.random.default_rng([self.seed, g])
        lengths: list[int] = []
        while sum(lengths) < T:
            lengths.append(int(rng.integers(syn.min_doc_len, syn.max_doc_len + 1)))
        lengths[-1] -= sum(lengths) - T
        lengths = [n for n in lengths if n > 0]
        ids = rng.integers(0, syn.vocab_size, size=T, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        pos = positions_from_cu_seqlens(torch.from_numpy(cu), T).numpy()
        # Half of each document is "assistant": the loss covers its second half except its last token.
        mask = np.zeros(T, dtype=np.int8)
        for s, e in zip(cu[:-1], cu[1:]):
            mask[s + (e - s) // 2: e - 1] = 1
        return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
                "doc_ids": [f"syn-{g}-{j}" for j in range(len(lengths))], "row_key": f"syn-{g}"}


def parquet_rows(data: DataSection) -> ShardRows:
    """The prepared split `data.path`, checked against `data.split` and (when set) `data.seq_len`."""
    if not data.path:
        raise ConfigError("data.path is not set: point it at a split prepared by jobs/prepare_data.py", "data.path")
    root = Path(data.path).expanduser()
    if not (root / MANIFEST).is_file():
        raise DataFormatError(f"{root}: no {MANIFEST}; data.path must be a directory written by "
                              "jobs/prepare_data.py")
    source = ShardRows(root)
    man = source.manifest
    if man.get("split") not in (None, data.split):
        raise DataFormatError(f"{root / MANIFEST}: this is the {man.get('split')!r} split, the config reads "
                              f"data.split={data.split!r}")
    if data.seq_len is not None and man.get("max_len") not in (None, data.seq_len):
        raise DataFormatError(f"{root / MANIFEST}: rows were packed to max_len={man.get('max_len')} tokens "
                              f"(the data job's packing.max_len), the config sets data.seq_len={data.seq_len}; "
                              "leave data.seq_len unset to take the manifest's, or prepare the data again")
    if data.seq_len is not None and man.get("max_len") is None:
        # a manifest without its length: the config's is the bound
        source.max_len, source.max_len_from = data.seq_len, "data.seq_len"
    return source


def open_rows(data: DataSection, seed: int, rank: int, world_size: int, workers: int | None = None) -> RowReader:
    """The reader of data-parallel rank `rank` of `world_size` (the workers of a sequence-parallel group read
    the same rows); a pass over the split leaves out the tail that does not divide by `workers` (default
    `world_size`), the same pass whatever the sequence-parallel size."""
    if data.source == "synthetic":
        return RowReader(SyntheticRows(data, seed), rank, world_size, drop_last=False)
    workers = workers or world_size
    reader = RowReader(parquet_rows(data), rank, world_size, drop_to=workers)
    if reader.num_rows == 0:
        raise DataFormatError(f"{reader.source.dir}: fewer rows than the {workers} workers")
    return reader


def resume_position(saved: dict[str, Any], world_size: int) -> int:
    """This reader's position (rows it consumed) from a checkpoint's data state, written by a reader of the same
    data striding over `saved["world_size"]` ranks: every reader consumed as many rows, so the run consumed
    position x world_size global rows, whatever the sequence-parallel size that wrote it; a reader of
    `world_size` ranks continues at that many over its world_size (a step reads global rows [s*B, (s+1)*B)
    at any split)."""
    consumed = int(saved["position"]) * int(saved.get("world_size", world_size))
    if consumed % world_size:
        raise ValueError(f"the checkpoint's data position ({consumed} rows) does not divide over {world_size} "
                         f"data-parallel ranks")
    return consumed // world_size
