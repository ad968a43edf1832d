"""Stage 1 (Enhanced-ILD): train the new mixers only, or every parameter of each layer? Measured on the demo.

For each seed and each `ild.trainable` variant: stage 1 then stage 2 of the demo student (SmolLM2-135M-Instruct,
MLA on even layers, GDN elsewhere, real ShareGPT rows), with the same budget (steps, rows, learning rates),
and KL(teacher || student) on the demo's held-out rows after each stage. Prints one table: per seed, the mean
and sample spread over seeds, and the paired difference (variant minus the first variant) per seed.

    python bench/ild_compare.py [--run-dir runs/ild_compare] [--seeds 0 1 2] [--variants mixers all]
                                [--steps 8] [--seq-len 256] [--records 300] [--heldout-rows 8]

Design choices:
* The demo's own workflow and jobs (`hylo.pipeline.demo.Demo`): its decontamination, held-out and stage-1 /
  stage-2 rows are prepared once per run directory; the base is converted once per seed (`convert --seed`
  sets the init of what conversion does not copy) and both variants start from that conversion, so within
  a seed the variants differ only in what stage 1 trains (paired comparison). `train.seed` is the seed too.
* Every step is resumable (`<run-dir>/done/`): a re-run with more seeds reuses the finished ones, and a
  run with other budget flags must use another run directory (the budget is stored and checked).
* Sized for a 2-core machine: 256-token rows and 8 steps per stage (the demo: 512 and 8): ~5 minutes per
  (seed, variant) pair when the machine is quiet (Ray Train's start and the evaluations are most of it),
  ~12 minutes under a load average of ~20.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.atomic import atomic_write  # noqa: E402
from hylo.pipeline.demo import Demo, DemoConfig  # noqa: E402
from hylo.pipeline.runner import convert_cmd, last_json_object, train_cmd  # noqa: E402
from hylo.pipeline.train.config import ILD_TRAINABLE  # noqa: E402

TRAIN_CONFIG = "configs/demo-smollm2.yaml"


class ILDCompare(Demo):
    def __init__(self, cfg: DemoConfig, seeds: list[int], variants: list[str]) -> None:
        super().__init__(cfg)
        self.tag = "ild"
        self.seeds, self.variants = seeds, variants

    def check_budget(self) -> None:
        """A run directory holds one budget: refuse to mix runs of different ones."""
        c = self.cfg
        budget = {"steps": c.steps, "seq_len": c.seq_len, "records": c.records, "heldout": c.heldout,
                  "heldout_rows": c.heldout_rows, "train_config": TRAIN_CONFIG}
        path = self.run / "budget.json"
        if path.is_file() and not self.force:
            old = json.loads(path.read_text())
            if old != budget:
                raise SystemExit(f"[ild] {path} holds another budget {old}; use another --run-dir (or --force)")
        atomic_write(path, json.dumps(budget, indent=1))

    def convert_seed(self, seed: int) -> dict:
        out = self.run / f"seed{seed}" / "converted"
        text = self.sh(f"seed{seed}_convert", convert_cmd(self.base, out, "even", 256, seed=seed))
        return {"summary": last_json_object(text)}

    def train_variant(self, stage: int, seed: int, variant: str) -> dict:
        d = f"seed{seed}/{variant}"
        student = self.run / (f"seed{seed}/converted" if stage == 1 else f"{d}/stage1/model")
        extra = ["--set", "model.activation_checkpointing=false", "--set", f"train.seed={seed}"]
        if stage == 1:
            extra += ["--set", f"ild.trainable={variant}"]
        self.sh(f"seed{seed}_{variant}_stage{stage}",
                train_cmd(stage, TRAIN_CONFIG, self.run, f"{d}/stage{stage}", student,
                          self.run / "data" / f"stage{stage}", self.cfg.seq_len, self.cfg.steps, extra), ray=True)
        return {}

    def eval_kl(self, name: str, model: Path) -> dict:
        self.evaluate(name, model, ["kl"])
        return {}

    def kl(self, name: str, model: Path) -> float:
        self.step(f"eval_{name}", [self.run / "eval" / name / "results.json"], lambda: self.eval_kl(name, model))
        return json.loads((self.run / "eval" / name / "results.json").read_text())["kl"]["kl"]

    def one(self, seed: int, variant: str) -> dict:
        d = self.run / f"seed{seed}" / variant
        t0 = time.time()
        for stage in (1, 2):
            self.step(f"seed{seed}_{variant}_stage{stage}", [d / f"stage{stage}" / "model" / "hybrid_config.json"],
                      lambda s=stage: self.train_variant(s, seed, variant))
        kl1 = self.kl(f"seed{seed}_{variant}_stage1", d / "stage1" / "model")
        kl2 = self.kl(f"seed{seed}_{variant}_stage2", d / "stage2" / "model")
        seconds = sum(self.times.get(f"{k}", 0.0) for k in (
            f"seed{seed}_{variant}_stage1", f"seed{seed}_{variant}_stage2",
            f"eval_seed{seed}_{variant}_stage1", f"eval_seed{seed}_{variant}_stage2"))
        print(f"[ild] seed {seed} {variant}: KL after stage 1 {kl1:.4f}, after stage 2 {kl2:.4f} "
              f"({seconds:.0f} s of steps, {time.time() - t0:.0f} s now)", flush=True)
        return {"seed": seed, "variant": variant, "kl_stage1": kl1, "kl_stage2": kl2, "seconds": seconds}

    def main(self) -> int:
        r = self.run
        self.check_budget()
        self.assets()
        self.step("decontaminate", [r / "decontam" / "clean.jsonl"], self.decontaminate)
        self.step("heldout", [r / "data" / "heldout" / "manifest.json"], self.heldout)
        for split in ("stage1", "stage2"):
            self.step(f"prepare_{split}", [r / "data" / split / "manifest.json"], lambda s=split: self.prepare(s))
        rows, converted = [], {}
        for seed in self.seeds:
            self.step(f"seed{seed}_convert", [r / f"seed{seed}" / "converted" / "hybrid_config.json"],
                      lambda s=seed: self.convert_seed(s))
            converted[seed] = self.kl(f"seed{seed}_converted", r / f"seed{seed}" / "converted")
            rows += [self.one(seed, v) for v in self.variants]
        md = table(rows, converted, self.variants, self.cfg, sum(self.times.values()))
        (r / "ild_compare.md").write_text("\n".join(md) + "\n")
        atomic_write(r / "ild_compare.json", json.dumps({"rows": rows, "converted": converted,
                                                         "budget": json.loads((r / "budget.json").read_text())},
                                                        indent=1))
        print("\n" + "\n".join(md))
        print(f"\n[ild] wrote {r / 'ild_compare.md'} and {r / 'ild_compare.json'}")
        return 0


def mean_std(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.4f} +- {sd:.4f}"


def table(rows: list[dict], converted: dict[int, float], variants: list[str], c: DemoConfig, wall: float) -> list[str]:
    """Markdown: per variant, KL per seed and mean +- sample std after each stage; paired gaps to variants[0].
    `wall`: the seconds of every step, those reused from an earlier invocation included."""
    seeds = sorted({x["seed"] for x in rows})
    kl = {(x["variant"], x["seed"]): x for x in rows}
    md = [f"KL(teacher || student) on {c.heldout_rows} held-out rows of {c.seq_len} tokens; stage 1 and stage 2 "
          f"{c.steps} steps each of 2 rows x {c.seq_len} tokens (lr 2e-4 / 1e-4, configs/demo-smollm2.yaml); "
          f"seeds {', '.join(map(str, seeds))}; after conversion "
          + ", ".join(f"{converted[s]:.4f}" for s in seeds) + f"; {wall / 60:.0f} min of steps in all", "",
          "| ild.trainable | after stage 1, per seed | after stage 1 | after stage 2, per seed | after stage 2 |",
          "|---|---|---|---|---|"]
    for v in variants:
        cells = []
        for key in ("kl_stage1", "kl_stage2"):
            xs = [kl[(v, s)][key] for s in seeds]
            cells += [" / ".join(f"{x:.4f}" for x in xs), mean_std(xs)]
        md.append(f"| {v} | " + " | ".join(cells) + " |")
    ref = variants[0]
    for v in variants[1:]:
        cells = []
        for key in ("kl_stage1", "kl_stage2"):
            gaps = [kl[(v, s)][key] - kl[(ref, s)][key] for s in seeds]
            lower = sum(g < 0 for g in gaps)
            cells += [" / ".join(f"{g:+.4f}" for g in gaps), f"{mean_std(gaps)} (lower in {lower}/{len(gaps)})"]
        md.append(f"| {v} minus {ref} (paired by seed) | " + " | ".join(cells) + " |")
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--run-dir", default="runs/ild_compare")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", choices=ILD_TRAINABLE, default=["mixers", "all"])
    ap.add_argument("--steps", type=int, default=8, help="optimiser steps per stage")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per packed row")
    ap.add_argument("--records", type=int, default=300, help="clean ShareGPT records for the training rows")
    ap.add_argument("--heldout-rows", type=int, default=8, help="held-out rows the KL is measured on")
    ap.add_argument("--force", action="store_true", help="redo every step")
    ap.add_argument("--verbose", action="store_true", help="stream the jobs' output (always in <run-dir>/logs/)")
    a = ap.parse_args(argv)
    cfg = DemoConfig(run_dir=a.run_dir, steps=a.steps, seq_len=a.seq_len, records=a.records,
                     heldout_rows=a.heldout_rows, force=a.force, quiet=not a.verbose)
    with ILDCompare(cfg, a.seeds, a.variants) as bench:
        return bench.main()


if __name__ == "__main__":
    sys.exit(main())
