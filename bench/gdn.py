"""Forward + backward time of the CPU gated delta rule: ours (chunked WY, torch) against the
step-by-step reference and fla's pure-torch `naive_chunk_gated_delta_rule`, side by side.

    python bench/gdn.py [--lengths 1024 4096] [--repeats 3] [--threads N]

B = 1, fp32, inputs shaped as in the GDN layer (L2-normalised q/k inside the op, log-sigmoid
decays, sigmoid betas). Each implementation gets one untimed warm-up and the median of
`--repeats` timed runs, except the naive recurrent reference, which is timed once (it takes
tens of seconds at T = 4096). A packed row of 4 documents (`cu_seqlens`) is timed for ours too.
Targets: ours >= 10x faster than the naive recurrent at T = 4096, and faster than
fla's naive chunk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import time_fwd_bwd  # noqa: E402  (bench/ is on sys.path when run as a script)

from hylo.kernels.gdn import naive_recurrent_gated_delta_rule  # noqa: E402
from hylo.kernels.gdn.chunk import torch_chunk_gated_delta_rule  # noqa: E402

SHAPES = [(9, 64, 64), (4, 128, 256)]


def make_inputs(T: int, H: int, K: int, V: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen))
    beta = torch.rand(1, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def implementations(T: int):
    docs = torch.tensor([0, T // 8, T // 2, (3 * T) // 4, T], dtype=torch.int32)
    impls = {
        "ours (chunked)": lambda q, k, v, g, b: torch_chunk_gated_delta_rule(q, k, v, g, b)[0],
        "ours, 4 packed docs": lambda q, k, v, g, b: torch_chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=docs)[0],
        "naive recurrent": lambda q, k, v, g, b: naive_recurrent_gated_delta_rule(q, k, v, g, b)[0],
    }
    try:
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule  # optional: fla
    except Exception as e:  # optional comparison
        print(f"(fla's naive_chunk_gated_delta_rule not importable: {e})")
    else:
        # fla's chunk reference takes (q, k, v, g, beta) like ours; its recurrent one takes (..., beta, g)
        impls["fla naive_chunk"] = lambda q, k, v, g, b: naive_chunk_gated_delta_rule(q, k, v, g, b)[0]
    return impls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, B=1; times in seconds "
          f"(median of {args.repeats}; naive recurrent timed once)")
    header = f"{'H':>2} {'K':>4} {'V':>4} {'T':>5}  {'implementation':<22} {'fwd':>8} {'bwd':>8} {'total':>8}  {'ours is':>9}"
    print(header)
    print("-" * len(header))
    summary = []
    for H, K, V in SHAPES:
        for T in args.lengths:
            inputs = make_inputs(T, H, K, V)
            results = {}
            for name, fn in implementations(T).items():
                slow = name.startswith("naive")
                results[name] = time_fwd_bwd(fn, inputs, 1 if slow else args.repeats, warmup=not slow)
            ours = sum(results["ours (chunked)"])
            for name, (f, b) in results.items():
                speed = "" if name.startswith("ours") else f"{(f + b) / ours:8.1f}x"
                print(f"{H:>2} {K:>4} {V:>4} {T:>5}  {name:<22} {f:8.3f} {b:8.3f} {f + b:8.3f}  {speed:>9}")
                if not name.startswith("ours"):
                    summary.append((H, K, V, T, name, (f + b) / ours))
            print()
    print("speedup of ours (fwd+bwd) over:")
    for H, K, V, T, name, s in summary:
        print(f"  H={H} K={K} V={V} T={T}: {name}: {s:.1f}x")


if __name__ == "__main__":
    main()
