"""The evaluation suites: the registry of known ones (`SUITES`), their export from the hub, and their items."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hylo.assets import expand_asset
from hylo.atomic import atomic_path
from hylo.ownership import check_own_files, record_files
from hylo.pipeline.data.config import BenchmarkSpec, SourceSpec
from hylo.pipeline.data.normalize import normalize_words
from hylo.pipeline.data.readers import iter_raw

# The evaluation suites of the HyLo papers (hub name, config, split, fields, id) and the built-in one.
# RULER is generated synthetically at evaluation time; it has no fixed items to index.
SUITES: dict[str, BenchmarkSpec] = {
    b.name: b
    for b in [
        # The prompt (signature + docstring) only: canonical solutions are short idioms (a prime
        # test loop, a running sum) that real code shares without any leak. Add
        # "canonical_solution" to the fields to catch solution-only leaks at that cost.
        BenchmarkSpec("humaneval", "asset:humaneval", ["prompt"], "task_id"),
        BenchmarkSpec("arc_easy", "hub:allenai/ai2_arc", ["question", "choices.text"], "id", "test",
                      "ARC-Easy"),
        BenchmarkSpec("arc_challenge", "hub:allenai/ai2_arc", ["question", "choices.text"], "id", "test",
                      "ARC-Challenge"),
        BenchmarkSpec("hellaswag", "hub:Rowan/hellaswag", ["ctx", "endings"], "ind", "validation"),
        BenchmarkSpec("openbookqa", "hub:allenai/openbookqa", ["question_stem", "choices.text"], "id",
                      "test", "main"),
        BenchmarkSpec("piqa", "hub:ybisk/piqa", ["goal", "sol1", "sol2"], "id", "validation"),
        BenchmarkSpec("race", "hub:ehovy/race", ["article", "question", "options"], "example_id",
                      "test", "all"),
        BenchmarkSpec("winogrande", "hub:allenai/winogrande", ["sentence", "option1", "option2"], "id",
                      "validation", "winogrande_xl"),
        BenchmarkSpec("gsm8k", "hub:openai/gsm8k", ["question", "answer"], "id", "test", "main"),
        BenchmarkSpec("mmlu", "hub:cais/mmlu", ["question", "choices"], "id", "test", "all"),
    ]
}


def export_benchmarks(out_dir: str | Path, names: Sequence[str] | None = None,
                      log: Callable[[str], None] = print) -> dict[str, int]:
    """Write each hub suite of SUITES as `<out_dir>/<name>.jsonl` (its evaluation split), for configs
    that read the suites from local files. Needs the `datasets` package and the hub, once."""
    try:
        import datasets  # lazy: datasets
    except ImportError:
        raise ValueError("exporting benchmarks needs the `datasets` package (pip install datasets) and "
                         "access to the Hugging Face hub") from None
    out = Path(out_dir)
    hub = [n for n, b in SUITES.items() if b.path.startswith("hub:")]
    unknown = sorted(set(names or []) - set(hub))
    if unknown:
        raise ValueError(f"unknown or non-hub suite(s) {unknown}; exportable: {', '.join(hub)}")
    # only files of ours are overwritten: a <suite>.jsonl of the user's in DIR stops the export before any download
    files = [f"{name}.jsonl" for name in names or hub]
    check_own_files(out_dir, files, "--export-benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in names or hub:
        b = SUITES[name]
        rows = datasets.load_dataset(b.path.removeprefix("hub:"), b.subset, split=b.split)
        with atomic_path(out / f"{name}.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as f:
            n = 0
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
                n += 1
        # recorded as written (size, hash): a later export may replace it, a user's edit of it is theirs
        record_files(out, [f"{name}.jsonl"])
        counts[name] = n
        log(f"{name}: {n} items ({b.path.removeprefix('hub:')} {b.subset or ''} {b.split}) -> {out / name}.jsonl")
    return counts


def resolve_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Fill path/fields from the registry when not given; errors name the suite and the choices."""
    if spec.path and spec.fields:
        return spec
    known = SUITES.get(spec.name)
    if known is None:
        raise ValueError(
            f"benchmark {spec.name!r}: give `path` and `fields`, or use a known suite: {', '.join(SUITES)}"
        )
    return dataclasses.replace(
        known, name=spec.name, path=spec.path or known.path, fields=spec.fields or known.fields
    )


@dataclass
class Item:
    suite: str
    id: str
    # Normalised words of each indexed field value.
    segments: list[list[str]]


def _get_path(row: Any, dotted: str) -> Any:
    cur = row
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return None
    return cur


def _texts(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _texts(v)]
    if isinstance(value, int | float):
        return [str(value)]
    return []


def load_benchmark(spec: BenchmarkSpec) -> tuple[list[Item], dict[str, int]]:
    """Items of one suite plus counts of rows skipped (unparseable or without any indexed field)."""
    spec = resolve_benchmark(spec)

    path = expand_asset(spec.path, progress=False)
    src = SourceSpec(name=spec.name, path=path, split=spec.split, subset=spec.subset)
    items: list[Item] = []
    skipped = Counter()
    keys_seen: set[str] = set()
    for _fname, idx, row, err in iter_raw(src):
        if err is not None:
            skipped["unparseable"] += 1
            continue
        if isinstance(row, dict):
            keys_seen.update(map(str, row))
        segs = [w for f in spec.fields for t in _texts(_get_path(row, f)) if (w := normalize_words(t))]
        if not segs:
            skipped["no_text_in_fields"] += 1
            continue
        rid = row.get(spec.id_field) if isinstance(row, dict) else None
        items.append(Item(spec.name, f"{spec.name}#{idx}" if rid is None else str(rid), segs))
    if not items:
        raise ValueError(
            f"benchmark {spec.name!r} ({path}): no item has text in fields {spec.fields}; "
            f"keys present: {sorted(keys_seen)[:20]}"
        )
    return items, dict(skipped)
