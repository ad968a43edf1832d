"""Run a function on N local ranks of a gloo group (spawned processes, as torchrun / Ray Train would give),
for the sequence-parallel tests: each rank writes a JSON of its figures, the test reads them all."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hylo.pipeline.rehearse import free_port


def _entry(fn: Callable[[int, int], dict[str, Any]], rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(fn: Callable[[int, int], dict[str, Any]], world: int, out: Path,
              timeout: float = 600.0) -> list[dict[str, Any]]:
    """fn(rank, world) on `world` spawned ranks of one gloo group; their returned dicts, by rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise AssertionError(f"ranks exited with {codes}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
