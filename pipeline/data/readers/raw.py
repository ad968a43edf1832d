"""What every container reader yields: one raw item per row, or per loss."""

from __future__ import annotations

from typing import Any

# Each yields (index, obj, None, 0) for a parsed row or (index, raw_text, reason, lost) for a loss:
# `lost` records stand behind it (1 for one record, a row group's row count, None when unknown).

RawItem = tuple[int, Any, str | None, int | None]
