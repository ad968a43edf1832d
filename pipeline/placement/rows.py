"""The held-out rows every score is computed on, and the error the search raises for a wrong input."""

from __future__ import annotations

import itertools
from pathlib import Path

from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.eval.kl import check_eval_row, scored_tokens


class PlacementError(ValueError):
    """The search cannot run; the message names the input that is wrong."""


def load_rows(data: str | Path, max_rows: int) -> list[PackedRow]:
    """The first `max_rows` held-out packed rows of a jobs/prepare_data.py directory, through the one reader
    of packed rows and checked as evaluation checks them (`check_eval_row`: their `loss_mask` says which
    tokens are scored)."""
    p = Path(data)
    if not (p / "manifest.json").is_file():
        raise PlacementError(f"held-out data {p}: not a packed-data directory (no manifest.json); make one with "
                             "jobs/prepare_data.py")
    reader = RowReader(p, drop_last=False, clear_crossing_labels=True)
    rows = [check_eval_row(row, f"{p} row {k}") for k, row in enumerate(itertools.islice(reader, max_rows))]
    if not rows:
        raise PlacementError(f"{p}: no held-out rows read")
    if sum(scored_tokens(r).numel() for r in rows) == 0:
        raise PlacementError(f"{p}: {len(rows)} row(s) read but none has a scored token")
    return rows
