"""Decontamination throughput: our job (Ray Data, vectorised scan) vs a plain Python n-gram-set reference.

Every run is `run_decontamination` on the same input with identical flags (same reader, index,
decision rule and writers); only the scan differs: `ray` (Ray Data tasks running FastScanner),
`local` (FastScanner in this process) and `reference` (regex normalisation + per-turn n-gram sets,
one process). Documents/s counts read + scan + decide + write; Ray start-up and the benchmark
index build are reported apart. `ray` runs first in a fresh Ray session (cold: Ray Data's first
execution starts its internal actors and the workers import the scan code) and again at the end
(warm, as on a long-lived cluster).

Scenario A: the default suite (HumanEval prompts: one n-gram length). Scenario B: HumanEval prompts
and canonical solutions (short solutions add whole-item n-grams of 5..12 words: nine lengths),
the regime of suites with short items (PIQA, OBQA, ARC), where the reference's cost grows with
every length and ours barely does. Also prints how many real ShareGPT conversations match
HumanEval, and checks that every scanner removed the same records.

    python bench/decontam.py                 # all of ShareGPT (17.4K conversations) vs HumanEval
    python bench/decontam.py --limit 3000    # quicker
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.assets import fetch_asset  # noqa: E402
from hylo.pipeline.data.decontam import (  # noqa: E402
    BenchmarkSpec,
    DecontamJobConfig,
    MatchConfig,
    read_jsonl,
    run_decontamination,
)
from hylo.pipeline.data.readers import SourceSpec  # noqa: E402
from hylo.pipeline.ray_init import RayInitSection, init_ray  # noqa: E402


def run(tmp: str, label: str, src: SourceSpec, bench: BenchmarkSpec, scanner: str, args) -> dict:
    cfg = DecontamJobConfig(inputs=[src], benchmarks=[bench], match=MatchConfig(ngram=args.ngram),
                            out=f"{tmp}/{label}", scanner=scanner,
                            ray=RayInitSection(num_cpus=args.num_cpus), progress=False)
    s = run_decontamination(cfg)
    s["removed_ids"] = sorted(r["id"] for r in read_jsonl(Path(tmp, label, "removed.jsonl")))
    s["report"] = json.loads(Path(tmp, label, "reports", "humaneval.json").read_text())
    print(f"{label:>13}: {s['docs_per_s']:8.1f} docs/s  ({s['documents_scanned']} docs; "
          f"seconds {s['seconds']})", flush=True)
    return s


def ratio(res: dict, a: str, b: str) -> str:
    e2e = res[a]["docs_per_s"] / res[b]["docs_per_s"]
    scan = res[b]["seconds"]["scan"] / res[a]["seconds"]["scan"]
    return f"{a} / {b}: {e2e:.2f}x end-to-end, {scan:.2f}x scan only"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--limit", type=int, default=None, help="read at most this many ShareGPT records")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--ngram", type=int, default=13)
    ap.add_argument("--skip-b", action="store_true", help="scenario A only")
    args = ap.parse_args()

    import ray  # lazy: ray

    src = SourceSpec("sharegpt", str(fetch_asset("sharegpt", progress=False)), allow_assistant_first=True,
                     limit=args.limit)
    prompts = BenchmarkSpec("humaneval")
    with_sol = BenchmarkSpec("humaneval", "asset:humaneval", ["prompt", "canonical_solution"], "task_id")
    # The job's own local Ray (pipeline/ray_init.py): its workers at the driver's priority.
    t = time.perf_counter()
    init_ray(None, args.num_cpus, log_to_driver=False)
    ray_start = time.perf_counter() - t
    a: dict[str, dict] = {}
    b: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("scenario A: HumanEval prompts")
        for label, scanner in [("ray-cold", "ray"), ("local", "local"), ("reference", "reference"),
                               ("ray-warm", "ray")]:
            a[label] = run(tmp, f"A-{label}", src, prompts, scanner, args)
        if not args.skip_b:
            print("scenario B: HumanEval prompts + canonical solutions")
            for label, scanner in [("ray-warm", "ray"), ("local", "local"), ("reference", "reference")]:
                b[label] = run(tmp, f"B-{label}", src, with_sol, scanner, args)
        ray.shutdown()
    print(f"ray start-up (excluded): {ray_start:.1f} s; Ray CPUs: {args.num_cpus}")
    for name, res in (("A", a), ("B", b)):
        if not res:
            continue
        same = len({tuple(r["removed_ids"]) for r in res.values()}) == 1
        print(f"scenario {name}: identical removed records across scanners: {same}")
        for lab in ("ray-cold", "ray-warm", "local"):
            if lab in res:
                print(f"  speed-up {ratio(res, lab, 'reference')}  (target >= 3x for the Ray job)")
    first = a["ray-cold"]
    print(f"ShareGPT conversations matching HumanEval prompts ({args.ngram}-gram, flags {first['flags']}): "
          f"{first['suites']['humaneval']['documents_matched']} "
          f"({first['suites']['humaneval']['items_matched']} distinct problems); records rejected by the "
          f"reader: {first['documents_rejected']}")
    if b:
        rep = b["reference"]["report"]
        print(f"with canonical solutions indexed too: {b['reference']['suites']['humaneval']['documents_matched']}"
              " conversations; " + "; ".join(f"{m['item_id']} x{m['documents']}: '{m['example_ngram']}'"
                                            for m in rep["matched_items"][:3]))


if __name__ == "__main__":
    main()
