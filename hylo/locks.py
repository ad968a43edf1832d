"""File locks: processes that make the same thing take turns.

`file_lock(root, name)` holds an `fcntl` lock on root/.<name>.lock for a block (an asset fetched once, a run
directory made once). A leaf: it imports nothing of the project.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(root: str | Path, name: str) -> Iterator[None]:
    """Hold an exclusive `fcntl` lock on root/.<name>.lock (made, with root, if missing) for the block: processes
    that ask for the same name take turns. The lock goes with the process, so a killed holder blocks no one."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
