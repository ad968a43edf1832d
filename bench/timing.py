"""Forward and backward wall time of one op, shared by the CPU kernel benches (bench/gdn.py, bench/ssd.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def time_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], repeats: int,
                 warmup: bool) -> tuple[float, float]:
    """Median seconds of `fn(*inputs)` and of its backward (against ones) over `repeats` runs, after one untimed
    run when `warmup`; the inputs' gradients are cleared before each run."""

    def once() -> tuple[float, float]:
        for x in inputs:
            x.grad = None
        t0 = time.perf_counter()
        out = fn(*inputs)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    if warmup:
        once()
    runs = [once() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
