"""Ranking: rank correlation of a proxy against the measured drops, the chosen layers, the compared runs' summary
and the plot of the scores."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hylo.pipeline.placement.proxy import PROXIES
from hylo.pipeline.placement.rows import PlacementError


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
    import matplotlib  # lazy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib

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
