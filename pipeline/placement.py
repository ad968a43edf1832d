"""Where should the MLA layers go? Sensitivity search by measurement, and a proxy that needs no training.

Legend: L layers, T tokens of a packed row, N scored tokens of a row, D hidden size.

The measured score (Zebra-Llama's SMART method; design.md section 1): take the all-linear student and the
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
  goes through the project's fused linear KL (`pipeline.eval.kl`), so no [N, V] logits are kept.
* The proxy (`proxy_scores`, no training, seconds): per-layer error of each converted mixer at
  initialisation against the base attention output it replaces, on the same rows, fed the base model's
  own layer inputs (mean per-token L2 distance). Three forms are reported with their rank correlation
  (Spearman) against the measured drops: the linear block's error, that error relative to the size of the
  attention output, and the gap between the linear and the MLA block's errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.eval.kl import check_eval_row, chunked_kl_sum, fused_kl_op, hidden_states

PROXIES = ("linear_error", "linear_error_rel", "error_gap")


class PlacementError(ValueError):
    """The search cannot run; the message names the input that is wrong."""


# ------------------------------------------------------------------------------------------ rows
@dataclass
class Row:
    where: str
    input_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [docs + 1] int32
    scored: torch.Tensor  # [N] indices of scored tokens (their label is the next token)
    real: torch.Tensor  # [T] 1.0 on tokens of real documents (padding excluded)

    @property
    def position_ids(self) -> torch.Tensor:
        from hylo.modeling import positions_from_cu_seqlens

        return positions_from_cu_seqlens(self.cu_seqlens, self.input_ids.numel()).unsqueeze(0)

    def batch(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[None], "position_ids": self.position_ids, "cu_seqlens": self.cu_seqlens}


def load_rows(data: str | Path, max_rows: int) -> list[Row]:
    """The first `max_rows` held-out packed rows of a jobs/prepare_data.py directory."""
    from pipeline.data.dataset import RowReader

    p = Path(data)
    if not (p / "manifest.json").is_file():
        raise PlacementError(f"held-out data {p}: not a packed-data directory (no manifest.json); make one with "
                             "jobs/prepare_data.py")
    rows = []
    for k, raw in enumerate(RowReader(p, drop_last=False)):
        if k >= max_rows:
            break
        where = f"{p} row {k}"
        r = check_eval_row(raw, where)
        real = torch.ones(r["input_ids"].numel())
        cu = r["cu_seqlens"].tolist()
        for d, s, e in zip(raw.get("doc_ids") or [], cu[:-1], cu[1:]):
            if d == "":  # the packer's padding segment
                real[s:e] = 0.0
        rows.append(Row(where, r["input_ids"], r["cu_seqlens"], r["loss_mask"].nonzero().squeeze(-1), real))
    if not rows:
        raise PlacementError(f"{p}: no held-out rows read")
    if sum(r.scored.numel() for r in rows) == 0:
        raise PlacementError(f"{p}: {len(rows)} row(s) read but none has a scored token")
    return rows


# ------------------------------------------------------------------------------------------ math
def kl_sum(hs_ND: torch.Tensor, ws_VD: torch.Tensor, ht_ND: torch.Tensor, wt_VD: torch.Tensor) -> float:
    """Sum over tokens of KL(teacher || student) from final hidden states and output weights."""
    op = fused_kl_op()
    if op is not None:
        return float(op(hs_ND, ws_VD, teacher_hidden=ht_ND, teacher_weight=wt_VD, reduction="sum"))
    return chunked_kl_sum(hs_ND, ws_VD, ht_ND, wt_VD)


@torch.no_grad()
def teacher_hidden(base: nn.Module, rows: list[Row]) -> list[torch.Tensor]:
    """The base model's final hidden states on each row's scored tokens ([N, D] per row)."""
    return [hidden_states(base, {"input_ids": r.input_ids, "cu_seqlens": r.cu_seqlens})[r.scored] for r in rows]


@torch.no_grad()
def layer_inputs(model: nn.Module, row: Row) -> list[torch.Tensor]:
    """The input [T, D] of every layer of a HyLo model on one packed row."""
    out = model.model(input_ids=row.input_ids[None], cu_seqlens=row.cu_seqlens, output_hidden_states=True)
    return [h[0] for h in out.hidden_states[:-1]]


@torch.no_grad()
def run_from(layers: list[nn.Module], norm: nn.Module, h_TD: torch.Tensor, row: Row) -> torch.Tensor:
    """Final normed hidden states [T, D] from `h_TD` through `layers` (one packed row)."""
    h, pos = h_TD[None], row.position_ids
    for layer in layers:
        h, _ = layer(h, pos, row.cu_seqlens, None)
    return norm(h)[0]


@torch.no_grad()
def swapped_kl(linear: nn.Module, mla: nn.Module, i: int | None, inputs: list[torch.Tensor], rows: list[Row],
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
        if r.scored.numel() == 0:
            continue
        hs_ND = run_from(layers, linear.model.norm, h_TD, r)[r.scored]
        total += kl_sum(hs_ND, ws, ht_ND, teacher_weight)
        tokens += r.scored.numel()
    return total / tokens


# ------------------------------------------------------------------------------------------ Ray tasks
_MODELS: dict[str, nn.Module] = {}


def _model(path: str) -> nn.Module:
    """Each worker process loads a student once and keeps it for the layers it scores."""
    if path not in _MODELS:
        from hylo.io import load_hylo

        _MODELS[path] = load_hylo(path, dtype=torch.float32).eval()
    return _MODELS[path]


def _score_layer(i: int, linear_dir: str, mla_dir: str, inputs: list[torch.Tensor], rows: list[Row],
                 teacher: tuple[list[torch.Tensor], torch.Tensor], threads: int) -> tuple[int, float]:
    torch.set_num_threads(threads)
    return i, swapped_kl(_model(linear_dir), _model(mla_dir), i, inputs, rows, *teacher)


@torch.no_grad()
def score_layers(linear_dir: str | Path, mla_dir: str | Path, base: nn.Module, rows: list[Row],
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
            "tokens": int(sum(r.scored.numel() for r in rows)), "rows": len(rows)}


# ------------------------------------------------------------------------------------------ proxy
@torch.no_grad()
def proxy_scores(base: nn.Module, linear: nn.Module, mla: nn.Module, rows: list[Row]) -> dict[str, list[float]]:
    """Per-layer errors of the converted (untrained) mixers against the base attention outputs."""
    from pipeline.train.stage1 import BaseLayerTargets

    targets = BaseLayerTargets(base)
    n = len(linear.model.layers)
    err_lin, err_mla, attn = np.zeros(n), np.zeros(n), np.zeros(n)
    count = 0.0
    for r in rows:
        b = r.batch()
        x_in, _, y_mix = targets(b)
        keep = r.real
        count += float(keep.sum())
        for i in range(n):
            for model, acc in ((linear, err_lin), (mla, err_mla)):
                layer = model.model.layers[i]
                out = layer.run_mixer(layer.input_layernorm(x_in[i]), b["position_ids"], r.cu_seqlens)[0]
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
