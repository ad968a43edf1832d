"""Choose which layers keep full attention (MLA) by measurement: the sensitivity search.

    python jobs/place_layers.py --n-mla 15 --data-from runs/demo [--compare even uniform:15]
    python jobs/place_layers.py --n-mla 15 --data-from runs/demo --proxy-only      # seconds, no training

Steps (each resumable; `<run-dir>/done/` records what finished, `--force` redoes everything):
  convert the base all-linear (mla_layers: none) and all-MLA (mla_layers: all)
  -> proxy: per-layer error of each converted mixer against the base attention, no training
  -> a short stage 1 of both students (jobs/stage1.py, `--steps`)
  -> score every layer in parallel with Ray tasks: KL(base || all-linear) minus the KL with that one layer
     switched to its MLA version, on held-out rows -> the `--n-mla` largest drops get MLA
  -> placement.json (chosen mla_layers, per-layer scores, proxy rank correlations) + placement_scores.png
  -> with --compare: each placement (the searched one and the listed ones) converted, trained with the
     same stage 1 + stage 2 budget (`--compare-steps`) and evaluated: compare.md / compare.json.
     `--compare-seeds 0 1 2` repeats every compared run per seed (`convert --seed`: the init of what
     conversion does not set; also `train.seed`, though packed rows are read in file order whatever the
     seed) and reports the mean, the spread and the paired difference to the searched placement per seed:
     one seed's init noise on these tiny budgets is as large as the gaps between placements.

Data: packed-row directories from jobs/prepare_data.py: `--data-from RUN` takes RUN/data/{stage1,stage2,
heldout} (what `make demo` writes), or give `--stage1-data`, `--stage2-data`, `--heldout-data`. The method
and its design choices: pipeline/placement.py.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.cli import int_at_least, job_main  # noqa: E402
from pipeline.runner import StepRunner, convert_cmd, eval_cmd, last_json_object, train_cmd  # noqa: E402


def _slug(spec: str) -> str:
    """A file-name-safe tag for a placement name ("searched (N=15)" -> "searched-N-15", "uniform:15" -> "uniform-15")."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", spec).strip("-")


class PlaceLayers(StepRunner):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args.run_dir, force=args.force, quiet=args.quiet, tag="place")
        self.args = args
        src = Path(args.data_from).resolve() if args.data_from else None
        self.data = {}
        for split in ("stage1", "stage2", "heldout"):
            given = getattr(args, f"{split}_data")
            path = Path(given).resolve() if given else (src / "data" / split if src else None)
            needed = {"heldout": True, "stage1": not args.proxy_only, "stage2": bool(args.compare)}[split]
            if needed and (path is None or not (path / "manifest.json").is_file()):
                from pipeline.placement import PlacementError

                raise PlacementError(f"{split} rows: {path or 'not given'} is not a packed-data directory "
                                     f"(manifest.json); pass --data-from RUN (after `make demo`) or --{split}-data DIR")
            self.data[split] = path

    # ------------------------------------------------------------------ steps
    def convert(self, name: str, placement: str, seed: int = 0) -> dict:
        out = self.run / name
        text = self.sh(name, convert_cmd(self.args.base_dir, out, placement, self.args.kv_lora_rank,
                                         self.args.linear_type, seed))
        return {"summary": last_json_object(text)}

    def train(self, stage: int, name: str, student: Path, steps: int, seed: int | None = None) -> dict:
        split = f"stage{stage}"
        extra = [x for kv in self.args.train_set for x in ("--set", kv)]
        if seed is not None:
            extra += ["--set", f"train.seed={seed}"]
        self.sh(name, train_cmd(stage, self.args.config, self.run, name, student, self.data[split],
                                self.args.seq_len, steps, extra))
        return {"model": str(self.run / name / "model")}

    def _base(self):
        from hylo.upcycle import load_base_model

        return load_base_model(self.args.base_dir).eval()

    def proxy(self) -> dict:
        from hylo.io import load_hylo
        from pipeline.placement import load_rows, proxy_scores

        rows = load_rows(self.data["heldout"], self.args.heldout_rows)
        lin = load_hylo(self.run / "converted_linear").eval()
        mla = load_hylo(self.run / "converted_mla").eval()
        res = proxy_scores(self._base(), lin, mla, rows)
        (self.run / "proxy.json").write_text(json.dumps(res, indent=1))
        return {}

    def score(self) -> dict:
        import ray

        from pipeline.placement import load_rows, score_layers

        rows = load_rows(self.data["heldout"], self.args.heldout_rows)
        if not ray.is_initialized():
            ray.init(num_cpus=self.args.num_cpus, include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        res = score_layers(self.run / "stage1_linear" / "model", self.run / "stage1_mla" / "model", self._base(),
                           rows, threads_per_task=1)
        ray.shutdown()
        (self.run / "scores.json").write_text(json.dumps(res, indent=1))
        return {}

    def write_placement(self, proxy_only: bool) -> dict:
        from pipeline.placement import PROXIES, choose, plot_scores, spearman

        proxy = json.loads((self.run / "proxy.json").read_text())
        result: dict = {"base": self.args.base, "n_mla": self.args.n_mla, "linear_type": self.args.linear_type,
                        "kv_lora_rank": self.args.kv_lora_rank, "heldout": str(self.data["heldout"]),
                        "heldout_rows": self.args.heldout_rows, "proxy": proxy}
        if proxy_only:
            result.update(method=f"proxy ({self.args.proxy})",
                          mla_layers=choose(proxy[self.args.proxy], self.args.n_mla))
        else:
            measured = json.loads((self.run / "scores.json").read_text())
            result.update(method="measured (KL drop after a short stage 1)", stage1_steps=self.args.steps,
                          measured=measured, mla_layers=choose(measured["drop"], self.args.n_mla),
                          spearman={k: spearman(proxy[k], measured["drop"]) for k in PROXIES},
                          proxy_mla_layers={k: choose(proxy[k], self.args.n_mla) for k in PROXIES})
        tmp = self.run / "placement.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(self.run / "placement.json")
        if not proxy_only:
            plot_scores(result, self.run / "placement_scores.png")
        return result

    def evaluate(self, name: str, model: Path, out: Path) -> dict:
        self.sh(name, eval_cmd(model, self.args.base_dir, self.data["heldout"], out, "kl", self.args.heldout_rows))
        return {}

    def compare_one(self, name: str, spec: str, steps: int, seed: int = 0) -> dict:
        """Convert with `spec` and `seed`, stage 1 + stage 2 for `steps` each (train.seed = `seed`), held-out KL."""
        tag = f"cmp_{_slug(name)}" + (f"_seed{seed}" if seed else "")
        r = self.run / tag
        conv = self.step(f"{tag}_convert", [r / "converted" / "hybrid_config.json"],
                         lambda: self.convert(f"{tag}/converted", spec, seed))
        self.step(f"{tag}_stage1", [r / "stage1" / "model" / "hybrid_config.json"],
                  lambda: self.train(1, f"{tag}/stage1", r / "converted", steps, seed))
        self.step(f"{tag}_stage2", [r / "stage2" / "model" / "hybrid_config.json"],
                  lambda: self.train(2, f"{tag}/stage2", r / "stage1" / "model", steps, seed))
        ev = r / "eval"
        self.step(f"{tag}_eval", [ev / "results.json"], lambda: self.evaluate(f"{tag}_eval", r / "stage2" / "model", ev))
        res = json.loads((ev / "results.json").read_text())
        summary = conv["summary"]
        return {"placement": name, "spec": spec, "seed": seed, "mla_layers": summary["mla_layers"],
                "kv_cache_ratio": summary["kv_cache_ratio"], "kl": res["kl"]["kl"], "tokens": res["kl"]["tokens"]}

    # ------------------------------------------------------------------ main
    def main(self) -> int:
        a, r = self.args, self.run
        from hylo.assets import resolve_path_or_asset

        a.base_dir = resolve_path_or_asset(a.base, "--base", directory=True)
        self.step("converted_linear", [r / "converted_linear" / "hybrid_config.json"],
                  lambda: self.convert("converted_linear", "none"))
        self.step("converted_mla", [r / "converted_mla" / "hybrid_config.json"],
                  lambda: self.convert("converted_mla", "all"))
        self.step("proxy", [r / "proxy.json"], self.proxy)
        if not a.proxy_only:
            for kind in ("linear", "mla"):
                self.step(f"stage1_{kind}", [r / f"stage1_{kind}" / "model" / "hybrid_config.json"],
                          lambda k=kind: self.train(1, f"stage1_{k}", r / f"converted_{k}", a.steps))
            self.step("score", [r / "scores.json"], self.score)
        result = self.write_placement(a.proxy_only)
        print(self.summary(result))
        if a.compare and not a.proxy_only:
            placements = {f"searched (N={a.n_mla})": ",".join(map(str, result["mla_layers"]))}
            placements.update({s: s for s in a.compare})
            rows = [self.compare_one(name, spec, a.compare_steps, seed)
                    for seed in a.compare_seeds for name, spec in placements.items()]
            self.write_compare(rows)
        print(f"\n[place] wrote {r / 'placement.json'}" + ("" if a.proxy_only else f" and {r / 'placement_scores.png'}"))
        return 0

    def summary(self, result: dict) -> str:
        lines = [f"\nMLA layers ({result['method']}): {result['mla_layers']}"]
        m = result.get("measured")
        if m:
            lines.append(f"KL(base || student) on {m['tokens']} held-out tokens: all linear {m['kl_all_linear']:.4f}, "
                         f"all MLA {m['kl_all_mla']:.4f}")
            lines.append("layer  KL drop   " + "  ".join(f"{k:>16}" for k in result["spearman"]))
            for i, d in enumerate(m["drop"]):
                lines.append(f"{i:>5}  {d:+.4f}  " + "  ".join(f"{result['proxy'][k][i]:>16.4f}" for k in result["spearman"]))
            lines.append("Spearman (proxy vs measured): " + ", ".join(f"{k} {v:+.2f}" for k, v in result["spearman"].items()))
        return "\n".join(lines)

    def write_compare(self, rows: list[dict]) -> None:
        from pipeline.placement import compare_summary

        steps = self.args.compare_steps
        summary = compare_summary(rows)
        md = compare_markdown(rows, summary, steps)
        (self.run / "compare.md").write_text("\n".join(md) + "\n")
        tmp = self.run / "compare.json.tmp"
        tmp.write_text(json.dumps({"steps_per_stage": steps, "seeds": sorted({x["seed"] for x in rows}),
                                   "rows": rows, "summary": summary}, indent=1))
        tmp.replace(self.run / "compare.json")
        print("\n" + "\n".join(md))


def compare_markdown(rows: list[dict], summary: list[dict], steps: int) -> list[str]:
    """compare.md: one row per placement; with several seeds, KL per seed, mean +- std and the paired gap."""
    seeds = sorted({x["seed"] for x in rows})
    kl = {(x["placement"], x["seed"]): x["kl"] for x in rows}
    title = f"# Layer placement: KL(base || student) after stage 1 + stage 2 ({steps} + {steps} steps each)"
    if len(seeds) == 1:
        md = [title, "", "| placement | MLA layers | KV-cache ratio | held-out KL |", "|---|---|---|---|"]
        return md + [f"| {s['placement']} | {','.join(map(str, s['mla_layers']))} | {s['kv_cache_ratio']:.3f} | "
                     f"{s['mean']:.4f} |" for s in summary]
    md = [title + f", seeds {', '.join(map(str, seeds))}", "",
          "| placement | MLA layers | KV-cache ratio | " + " | ".join(f"KL seed {s}" for s in seeds)
          + " | mean +- std | minus searched, mean (per seed) | searched lower |",
          "|---|---|---|" + "---|" * len(seeds) + "---|---|---|"]
    for s in summary:
        per_seed = " | ".join(f"{kl[(s['placement'], seed)]:.4f}" if (s["placement"], seed) in kl else "-"
                              for seed in seeds)
        gap = "-" if s["gap_to_searched"] is None else (
            f"{s['gap_to_searched']:+.4f} ({', '.join(f'{g:+.3f}' for g in s['gaps'])})")
        wins = "-" if s["searched_lower"] is None else f"{s['searched_lower']} of {len(s['gaps'])}"
        md.append(f"| {s['placement']} | {','.join(map(str, s['mla_layers']))} | {s['kv_cache_ratio']:.3f} | "
                  f"{per_seed} | {s['mean']:.4f} +- {s['std']:.4f} | {gap} | {wins} |")
    return md


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="asset:smollm2-135m-instruct", help="base HF model directory or asset:<name>")
    ap.add_argument("--n-mla", type=int_at_least(1), required=True, help="how many layers get MLA")
    ap.add_argument("--run-dir", default="runs/placement")
    ap.add_argument("--data-from", default=None, help="a demo run directory: use its data/{stage1,stage2,heldout}")
    ap.add_argument("--stage1-data", default=None)
    ap.add_argument("--stage2-data", default=None)
    ap.add_argument("--heldout-data", default=None)
    ap.add_argument("--config", default="configs/demo-smollm2.yaml", help="training config of the short stages")
    ap.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra --set override for every training job, e.g. model.activation_checkpointing=false")
    ap.add_argument("--steps", type=int_at_least(1), default=8, help="stage-1 steps of the two students the search scores")
    ap.add_argument("--seq-len", type=int_at_least(2), default=512, help="tokens per packed row (as the data was packed)")
    ap.add_argument("--heldout-rows", type=int_at_least(1), default=8, help="held-out rows every layer is scored on")
    ap.add_argument("--kv-lora-rank", type=int_at_least(1), default=256)
    ap.add_argument("--linear-type", default="gdn", choices=["gdn", "mamba2"])
    ap.add_argument("--num-cpus", type=int_at_least(1), default=None, help="CPUs of the local Ray that scores layers")
    ap.add_argument("--proxy-only", action="store_true", help="choose by the training-free proxy only")
    ap.add_argument("--proxy", default="error_gap", choices=["linear_error", "linear_error_rel", "error_gap"],
                    help="the proxy --proxy-only ranks by")
    ap.add_argument("--compare", nargs="*", default=[], metavar="PLACEMENT",
                    help="placements to compare with the searched one, e.g. --compare even uniform:15 0,5,10")
    ap.add_argument("--compare-steps", type=int_at_least(1), default=16, help="stage 1 and stage 2 steps of each compared run")
    ap.add_argument("--compare-seeds", nargs="+", type=int_at_least(0), default=[0], metavar="SEED",
                    help="run every compared placement once per seed (conversion init, train.seed); with several "
                         "seeds the table gives mean, spread and the paired difference to the searched placement")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    return ap


@job_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.time()
    rc = PlaceLayers(args).main()
    print(f"[place] total {time.time() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
