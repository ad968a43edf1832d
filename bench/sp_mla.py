"""Sequence parallelism per layer: what one MLA layer sends through the latent gather and through DeepSpeed's
Ulysses, and what one linear layer (GDN or Mamba-2) sends passing states, side by side in one run.

    python bench/sp_mla.py [--config configs/llama-3.2-3b-14mla14gdn-64k.yaml] [--tokens 4096] [--ranks 2 4]

For each group size N it spawns N local gloo ranks (one CPU thread each), builds the recipe's first MLA and
first linear layer (random weights, fp32, the recipe's shapes), splits one packed row of `--tokens` tokens
(documents of 1,000-3,000 tokens, crossing the splits) and runs forward + backward of the layer, counting
every collective the layer calls (`torch.distributed` wrapped in the ranks: elements, bytes, calls) and
timing it (CPU wall time: a ratio between the two MLA modes on this machine, not a GPU figure). Bytes are
what a rank puts on the wire under ring algorithms: all-gather and all-to-all (N - 1) / N of the gathered
/ exchanged tensor, all-reduce 2 (N - 1) / N of it, reduce-scatter (N - 1) / N. Per token figures divide
by the rank's tokens; they scale linearly with the row length (MLA, Ulysses) or not at all (states).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's hylo; the spawned ranks import tests.helpers.sp_group by name

from hylo.kernels.varlen import DocBounds  # noqa: E402
from hylo.modeling import build_mixer  # noqa: E402
from hylo.pipeline.estimate import student_config  # noqa: E402
from hylo.pipeline.train.config import load_stage_config  # noqa: E402
from hylo.pipeline.train.deepspeed_cfg import import_deepspeed  # noqa: E402
from hylo.seq_parallel import shard_row  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "llama-3.2-3b-14mla14gdn-64k.yaml"


def counting_collectives() -> dict[str, float]:
    """Wrap torch.distributed's collectives to add up what this rank sends (ring algorithms)."""
    sent = {"bytes": 0.0, "calls": 0.0}

    def wrap(name: str, factor, size_of):
        real = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any):
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            sent["bytes"] += factor(n) * size_of(*args, **kwargs)
            sent["calls"] += 1
            return real(*args, **kwargs)

        setattr(dist, name, counted)

    def nbytes(t) -> float:
        return float(t.numel() * t.element_size())

    wrap("all_gather", lambda n: (n - 1), lambda out, x, **_: nbytes(x))
    wrap("all_reduce", lambda n: 2 * (n - 1) / n, lambda x, **_: nbytes(x))
    wrap("reduce_scatter_tensor", lambda n: (n - 1) / n, lambda out, x, **_: nbytes(x))
    wrap("all_to_all_single", lambda n: (n - 1) / n,
         lambda *a, **k: nbytes(k["input"] if "input" in k else a[1]))
    return sent


def _rank(rank: int, world: int, config: str, tokens: int) -> dict[str, Any]:
    import_deepspeed().init_distributed(dist_backend="gloo")
    sent = counting_collectives()
    hc = student_config(load_stage_config(1, config), None)
    mla_idx = next(i for i in range(hc.n_layer) if hc.layer_type(i) == "mla")
    lin_idx = next(i for i in range(hc.n_layer) if hc.layer_type(i) != "mla")
    cu = list(range(0, tokens, 2731)) + [tokens]
    bounds = DocBounds.from_host(cu, tokens, "cpu")
    out: dict[str, Any] = {"tokens": tokens, "ranks": world, "cu_seqlens": cu}
    for label, idx, mode in (("mla latent", mla_idx, "latent"), ("mla ulysses", mla_idx, "ulysses"),
                             (f"{hc.layer_type(lin_idx)} states", lin_idx, "latent")):
        torch.manual_seed(0)
        layer = build_mixer(hc, idx).float()
        shard = shard_row(bounds, rank, world, mla=mode)
        x = torch.randn(1, tokens, hc.hidden_size, generator=torch.Generator().manual_seed(1))
        x = x[:, shard.start:shard.end].clone().requires_grad_(True)
        kw = {"position_ids": shard.local.positions[None]} if hc.layer_type(idx) == "mla" else {}
        # the second of two runs (the first warms up)
        for _ in range(2):
            before = dict(sent)
            t0 = time.perf_counter()
            y = layer(x, cu_seqlens=shard.local, shard=shard, **kw)
            y.square().sum().backward()
            wall = time.perf_counter() - t0
        out[label] = {"bytes": sent["bytes"] - before["bytes"], "calls": int(sent["calls"] - before["calls"]),
                      "seconds": wall, "tokens_per_rank": shard.end - shard.start}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args(argv)

    from tests.helpers.sp_group import run_ranks  # lazy: tests

    print(f"{Path(args.config).name}: one layer, forward + backward, {args.tokens} tokens a row "
          "(bytes a rank sends, ring algorithms; CPU seconds, gloo, 1 thread a rank)")
    print(f"{'N':>2} {'layer':<16} {'calls':>5} {'MiB / rank':>10} {'bytes / token':>13} {'seconds':>8}")
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as d:
            res = run_ranks(partial(_rank, config=args.config, tokens=args.tokens), n, Path(d))
        worst = res[-1]
        for label in [k for k in worst if isinstance(worst[k], dict)]:
            r = worst[label]
            print(f"{n:>2} {label:<16} {r['calls']:>5} {r['bytes'] / 2**20:>10.2f} "
                  f"{r['bytes'] / r['tokens_per_rank']:>13.0f} {max(x[label]['seconds'] for x in res):>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
