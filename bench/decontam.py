"""Decontamination throughput: our job (Ray Data, vectorised scan) vs a plain Python n-gram reference.

Both run `run_decontamination` on the same input with identical flags (same reader, index, decision
rule and writers); only the scan differs: `ray` (actor pool of FastScanner) vs `reference` (dict of
n-gram tuples probed at every position, one process). Documents/s counts read + scan + decide +
write; Ray start-up and the benchmark-index build are reported apart. Also prints how many real
ShareGPT conversations match HumanEval, and checks that both scans removed the same records.

    python bench/decontam.py                 # all of ShareGPT vs HumanEval
    python bench/decontam.py --limit 3000    # quicker
    python bench/decontam.py --scanners ray,reference   # cold Ray run only
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
from pipeline.data.decontam import (  # noqa: E402
    BenchmarkSpec,
    DecontamJobConfig,
    MatchConfig,
    read_jsonl,
    run_decontamination,
)
from pipeline.data.readers import SourceSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="read at most this many ShareGPT records")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--ngram", type=int, default=13)
    # "ray" runs first in a fresh Ray session (cold: Ray Data's first execution starts its internal
    # actors and the workers import the scan code) and again at the end (warm, as on a long-lived
    # cluster); the speed-up is quoted for both.
    ap.add_argument("--scanners", default="ray,local,reference,ray")
    args = ap.parse_args()

    import ray

    src = SourceSpec("sharegpt", str(fetch_asset("sharegpt", progress=False)), allow_assistant_first=True,
                     limit=args.limit)
    t = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - t
    results = {}
    removed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scanner in args.scanners.split(","):
            label = f"{scanner}-warm" if scanner in results else (f"{scanner}-cold" if scanner == "ray"
                                                                  else scanner)
            cfg = DecontamJobConfig(inputs=[src], benchmarks=[BenchmarkSpec("humaneval")],
                                    match=MatchConfig(ngram=args.ngram), out=f"{tmp}/{label}",
                                    scanner=scanner, num_cpus=args.num_cpus, progress=False)
            s = run_decontamination(cfg)
            results[scanner] = results[label] = s
            removed[label] = sorted(r["id"] for r in read_jsonl(Path(tmp, label, "removed.jsonl")))
            rep = json.loads(Path(tmp, label, "reports", "humaneval.json").read_text())
            print(f"{label:>10}: {s['docs_per_s']:8.1f} docs/s  ({s['documents_scanned']} docs; "
                  f"seconds {s['seconds']})", flush=True)
        # The same count when HumanEval's canonical solutions are indexed too (not the default).
        cfg = DecontamJobConfig(inputs=[src], benchmarks=[BenchmarkSpec("humaneval", "asset:humaneval", [
            "prompt", "canonical_solution"], "task_id")], match=MatchConfig(ngram=args.ngram),
            out=f"{tmp}/with-solutions", scanner="local", progress=False)
        with_sol = run_decontamination(cfg)
        rep_sol = json.loads(Path(tmp, "with-solutions", "reports", "humaneval.json").read_text())
        ray.shutdown()
    first = next(iter(results))
    same = len({tuple(v) for v in removed.values()}) == 1
    print(f"ray start-up (excluded): {ray_start:.1f} s; CPUs: {args.num_cpus}")
    for label in ("ray-cold", "ray-warm"):
        if label in results and "reference" in results:
            ratio = results[label]["docs_per_s"] / results["reference"]["docs_per_s"]
            scan = results["reference"]["seconds"]["scan"] / results[label]["seconds"]["scan"]
            print(f"speed-up {label} / reference: {ratio:.2f}x end-to-end (target >= 3x), {scan:.2f}x scan only")
    if "local" in results and "reference" in results:
        ratio = results["local"]["docs_per_s"] / results["reference"]["docs_per_s"]
        print(f"speed-up local (1 process, vectorised) / reference: {ratio:.2f}x end-to-end")
    print(f"identical removed sets across scanners: {same}")
    print(f"ShareGPT conversations matching HumanEval prompts (flags {results[first]['flags']}): "
          f"{results[first]['suites']['humaneval']['documents_matched']} "
          f"({results[first]['suites']['humaneval']['items_matched']} distinct problems); "
          f"records rejected by the reader: {results[first]['documents_rejected']}")
    print("matched items:", ", ".join(f"{m['item_id']}x{m['documents']}" for m in rep["matched_items"][:20]))
    print(f"with canonical solutions indexed too: {with_sol['suites']['humaneval']['documents_matched']} "
          f"conversations; e.g. " + "; ".join(f"{m['item_id']}: '{m['example_ngram']}'"
                                              for m in rep_sol["matched_items"][:3]))
    if rep["boilerplate_ignored"]:
        print("ignored as boilerplate:", rep["boilerplate_ignored"][:5])


if __name__ == "__main__":
    main()
