"""The teacher split with the row (`train.sequence_parallel_teacher`), measured on CPU: a real teacher's FLOPs per
rank at N = 1, 2, 4, and the bytes each split sends per layer at a recipe teacher's attention shapes, side by side.

    python bench/sp_teacher.py [--teacher asset:smollm2-135m-instruct] [--tokens 1024]
                               [--shape Llama-3.1-8B-Instruct] [--shape-tokens 512] [--ranks 1 2 4]

Part 1 runs the teacher's forward (`TeacherModel.hidden_split`, fp32) on one packed row whose documents cross
the splits, on N spawned gloo ranks (one CPU thread each), by each split: "allgather" (the keys and values
gathered), "ulysses" (all-to-all by heads; refused where the heads do not divide by N) and "whole" (every rank
runs the whole row: today's cost). It prints each rank's FLOPs (torch's counter, attention included:
`estimate.fake.count_flops`), the bytes it sends and its wall time (CPU seconds: ratios, not GPU figures).
Part 2 builds one decoder layer at a named teacher's shapes (`hylo estimate`'s table: hidden size, heads, kv
heads, head dim; the MLP shrunk, which sends nothing) and prints the bytes a rank sends per layer and per row
token by each split. Bytes are what a rank puts on the wire under ring algorithms (bench/sp_mla.py's counter).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's hylo; the spawned ranks import tests.helpers.sp_group by name

from bench.sp_mla import counting_collectives  # noqa: E402
from hylo.kernels.varlen import DocBounds  # noqa: E402
from hylo.pipeline.estimate.fake import count_flops  # noqa: E402
from hylo.pipeline.train.config import TEACHER_SPLITS  # noqa: E402
from hylo.pipeline.train.deepspeed_cfg import import_deepspeed  # noqa: E402
from hylo.seq_parallel import shard_row, ulysses_problem  # noqa: E402


def _row_bounds(tokens: int) -> list[int]:
    """Documents of 700 tokens, then the rest: boundaries that cross the splits at 2 and 4 ranks."""
    return list(range(0, tokens, 700)) + [tokens]


def _splits(heads: int, world: int) -> dict[str, str | None]:
    """Each split, with why it cannot run here (None: it can)."""
    return {s: (ulysses_problem(heads, world) if s == "ulysses" and heads % world else None)
            for s in TEACHER_SPLITS}


def _teacher_rank(rank: int, world: int, teacher: str, tokens: int) -> dict[str, Any]:
    """Part 1 on one rank: the real teacher's forward by each split."""
    import torch.distributed as dist

    from hylo.pipeline.data.rows import check_row
    from hylo.pipeline.teacher.model import TeacherModel

    import_deepspeed().init_distributed(dist_backend="gloo")
    sent = counting_collectives()
    model = TeacherModel(teacher, dtype="float32", device="cpu")
    cu = _row_bounds(tokens)
    ids = torch.randint(0, model.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    row = check_row({"input_ids": ids, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)})
    bounds = DocBounds.from_host(cu, tokens, "cpu")
    out: dict[str, Any] = {"heads": model.model.config.num_attention_heads}
    for split, problem in _splits(out["heads"], world).items():
        if problem:
            out[split] = {"refused": problem}
            continue
        shard = shard_row(bounds, rank, world, dist.group.WORLD, teacher=split)
        run = (lambda: model.hidden(row)) if split == "whole" else (lambda: model.hidden_split(row, shard))  # noqa: B023
        run()  # warm-up
        before = dict(sent)
        t0 = time.perf_counter()
        _, flops = count_flops(run)
        out[split] = {"flops": flops, "bytes": sent["bytes"] - before["bytes"], "seconds": time.perf_counter() - t0}
    return out


def _shape_rank(rank: int, world: int, shape: str, tokens: int) -> dict[str, Any]:
    """Part 2 on one rank: one decoder layer at `shape`'s attention shapes, the bytes each split sends."""
    import torch.distributed as dist
    from transformers import AutoModel

    from hylo.pipeline.estimate.shapes import model_config

    import_deepspeed().init_distributed(dist_backend="gloo")
    sent = counting_collectives()
    cfg = model_config(shape, "teacher")
    cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size = 1, 64, 128
    torch.manual_seed(0)
    model = AutoModel.from_config(cfg).eval()
    cu = _row_bounds(tokens)
    bounds = DocBounds.from_host(cu, tokens, "cpu")
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                           "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads}
    for split, problem in _splits(cfg.num_attention_heads, world).items():
        if problem or split == "whole":
            out[split] = {"refused": problem} if problem else {"bytes": 0.0, "tokens_per_rank": tokens}
            continue
        from hylo.seq_parallel import split_attention

        shard = shard_row(bounds, rank, world, dist.group.WORLD, teacher=split)
        before = dict(sent)
        with torch.no_grad(), split_attention(model, shard):
            model(input_ids=ids[:, shard.start:shard.end], position_ids=shard.local.positions[None], use_cache=False)
        out[split] = {"bytes": sent["bytes"] - before["bytes"], "tokens_per_rank": shard.end - shard.start}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--teacher", default="asset:smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--shape", default="Llama-3.1-8B-Instruct")
    ap.add_argument("--shape-tokens", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)

    from tests.helpers.sp_group import run_ranks  # lazy: tests

    print(f"1. {args.teacher}: the forward of one {args.tokens}-token row, per rank (fp32, gloo, 1 thread a rank)")
    print(f"{'N':>2} {'split':<10} {'GFLOP / rank (max)':>18} {'x of N=1':>8} {'MiB sent / rank':>15} {'seconds':>8}")
    unsplit = None
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as d:
            res = run_ranks(partial(_teacher_rank, teacher=args.teacher, tokens=args.tokens), n, Path(d))
        for split in TEACHER_SPLITS:
            if "refused" in res[0][split]:
                print(f"{n:>2} {split:<10} refused: {res[0][split]['refused']}")
                continue
            flops = max(r[split]["flops"] for r in res)
            unsplit = unsplit or flops
            print(f"{n:>2} {split:<10} {flops / 1e9:>18.2f} {flops / unsplit:>8.3f} "
                  f"{max(r[split]['bytes'] for r in res) / 2**20:>15.2f} {max(r[split]['seconds'] for r in res):>8.2f}")
    print(f"\n2. {args.shape}'s attention shapes: bytes a rank sends per layer, one {args.shape_tokens}-token row")
    print(f"{'N':>2} {'split':<10} {'MiB / layer':>11} {'bytes / rank token':>18}")
    for n in [n for n in args.ranks if n > 1]:
        with tempfile.TemporaryDirectory() as d:
            res = run_ranks(partial(_shape_rank, shape=args.shape, tokens=args.shape_tokens), n, Path(d))
        for split in TEACHER_SPLITS:
            r = max(res, key=lambda x: x[split].get("bytes", 0))[split]
            if "refused" in r:
                print(f"{n:>2} {split:<10} refused: {r['refused']}")
                continue
            print(f"{n:>2} {split:<10} {r['bytes'] / 2**20:>11.2f} {r['bytes'] / r['tokens_per_rank']:>18.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
