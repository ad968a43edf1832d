"""The decontamination job: read the inputs, scan, decide, write clean / removed / rejects and the reports."""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hylo.atomic import atomic_path, atomic_write
from hylo.outputs import atomic_dir, check_not_an_input
from hylo.ownership import check_replaceable
from hylo.pipeline.data.config import DecontamJobConfig
from hylo.pipeline.data.decontam.cut import cut_record
from hylo.pipeline.data.decontam.decide import decide
from hylo.pipeline.data.decontam.index import BenchmarkIndex, build_index
from hylo.pipeline.data.decontam.report import write_reports
from hylo.pipeline.data.decontam.scan import scan_mixture
from hylo.pipeline.data.readers import Record, is_reject, iter_source
from hylo.pipeline.paths import job_inputs


def _write_jsonl(path: Path, rows: Iterable[dict], ensure_ascii: bool = False) -> int:
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=ensure_ascii) + "\n")
            n += 1
    return n


def _write_parquet(path: Path, rows: Iterable[dict], chunk: int = 4096) -> int:
    import pyarrow as pa  # lazy: pyarrow
    import pyarrow.parquet as pq  # lazy: pyarrow

    schema = pa.schema([("id", pa.string()), ("source", pa.string()), (
        "messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    n = 0
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as w:
        buf: list[dict] = []
        for r in rows:
            buf.append(r)
            if len(buf) >= chunk:
                w.write_table(pa.Table.from_pylist(buf, schema))
                n, buf = n + len(buf), []
        if buf or n == 0:
            w.write_table(pa.Table.from_pylist(buf, schema))
            n += len(buf)
    return n


def check_output(cfg: DecontamJobConfig) -> None:
    """Before any work: `out` is none of what the job reads (its config file, an --input or --benchmark file, nor
    inside or around one: `hylo.outputs.check_not_an_input`) and, when it exists, holds only what this job wrote
    there, as it wrote it (its record `.hylo-output.json`): the job replaces its own previous output, never a
    directory of the user's."""
    check_not_an_input(cfg.out, output_inputs(cfg), "out")
    check_replaceable(cfg.out, "out")


def output_inputs(cfg: DecontamJobConfig) -> list[tuple[str, Path]]:
    """What the job reads (`hylo.pipeline.paths.job_inputs`), the files named as their flags name them."""
    inputs = [(f"--input {s.name}", s.path) for s in cfg.inputs]
    inputs += [(f"--benchmark {b.name}", b.path) for b in cfg.benchmarks if b.path and not b.path.startswith("hub:")]
    return job_inputs(cfg, extra=inputs)


def run_decontamination(cfg: DecontamJobConfig, index: BenchmarkIndex | None = None) -> dict[str, Any]:
    """Run the whole job; returns the summary (also written to `<out>/summary.json`). The output directory is
    built beside `out` and swapped in when complete (`hylo.outputs.atomic_dir`): a failed or killed run leaves
    the previous output as it was (a killed run's staging directory is removed by the next run, or by
    `hylo clean OUT`)."""
    if not cfg.inputs:
        raise ValueError("decontaminate: no inputs given")
    check_output(cfg)
    with atomic_dir(cfg.out, "out", output_inputs(cfg)) as staging:
        return _run(cfg, index, Path(cfg.out), staging)


def _run(cfg: DecontamJobConfig, index: BenchmarkIndex | None, out: Path, staging: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    bench_skipped: dict[str, dict[str, int]] = {}
    if index is None:
        index, bench_skipped = build_index(cfg.benchmarks, cfg.match)
    t_index = time.perf_counter()

    records: list[Record] = []
    rejects: list[dict] = []
    with tqdm(desc="read", unit="doc", disable=not cfg.progress) as bar:
        for spec in cfg.inputs:
            for it in iter_source(spec):
                (rejects if is_reject(it) else records).append(it)  # type: ignore[arg-type]
                bar.update()
    texts = [[m["content"] for m in r["messages"]] for r in records]
    t_read = time.perf_counter()

    hits = scan_mixture(index, texts, cfg.scanner, cfg.batch_size, cfg.progress, cfg.ray)
    t_scan = time.perf_counter()

    dec = decide(index, *hits)
    removed: list[dict] = []
    cut_ids: set[int] = set()
    fallback_drops = 0

    def clean_rows():
        nonlocal fallback_drops
        for d, rec in enumerate(records):
            ms = dec.flagged.get(d)
            if ms is None:
                yield rec
                continue
            action = "drop"
            if cfg.match.mode == "cut":
                new = cut_record(rec, ms)
                if new is not None:
                    action = "cut"
                    cut_ids.add(d)
                    yield new
                else:
                    fallback_drops += 1
            removed.append({"id": rec["id"], "source": rec["source"], "action": action,
                            "matches": [dataclasses.asdict(m) for m in ms], "record": rec})

    clean_name = f"clean.{cfg.output_format}"
    if cfg.output_format == "jsonl":
        # \u-escaped JSON encodes about twice as fast; every JSON reader decodes it identically.
        n_clean = _write_jsonl(staging / clean_name, clean_rows(), ensure_ascii=True)
    else:
        n_clean = _write_parquet(staging / clean_name, clean_rows())
    _write_jsonl(staging / "removed.jsonl", removed)
    _write_jsonl(staging / "rejects.jsonl", rejects)
    t_end = time.perf_counter()

    summary = write_reports(cfg, index, dec, records, removed, rejects, n_clean, bench_skipped, staging)
    summary.update(
        fallback_drops=fallback_drops,
        files={k: str(out / v) for k, v in [("clean", clean_name), ("removed", "removed.jsonl"),
                                            ("rejects", "rejects.jsonl")]},
        seconds={"index": round(t_index - t0, 3), "read": round(t_read - t_index, 3),
                 "scan": round(t_scan - t_read, 3), "decide_write": round(t_end - t_scan, 3),
                 "total": round(t_end - t0, 3)},
        docs_per_s=round(len(records) / max(t_end - t_index, 1e-9), 1),
    )
    atomic_write(staging / "summary.json", json.dumps(summary, indent=1))
    return summary


def read_jsonl(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]
