"""The search as a resumable run (`PlaceLayers`, its options `PlacementConfig`): convert, proxy, a short stage 1,
score, choose, and optionally compare placements; its printed summary and compare.md."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hylo.assets import local_path, resolve_path_or_asset
from hylo.atomic import atomic_write
from hylo.json_files import read_json
from hylo.pipeline import runner
from hylo.pipeline.config import PATH, ROW_TOKENS, at_least, config_file, each, one_of, rules
from hylo.pipeline.paths import job_inputs
from hylo.pipeline.placement.proxy import PROXIES, proxy_scores

if TYPE_CHECKING:
    from torch import nn

# The steps import what runs them (torch, the rows, the scoring): `PlacementConfig` and
# `hylo place-layers --print-config` need none of it.


def _slug(spec: str) -> str:
    """A file-name-safe tag for a placement name ("searched (N=15)" -> "searched-N-15", "uniform:15" -> "uniform-15")."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", spec).strip("-")


@dataclass
@rules(n_mla=at_least(1), steps=at_least(1), seq_len=ROW_TOKENS, heldout_rows=at_least(1), kv_lora_rank=at_least(1),
       linear_type=one_of("gdn", "mamba2"), proxy=one_of(*PROXIES), compare_steps=at_least(1),
       compare_seeds=each(at_least(0), nonempty=True), base=PATH, data_from=PATH, stage1_data=PATH,
       stage2_data=PATH, heldout_data=PATH)
class PlacementConfig(runner.RunnerConfig):
    # run_dir, force, quiet, ray: RunnerConfig (pipeline/runner.py); ray also scores the layers.
    run_dir: str = "runs/placement"
    # Base HF model directory or asset:<name>.
    base: str = "asset:smollm2-135m-instruct"
    # How many layers get MLA (required).
    n_mla: int | None = None
    # A demo run directory: use its data/{stage1,stage2,heldout}; or give each split's directory.
    data_from: str | None = None
    # no input itself (`hylo.pipeline.paths.job_inputs`): the split directories found under it are
    __not_inputs__ = frozenset({"data_from"})
    stage1_data: str | None = None
    stage2_data: str | None = None
    heldout_data: str | None = None
    # Training config of the short stages (a file, or a shipped config's name), and extra `--set` overrides
    # for every training job.
    train_config: str = "demo-smollm2.yaml"
    train_set: list[str] = field(default_factory=list)
    # Stage-1 steps of the two students the search scores.
    steps: int = 8
    # Tokens per packed row (as the data was packed).
    seq_len: int = 512
    # Held-out rows every layer is scored on.
    heldout_rows: int = 8
    kv_lora_rank: int = 256
    linear_type: str = "gdn"
    # Choose by the training-free proxy only (seconds, no training), ranking by `proxy`.
    proxy_only: bool = False
    proxy: str = "error_gap"
    # Placements to compare with the searched one, e.g. [even, "uniform:15", "0,5,10"].
    compare: list[str] = field(default_factory=list)
    # Stage 1 and stage 2 steps of each compared run.
    compare_steps: int = 16
    # Run every compared placement once per seed (conversion init, train.seed); with several seeds the
    # table gives mean, spread and the paired difference to the searched placement.
    compare_seeds: list[int] = field(default_factory=lambda: [0])


class PlaceLayers(runner.StepRunner):
    def __init__(self, cfg: PlacementConfig) -> None:
        from hylo.pipeline.placement.rows import PlacementError  # lazy: torch

        if cfg.n_mla is None:
            raise PlacementError("n_mla is not set: pass --n-mla N (how many layers get MLA)")
        self.cfg = cfg
        src = Path(cfg.data_from).resolve() if cfg.data_from else None
        self.data: dict[str, Path | None] = {}
        for split in ("stage1", "stage2", "heldout"):
            given = getattr(cfg, f"{split}_data")
            path = Path(given).resolve() if given else (src / "data" / split if src else None)
            needed = {"heldout": True, "stage1": not cfg.proxy_only, "stage2": bool(cfg.compare)}[split]
            if needed and (path is None or not (path / "manifest.json").is_file()):
                raise PlacementError(f"{split} rows: {path or 'not given'} is not a packed-data directory "
                                     f"(manifest.json); pass --data-from RUN (after `make demo`) or --{split}-data DIR")
            self.data[split] = path

        # the run directory is none of the inputs (the config, the base, the rows), nor inside or around one; the
        # demo's own placement study runs inside the demo run it takes its rows from (data_from)
        inputs = job_inputs(cfg, extra=[("base", local_path(cfg.base) if cfg.base else None),
                                        *((f"{split}_data", p) for split, p in self.data.items())])
        super().__init__(cfg.run_dir, force=cfg.force, quiet=cfg.quiet, tag="place", ray=cfg.ray, inputs=inputs)

    # ------------------------------------------------------------------ steps
    def convert(self, name: str, placement: str, seed: int = 0) -> dict:
        out = self.run / name
        text = self.sh(name, runner.convert_cmd(self.base_dir, out, placement, self.cfg.kv_lora_rank,
                                                self.cfg.linear_type, seed))
        return {"summary": runner.last_json_object(text)}

    def train(self, stage: int, name: str, student: Path, steps: int, seed: int | None = None) -> dict:
        extra = [x for kv in self.cfg.train_set for x in ("--set", kv)]
        if seed is not None:
            extra += ["--set", f"train.seed={seed}"]
        cmd = runner.train_cmd(stage, config_file(self.cfg.train_config).resolve(), self.run, name, student, self.data[f"stage{stage}"],
                               self.cfg.seq_len, steps, extra)
        self.sh(name, cmd, ray=True)
        return {"model": str(self.run / name / "model")}

    def _base(self) -> nn.Module:
        from hylo.upcycle import load_base_model  # lazy: torch

        return load_base_model(self.base_dir).eval()

    def proxy(self) -> dict:
        from hylo.io import load_hylo  # lazy: transformers
        from hylo.pipeline.placement.rows import load_rows  # lazy: torch

        rows = load_rows(self.data["heldout"], self.cfg.heldout_rows)
        lin = load_hylo(self.run / "converted_linear").eval()
        mla = load_hylo(self.run / "converted_mla").eval()
        res = proxy_scores(self._base(), lin, mla, rows)
        (self.run / "proxy.json").write_text(json.dumps(res, indent=1))
        return {}

    def score(self) -> dict:
        from hylo.pipeline.placement.rows import load_rows  # lazy: torch
        from hylo.pipeline.placement.score import score_layers  # lazy: torch

        rows = load_rows(self.data["heldout"], self.cfg.heldout_rows)
        self.ray_address()  # the run's Ray, which the training steps use too
        res = score_layers(self.run / "stage1_linear" / "model", self.run / "stage1_mla" / "model", self._base(),
                           rows, threads_per_task=1)
        (self.run / "scores.json").write_text(json.dumps(res, indent=1))
        return {}

    def write_placement(self, proxy_only: bool) -> dict:
        from hylo.pipeline.placement.ranking import choose, plot_scores, spearman  # lazy: torch

        c = self.cfg
        proxy = read_json(self.run / "proxy.json")
        result: dict = {"base": c.base, "n_mla": c.n_mla, "linear_type": c.linear_type,
                        "kv_lora_rank": c.kv_lora_rank, "heldout": str(self.data["heldout"]),
                        "heldout_rows": c.heldout_rows, "proxy": proxy}
        if proxy_only:
            result.update(method=f"proxy ({c.proxy})", mla_layers=choose(proxy[c.proxy], c.n_mla))
        else:
            measured = read_json(self.run / "scores.json")
            result.update(method="measured (KL drop after a short stage 1)", stage1_steps=c.steps,
                          measured=measured, mla_layers=choose(measured["drop"], c.n_mla),
                          spearman={k: spearman(proxy[k], measured["drop"]) for k in PROXIES},
                          proxy_mla_layers={k: choose(proxy[k], c.n_mla) for k in PROXIES})
        atomic_write(self.run / "placement.json", json.dumps(result, indent=1))
        if not proxy_only:
            plot_scores(result, self.run / "placement_scores.png")
        return result

    def evaluate(self, name: str, model: Path, out: Path) -> dict:
        self.sh(name, runner.eval_cmd(model, self.base_dir, self.data["heldout"], out, "kl", self.cfg.heldout_rows))
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
        res = read_json(ev / "results.json")
        summary = conv["summary"]
        return {"placement": name, "spec": spec, "seed": seed, "mla_layers": summary["mla_layers"],
                "kv_cache_ratio": summary["kv_cache_ratio"], "kl": res["kl"]["kl"], "tokens": res["kl"]["tokens"]}

    # ------------------------------------------------------------------ main
    def main(self) -> int:
        c, r = self.cfg, self.run
        self.base_dir = resolve_path_or_asset(c.base, "base", directory=True)
        self.step("converted_linear", [r / "converted_linear" / "hybrid_config.json"],
                  lambda: self.convert("converted_linear", "none"))
        self.step("converted_mla", [r / "converted_mla" / "hybrid_config.json"],
                  lambda: self.convert("converted_mla", "all"))
        self.step("proxy", [r / "proxy.json"], self.proxy)
        if not c.proxy_only:
            for kind in ("linear", "mla"):
                self.step(f"stage1_{kind}", [r / f"stage1_{kind}" / "model" / "hybrid_config.json"],
                          lambda k=kind: self.train(1, f"stage1_{k}", r / f"converted_{k}", c.steps))
            self.step("score", [r / "scores.json"], self.score)
        result = self.write_placement(c.proxy_only)
        print(placement_summary(result))
        if c.compare and not c.proxy_only:
            placements = {f"searched (N={c.n_mla})": ",".join(map(str, result["mla_layers"]))}
            placements.update({s: s for s in c.compare})
            rows = [self.compare_one(name, spec, c.compare_steps, seed)
                    for seed in c.compare_seeds for name, spec in placements.items()]
            self.write_compare(rows)
        print(f"\n[place] wrote {r / 'placement.json'}" + ("" if c.proxy_only else f" and {r / 'placement_scores.png'}"))
        return 0

    def write_compare(self, rows: list[dict]) -> None:
        from hylo.pipeline.placement.ranking import compare_summary  # lazy: torch

        steps = self.cfg.compare_steps
        summary = compare_summary(rows)
        md = compare_markdown(rows, summary, steps)
        (self.run / "compare.md").write_text("\n".join(md) + "\n")
        compare = {"steps_per_stage": steps, "seeds": sorted({x["seed"] for x in rows}), "rows": rows, "summary": summary}
        atomic_write(self.run / "compare.json", json.dumps(compare, indent=1))
        print("\n" + "\n".join(md))


def placement_summary(result: dict) -> str:
    """The chosen layers and, after a measured search, the per-layer drops beside the proxies."""
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
