"""The scan of a whole mixture: Ray Data tasks, or in the driver (the fast or the reference scanner)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from hylo.pipeline.config import RayInitSection
from hylo.pipeline.data.decontam.decide import Decision, decide
from hylo.pipeline.data.decontam.fast import FastScanner
from hylo.pipeline.data.decontam.index import BenchmarkIndex, Hits, empty_hits
from hylo.pipeline.data.decontam.reference import ReferenceScanner
from hylo.pipeline.ray_init import init_ray

# One FastScanner per worker process and index. Ray reuses worker processes across tasks, so the
# scan runs as stateless tasks (which start on Ray's pre-started workers, where an actor pool would
# spawn and import fresh processes on every run) and each worker builds its scanner once.
_WORKER_SCANNERS: dict[str, FastScanner] = {}


def _scan_batch_task(batch: Any, index_refs: list) -> dict[str, np.ndarray]:
    import ray  # lazy: ray

    key = index_refs[0].hex()
    scanner = _WORKER_SCANNERS.get(key)
    if scanner is None:
        _WORKER_SCANNERS.clear()
        scanner = _WORKER_SCANNERS[key] = FastScanner(ray.get(index_refs[0]))
    # pyarrow batches: list<string> -> Python lists directly. (The numpy format would build
    # fixed-width unicode arrays per document, padding every turn to the longest one.)
    rows = batch.column("row").to_numpy()
    d, e, t, s = scanner.scan(batch.column("texts").to_pylist())
    return {"doc": rows[d].astype(np.int64), "entry": e, "turn": t, "start": s}


def _scan_ray(index: BenchmarkIndex, texts: list[list[str]], batch_size: int, progress: bool,
              ray_cfg: RayInitSection) -> Hits:
    import ray  # lazy: ray

    init_ray(ray_cfg.address, ray_cfg.num_cpus, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = progress
    # The index goes to the object store once; tasks receive its reference (inside a list, so Ray
    # does not resolve it per task) and fetch it once per worker.
    index_ref = ray.put(index)
    import pyarrow as pa  # lazy: pyarrow

    n = len(texts)
    if n == 0:
        return empty_hits()
    # One Arrow table built in the driver (much cheaper than from_items' per-row dicts), cut into
    # a few blocks per CPU so both workers stay busy; tasks iterate batches inside their block.
    table = pa.table({"row": pa.array(np.arange(n, dtype=np.int64)),
                      "texts": pa.array(texts, type=pa.list_(pa.string()))})
    cpus = ray_cfg.num_cpus or int(ray.cluster_resources().get("CPU", 1))
    blocks = max(1, min(n, max(2 * cpus, -(-n // 2048))))
    bounds = np.linspace(0, n, blocks + 1).astype(int)
    ds = ray.data.from_arrow([table.slice(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])])
    out = ds.map_batches(_scan_batch_task, fn_args=([index_ref],), batch_size=batch_size,
                         batch_format="pyarrow", num_cpus=1)
    cols: dict[str, list[np.ndarray]] = defaultdict(list)
    for b in out.iter_batches(batch_format="numpy", batch_size=None):
        for k in ("doc", "entry", "turn", "start"):
            cols[k].append(np.asarray(b[k], dtype=np.int64))
    if not cols:
        return empty_hits()
    return tuple(np.concatenate(cols[k]) for k in ("doc", "entry", "turn", "start"))  # type: ignore


def _scan_local(texts: list[list[str]], batch_size: int, fn: Callable[[Sequence[Sequence[str]]], Hits],
                progress: bool) -> Hits:
    parts = []
    for lo in tqdm(range(0, len(texts), batch_size), desc="scan", unit="batch", disable=not progress):
        d, e, t, s = fn(texts[lo:lo + batch_size])
        parts.append((d + lo, e, t, s))
    if not parts:
        return empty_hits()
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))  # type: ignore


def scan_mixture(index: BenchmarkIndex, texts: list[list[str]], scanner: str = "ray", batch_size: int = 256,
                 progress: bool = True, ray_cfg: RayInitSection | None = None) -> Hits:
    """The hits of documents (each a list of turn texts): `scanner` ray (Ray Data tasks on the job's Ray),
    local (the fast scanner in the driver) or reference (the plain Python one)."""
    if scanner == "ray":
        return _scan_ray(index, texts, batch_size, progress, ray_cfg or RayInitSection(num_cpus=2))
    fast_or_reference = FastScanner(index) if scanner == "local" else ReferenceScanner(index, "set")
    return _scan_local(texts, batch_size, fast_or_reference.scan, progress)


def scan_and_decide(index: BenchmarkIndex, texts: list[list[str]], scanner: str = "ray", batch_size: int = 256,
                    progress: bool = True, ray_cfg: RayInitSection | None = None) -> Decision:
    """Scan documents (each a list of turn texts) and decide which are contaminated (see `decide`)."""
    return decide(index, *scan_mixture(index, texts, scanner, batch_size, progress, ray_cfg))
