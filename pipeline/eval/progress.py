"""Progress bars for the evaluation suites (stderr, so results on stdout stay clean).

tqdm redraws in place on a terminal and prints at most every `mininterval` seconds into a log file;
`TQDM_DISABLE=1` turns every bar off.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress(iterable: Any = None, desc: str = "", total: int | None = None, unit: str = "it",
             disable: bool = False, **kw: Any):
    interval = 0.5 if sys.stderr.isatty() else 10.0
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=sys.stderr,
                mininterval=interval, dynamic_ncols=True, **kw)
