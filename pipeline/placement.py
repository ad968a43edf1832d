"""Where should the MLA layers go? Sensitivity search by measurement, and a proxy that needs no training.

Legend: L layers, T tokens of a packed row, N scored tokens of a row, D hidden size.

The measured score (Zebra-Llama's SMART layer-selection method): take the all-linear student and the
all-MLA student of the same base, both after a short stage 1. For each layer i, switch layer i of the
all-linear student to the all-MLA student's layer i and measure KL(base || student) on held-out rows;
the score is how much the KL drops:

    drop_i = KL(all linear) - KL(all linear, layer i = MLA)

and the N layers with the largest drops get MLA. Design choices:
* Stage 1 (Enhanced-ILD) trains every layer on the base model's own layer inputs, so layer i of the
  all-MLA student after stage 1 is what layer i of any mixed student would be after the same stage 1:
  the swap is the student that placement would produce, not an approximation of it.
* Layers before i are the same in the swapped and the all-linear student, so their hidden states are
  computed once (`layer_inputs`) and each score runs only layers i..L-1: on average half a forward.
* Scores run as Ray tasks, one per layer (one CPU or GPU each); every worker process loads the two
  students once and keeps them for the layers it is given.
* Teacher = the base model: its final hidden states on the scored tokens are computed once, and the KL
  goes through the project's fused linear KL (`hylo.pipeline.eval.kl`), so no [N, V] logits are kept.
* The proxy (`proxy_scores`, no training, seconds): per-layer error of each converted mixer at
  initialisation against the base attention output it replaces, on the same rows, fed the base model's
  own layer inputs (mean per-token L2 distance). Three forms are reported with their rank correlation
  (Spearman) against the measured drops: the linear block's error, that error relative to the size of the
  attention output, and the gap between the linear and the MLA block's errors.

The workflow (`PlaceLayers`, run by jobs/place_layers.py; options: `PlacementConfig`), each step resumable
(`<run_dir>/done/` records what finished, `force` redoes everything):
  convert the base all-linear (mla_layers: none) and all-MLA (mla_layers: all)
  -> proxy: per-layer error of each converted mixer against the base attention, no training
  -> a short stage 1 of both students (jobs/stage1.py, `steps`)
  -> score every layer in parallel with Ray tasks -> the `n_mla` largest drops get MLA
  -> placement.json (chosen mla_layers, per-layer scores, proxy rank correlations) + placement_scores.png
  -> with `compare`: each placement (the searched one and the listed ones) converted, trained with the
     same stage 1 + stage 2 budget (`compare_steps`) and evaluated: compare.md / compare.json.
     `compare_seeds: [0, 1, 2]` repeats every compared run per seed (`convert --seed`: the init of what
     conversion does not set; also `train.seed`, though packed rows are read in file order whatever the
     seed) and reports the mean, the spread and the paired difference to the searched placement per seed:
     one seed's init noise on these tiny budgets is as large as the gaps between placements.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hylo.files import atomic_write
from hylo.pipeline import runner
from hylo.pipeline.cli import int_at_least
from hylo.pipeline.config import (
    PATH,
    ROW_TOKENS,
    at_least,
    config_file,
    config_from_args,
    each,
    one_of,
    rules,
)
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.eval.kl import check_eval_row, hidden_states, scored_tokens, sum_kl

PROXIES = ("linear_error", "linear_error_rel", "error_gap")


class PlacementError(ValueError):
    """The search cannot run; the message names the input that is wrong."""


# ------------------------------------------------------------------------------------------ rows
def load_rows(data: str | Path, max_rows: int) -> list[PackedRow]:
    """The first `max_rows` held-out packed rows of a jobs/prepare_data.py directory, through the one reader
    of packed rows and checked as evaluation checks them (`check_eval_row`: their `loss_mask` says which
    tokens are scored)."""
    from hylo.pipeline.data.reader import RowReader

    p = Path(data)
    if not (p / "manifest.json").is_file():
        raise PlacementError(f"held-out data {p}: not a packed-data directory (no manifest.json); make one with "
                             "jobs/prepare_data.py")
    reader = RowReader(p, drop_last=False, clear_crossing_labels=True)
    rows = [check_eval_row(row, f"{p} row {k}") for k, row in enumerate(itertools.islice(reader, max_rows))]
    if not rows:
        raise PlacementError(f"{p}: no held-out rows read")
    if sum(scored_tokens(r).numel() for r in rows) == 0:
        raise PlacementError(f"{p}: {len(rows)} row(s) read but none has a scored token")
    return rows


# ------------------------------------------------------------------------------------------ math
@torch.no_grad()
def teacher_hidden(base: nn.Module, rows: list[PackedRow]) -> list[torch.Tensor]:
    """The base model's final hidden states on each row's scored tokens ([N, D] per row)."""
    return [hidden_states(base, r)[scored_tokens(r)] for r in rows]


@torch.no_grad()
def layer_inputs(model: nn.Module, row: PackedRow) -> list[torch.Tensor]:
    """The input [T, D] of every layer of a HyLo model on one packed row."""
    out = model.model(input_ids=row.input_ids[None], cu_seqlens=row.cu_seqlens, output_hidden_states=True)
    return [h[0] for h in out.hidden_states[:-1]]


@torch.no_grad()
def run_from(layers: list[nn.Module], norm: nn.Module, h_TD: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Final normed hidden states [T, D] from `h_TD` through `layers` (one packed row)."""
    h, pos = h_TD[None], row.position_ids[None]
    for layer in layers:
        h, _ = layer(h, pos, row.cu_seqlens, None)
    return norm(h)[0]


@torch.no_grad()
def swapped_kl(linear: nn.Module, mla: nn.Module, i: int | None, inputs: list[torch.Tensor], rows: list[PackedRow],
               teacher: list[torch.Tensor], teacher_weight: torch.Tensor) -> float:
    """KL per scored token of the all-linear student with layer i taken from the all-MLA student.

    inputs[r] is row r's input to layer i in the all-linear student (the embeddings when i is None, which
    scores the all-linear student itself); teacher[r] holds the base's final hidden states on row r's scored
    tokens and `teacher_weight` its output weights.
    """
    lin_layers = list(linear.model.layers)
    start = 0 if i is None else i
    layers = lin_layers[start:] if i is None else [mla.model.layers[i], *lin_layers[i + 1:]]
    ws = linear.get_output_embeddings().weight
    total = tokens = 0.0
    for r, h_TD, ht_ND in zip(rows, inputs, teacher):
        scored = scored_tokens(r)
        if scored.numel() == 0:
            continue
        hs_ND = run_from(layers, linear.model.norm, h_TD, r)[scored]
        total += sum_kl(hs_ND, ws, ht_ND, teacher_weight, chunk=None)
        tokens += scored.numel()
    return total / tokens


# ------------------------------------------------------------------------------------------ Ray tasks
_MODELS: dict[str, nn.Module] = {}


def _model(path: str) -> nn.Module:
    """Each worker process loads a student once and keeps it for the layers it scores."""
    if path not in _MODELS:
        from hylo.io import load_hylo

        _MODELS[path] = load_hylo(path, dtype=torch.float32).eval()
    return _MODELS[path]


def _score_layer(i: int, linear_dir: str, mla_dir: str, inputs: list[torch.Tensor], rows: list[PackedRow],
                 teacher: tuple[list[torch.Tensor], torch.Tensor], threads: int) -> tuple[int, float]:
    torch.set_num_threads(threads)
    return i, swapped_kl(_model(linear_dir), _model(mla_dir), i, inputs, rows, *teacher)


@torch.no_grad()
def score_layers(linear_dir: str | Path, mla_dir: str | Path, base: nn.Module, rows: list[PackedRow],
                 threads_per_task: int = 1, progress: bool = True) -> dict[str, Any]:
    """Measured KL drop of every layer, scored in parallel with Ray tasks (ray must be initialised)."""
    import ray

    linear = _model(str(linear_dir))
    mla = _model(str(mla_dir))
    n = len(linear.model.layers)
    if len(mla.model.layers) != n:
        raise PlacementError(f"{linear_dir} has {n} layers, {mla_dir} {len(mla.model.layers)}: convert both "
                             "from the same base")
    if len(linear.config.mla_layers) != 0 or len(mla.config.mla_layers) != n:
        raise PlacementError(f"{linear_dir} must be all-linear (mla_layers: none) and {mla_dir} all-MLA "
                             f"(mla_layers: all); they have {len(linear.config.mla_layers)} and "
                             f"{len(mla.config.mla_layers)} MLA layers")
    teacher = (teacher_hidden(base, rows), base.get_output_embeddings().weight.detach().float())
    per_row = [layer_inputs(linear, r) for r in rows]  # [row][layer] -> [T, D]
    kl_linear = swapped_kl(linear, mla, None, [p[0] for p in per_row], rows, *teacher)
    kl_mla = swapped_kl(mla, mla, None, [mla.model.embed_tokens(r.input_ids) for r in rows], rows, *teacher)
    rows_ref, teacher_ref = ray.put(rows), ray.put(teacher)
    task = ray.remote(num_cpus=threads_per_task)(_score_layer)
    pending = [task.remote(i, str(linear_dir), str(mla_dir), ray.put([p[i] for p in per_row]), rows_ref,
                           teacher_ref, threads_per_task) for i in range(n)]
    del per_row
    kl_swap: dict[int, float] = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n, desc="scoring layers", unit="layer")
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i, kl = ray.get(done[0])
        kl_swap[i] = kl
        if bar is not None:
            bar.update(1)
            bar.set_postfix(layer=i, drop=f"{kl_linear - kl:.4f}")
    if bar is not None:
        bar.close()
    return {"kl_all_linear": kl_linear, "kl_all_mla": kl_mla,
            "kl_swap": [kl_swap[i] for i in range(n)],
            "drop": [kl_linear - kl_swap[i] for i in range(n)],
            "tokens": int(sum(scored_tokens(r).numel() for r in rows)), "rows": len(rows)}


# ------------------------------------------------------------------------------------------ proxy
@torch.no_grad()
def proxy_scores(base: nn.Module, linear: nn.Module, mla: nn.Module, rows: list[PackedRow]) -> dict[str, list[float]]:
    """Per-layer errors of the converted (untrained) mixers against the base attention outputs."""
    from hylo.pipeline.train.stage1 import BaseLayerTargets

    targets = BaseLayerTargets(base)
    n = len(linear.model.layers)
    err_lin, err_mla, attn = np.zeros(n), np.zeros(n), np.zeros(n)
    count = 0.0
    for r in rows:
        x_in, _, y_mix = targets(r)
        keep = r.real_tokens()
        count += float(keep.sum())
        for i in range(n):
            for model, acc in ((linear, err_lin), (mla, err_mla)):
                layer = model.model.layers[i]
                out = layer.run_mixer(layer.input_layernorm(x_in[i]), r.position_ids[None], r.cu_seqlens)[0]
                acc[i] += float(((out - y_mix[i][0]).pow(2).sum(-1).sqrt() * keep).sum())
            attn[i] += float((y_mix[i][0].pow(2).sum(-1).sqrt() * keep).sum())
    err_lin, err_mla, attn = err_lin / count, err_mla / count, attn / count
    return {"linear_error": err_lin.tolist(), "linear_error_rel": (err_lin / attn).tolist(),
            "error_gap": (err_lin - err_mla).tolist(), "mla_error": err_mla.tolist(), "attention_norm": attn.tolist()}


# ------------------------------------------------------------------------------------------ ranking
def ranks(x: Iterable[float]) -> np.ndarray:
    """Ranks 0..n-1 (ties get their average rank)."""
    a = np.asarray(list(x), dtype=np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(len(a), dtype=np.float64)
    for v in np.unique(a):
        same = a == v
        if same.sum() > 1:
            r[same] = r[same].mean()
    return r


def spearman(a: Iterable[float], b: Iterable[float]) -> float:
    """Spearman rank correlation (Pearson correlation of the ranks); nan when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if len(ra) != len(rb):
        raise PlacementError(f"spearman: {len(ra)} vs {len(rb)} values")
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def choose(scores: Iterable[float], n_mla: int) -> list[int]:
    """The `n_mla` layers with the largest scores, in layer order (ties: the lower layer first)."""
    s = list(scores)
    if not 0 <= n_mla <= len(s):
        raise PlacementError(f"n_mla={n_mla} must be in 0..{len(s)} (the model has {len(s)} layers)")
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    return sorted(order[:n_mla])


def compare_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate compared runs (one per placement and seed) per placement, in first-seen order.

    mean / std (sample, 0 for one seed) of the held-out KL over seeds; for every placement but the searched
    one (the first), the paired gaps KL(placement) - KL(searched) of the seeds both ran, their mean, and in
    how many of those seeds the searched placement was lower. Pairing by seed removes what the placements
    share within a seed (the init of every layer whose type agrees: conversion seeds each layer).
    """
    order: list[str] = []
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r["placement"] not in by:
            order.append(r["placement"])
            by[r["placement"]] = {}
        if r["seed"] in by[r["placement"]]:
            raise PlacementError(f"placement {r['placement']!r} has two runs with seed {r['seed']}")
        by[r["placement"]][r["seed"]] = r
    searched = by[order[0]] if order else {}
    out = []
    for k, name in enumerate(order):
        runs = by[name]
        kls = np.array([runs[s]["kl"] for s in sorted(runs)], dtype=np.float64)
        first = runs[min(runs)]
        item: dict[str, Any] = {
            "placement": name, "mla_layers": first["mla_layers"], "kv_cache_ratio": first["kv_cache_ratio"],
            "seeds": sorted(runs), "mean": float(kls.mean()), "std": float(kls.std(ddof=1)) if len(kls) > 1 else 0.0,
            "gaps": [], "gap_to_searched": None, "searched_lower": None,
        }
        if k > 0:
            shared = sorted(set(runs) & set(searched))
            gaps = [runs[s]["kl"] - searched[s]["kl"] for s in shared]
            item.update(gaps=gaps, gap_to_searched=float(np.mean(gaps)) if gaps else None,
                        searched_lower=sum(g > 0 for g in gaps) if gaps else None)
        out.append(item)
    return out


def plot_scores(result: dict[str, Any], path: Path) -> Path:
    """Bar plot of the measured drop per layer (chosen layers highlighted) next to the best proxy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drop = result["measured"]["drop"]
    chosen = set(result["mla_layers"])
    xs = list(range(len(drop)))
    fig, ax = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    ax[0].bar(xs, drop, color=["#c33" if i in chosen else "#999" for i in xs])
    ax[0].set_ylabel("KL drop (nats/token)")
    ax[0].set_title(f"KL(base || all-linear) - KL(layer i = MLA); red: the {len(chosen)} chosen MLA layers")
    best = max(PROXIES, key=lambda k: np.nan_to_num(result["spearman"].get(k, float("nan")), nan=-2.0))
    ax[1].bar(xs, result["proxy"][best], color="#69c")
    ax[1].set_ylabel(best)
    ax[1].set_title(f"proxy at initialisation ({best}), Spearman vs measured = {result['spearman'][best]:.2f}")
    ax[1].set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ the workflow
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
        from hylo.assets import local_path

        # the run directory is none of the inputs (the base, the rows), nor inside or around one
        inputs = [("base", local_path(cfg.base) if cfg.base else None),
                  *((f"{split}_data", p) for split, p in self.data.items())]
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
        from hylo.upcycle import load_base_model

        return load_base_model(self.base_dir).eval()

    def proxy(self) -> dict:
        from hylo.io import load_hylo

        rows = load_rows(self.data["heldout"], self.cfg.heldout_rows)
        lin = load_hylo(self.run / "converted_linear").eval()
        mla = load_hylo(self.run / "converted_mla").eval()
        res = proxy_scores(self._base(), lin, mla, rows)
        (self.run / "proxy.json").write_text(json.dumps(res, indent=1))
        return {}

    def score(self) -> dict:
        rows = load_rows(self.data["heldout"], self.cfg.heldout_rows)
        self.ray_address()  # the run's Ray, which the training steps use too
        res = score_layers(self.run / "stage1_linear" / "model", self.run / "stage1_mla" / "model", self._base(),
                           rows, threads_per_task=1)
        (self.run / "scores.json").write_text(json.dumps(res, indent=1))
        return {}

    def write_placement(self, proxy_only: bool) -> dict:
        c = self.cfg
        proxy = json.loads((self.run / "proxy.json").read_text())
        result: dict = {"base": c.base, "n_mla": c.n_mla, "linear_type": c.linear_type,
                        "kv_lora_rank": c.kv_lora_rank, "heldout": str(self.data["heldout"]),
                        "heldout_rows": c.heldout_rows, "proxy": proxy}
        if proxy_only:
            result.update(method=f"proxy ({c.proxy})", mla_layers=choose(proxy[c.proxy], c.n_mla))
        else:
            measured = json.loads((self.run / "scores.json").read_text())
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
        res = json.loads((ev / "results.json").read_text())
        summary = conv["summary"]
        return {"placement": name, "spec": spec, "seed": seed, "mla_layers": summary["mla_layers"],
                "kv_cache_ratio": summary["kv_cache_ratio"], "kl": res["kl"]["kl"], "tokens": res["kl"]["tokens"]}

    # ------------------------------------------------------------------ main
    def main(self) -> int:
        from hylo.assets import resolve_path_or_asset

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


# ---------------------------------------------------------------------------------- command line
# Each shorthand flag's config key (the flags win over --config and --set).
FLAG_KEYS = {**runner.RUNNER_FLAGS, "num_cpus": "ray.num_cpus", **{name: name for name in (
    "base", "n_mla", "data_from", "stage1_data", "stage2_data", "heldout_data", "train_config", "train_set",
    "steps", "seq_len", "heldout_rows", "kv_lora_rank", "linear_type", "proxy_only", "proxy", "compare",
    "compare_steps", "compare_seeds")}}


def build_parser() -> argparse.ArgumentParser:
    ap = runner.runner_parser(
        "Choose which layers keep full attention (MLA) by measurement: the sensitivity search.\n\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo [--compare even uniform:15]   # after `hylo demo`\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo --proxy-only      # seconds, no training\n"
        "    hylo place-layers --n-mla 15 --data-from runs/demo --set compare_seeds=[0,1,2] --print-config\n\n"
        "run_dir default runs/placement. Every option is a key of PlacementConfig (pipeline/placement.py); the\n"
        "flags are shorthands for them.")
    ap.add_argument("--base", help="base HF model directory or asset:<name> (base)")
    ap.add_argument("--n-mla", type=int_at_least(1), help="how many layers get MLA (n_mla; required)")
    ap.add_argument("--data-from", help="a demo run directory: use its data/{stage1,stage2,heldout}")
    ap.add_argument("--stage1-data")
    ap.add_argument("--stage2-data")
    ap.add_argument("--heldout-data")
    ap.add_argument("--train-config", help="training config of the short stages: a file or a shipped config's name (default "
                    "demo-smollm2.yaml)")
    ap.add_argument("--train-set", action="append", metavar="KEY=VALUE",
                    help="extra --set override for every training job, e.g. model.activation_checkpointing=false")
    ap.add_argument("--steps", type=int_at_least(1), help="stage-1 steps of the two students the search scores")
    ap.add_argument("--seq-len", type=int_at_least(2), help="tokens per packed row (as the data was packed)")
    ap.add_argument("--heldout-rows", type=int_at_least(1), help="held-out rows every layer is scored on")
    ap.add_argument("--kv-lora-rank", type=int_at_least(1))
    ap.add_argument("--linear-type", choices=["gdn", "mamba2"])
    ap.add_argument("--num-cpus", type=int_at_least(1), help="CPUs of the local Ray that scores layers (ray.num_cpus)")
    ap.add_argument("--proxy-only", action="store_true", default=None, help="choose by the training-free proxy only")
    ap.add_argument("--proxy", choices=list(PROXIES), help="the proxy --proxy-only ranks by (default error_gap)")
    ap.add_argument("--compare", nargs="*", metavar="PLACEMENT",
                    help="placements to compare with the searched one, e.g. --compare even uniform:15 0,5,10")
    ap.add_argument("--compare-steps", type=int_at_least(1), help="stage 1 and stage 2 steps of each compared run")
    ap.add_argument("--compare-seeds", nargs="+", type=int_at_least(0), metavar="SEED",
                    help="run every compared placement once per seed (conversion init, train.seed); with several "
                         "seeds the table gives mean, spread and the paired difference to the searched placement")
    return ap


def placement_config(argv: list[str] | None = None) -> PlacementConfig:
    """The search's config from its command line (`--print-config` prints it and exits)."""
    return config_from_args(PlacementConfig, build_parser().parse_args(argv), FLAG_KEYS)


def run_placement(cfg: PlacementConfig) -> int:
    t0 = time.time()
    with PlaceLayers(cfg) as job:
        rc = job.main()
    print(f"[place] total {time.time() - t0:.0f} s")
    return rc
