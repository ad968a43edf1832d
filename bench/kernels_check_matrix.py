"""The kernels-check table of docs/results.md: the three shipped recipes x four targets, in one run (recipes with the same
head shapes share their compiles), at most --jobs target children at a time.

    nice python bench/kernels_check_matrix.py --out bench-out/kernels-check --jobs 2
    python bench/kernels_check_matrix.py --out bench-out/kernels-check --report-only   # a run stopped part way

Writes OUT/kernels_check.json and OUT/kernels_check.md (pipeline/kernels_check.py's report) and prints the table.
Minutes per target on one core (fla's GDN backward at K 256 / V 512 is most of it).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline import kernels_check as kc  # noqa: E402
from hylo.pipeline.paths import resolve_paths  # noqa: E402
from hylo.pipeline.train.config import load_stage_config  # noqa: E402

RECIPES = ("llama-3.2-1b-8mla8gdn-64k", "llama-3.2-3b-14mla14gdn-64k", "qwen3-1.7b-7mla21gdn-64k")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", default=",".join(kc.TARGET_NAMES))
    ap.add_argument("--tokens", type=int, default=kc.DEFAULT_TOKENS)
    ap.add_argument("--jobs", type=int, default=1, help="target children at a time")
    ap.add_argument("--plan-only", action="store_true", help="print the distinct launch sites and exit")
    ap.add_argument("--report-only", action="store_true",
                    help="write the report from what the children of an earlier run in --out wrote so far")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    recipes = {}
    for name in RECIPES:
        path = root / "configs" / f"{name}.yaml"
        cfg = resolve_paths(load_stage_config(2, str(path)))
        stage1 = resolve_paths(load_stage_config(1, str(path)))
        recipes[name] = kc.recipe_sites(cfg, stage1, args.tokens)
    plan, users = kc.plan_for(recipes)
    for p in plan:
        print(p["id"], users[p["id"]])
    if args.plan_only:
        return 0
    targets = kc.parse_targets(args.targets)
    out = Path(args.out)
    work = out / "work"
    if not args.report_only:
        work.mkdir(parents=True, exist_ok=False)
        log = (out / "children.log").open("a")

        def one(target: str):
            sub = work / target
            sub.mkdir()
            return target, kc.run_targets(plan, [target], sub, log)[target]

        with ThreadPoolExecutor(args.jobs) as pool:
            results = dict(pool.map(one, targets))
    else:
        # what the children wrote so far (each writes after every site): a matrix stopped part way
        results = {}
        for target in targets:
            part = work / target / f"{target}.json"
            res = json.loads(part.read_text()) if part.is_file() else {"records": [], "sites": []}
            res["planned"] = [p["id"] for p in plan]
            results[target] = res
    results = {t: results[t] for t in targets}
    bad = kc.write_report(out, results, users, {"recipes": list(recipes), "targets": targets, "tokens": args.tokens})
    print((out / "kernels_check.md").read_text())
    for b in bad:
        print(f"problem: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
