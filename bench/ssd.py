"""Forward + backward time of the CPU Mamba-2 SSD scan: ours (chunked, torch) against the step-by-step
reference and transformers' torch SSD (`mamba2_chunk_scan`, its fallback when mamba_ssm is missing),
side by side in one run.

    python bench/ssd.py [--lengths 2048 8192] [--repeats 3] [--threads N]

B = 1, fp32, SmolLM2's derived Mamba-2 shape (H = 9 heads, P = N = 64, G = 9 groups), chunk 64 for
both chunked implementations. Each gets one untimed warm-up and the median of `--repeats` timed runs;
the naive reference is timed once and only up to T = 2048 (a Python loop over tokens). A packed row of
4 documents (`cu_seqlens`) is timed for ours too. transformers' inter-chunk step is an [Nc, Nc]
segment-sum matrix (quadratic in the number of chunks); ours is a loop of one multiply-add per chunk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import time_fwd_bwd  # noqa: E402  (bench/ is on sys.path when run as a script)

from hylo.kernels.ssd import naive_ssd  # noqa: E402
from hylo.kernels.ssd.chunk import torch_chunk_ssd  # noqa: E402

H, P, N, G, CHUNK = 9, 64, 64, 9, 64


def make_inputs(T: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, P, generator=gen)
    dt = F.softplus(torch.randn(1, T, H, generator=gen) - 2)
    A = -torch.empty(H).uniform_(1, 16, generator=gen)
    B = torch.randn(1, T, G, N, generator=gen) / N**0.5
    C = torch.randn(1, T, G, N, generator=gen) / N**0.5
    D = torch.ones(H)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


def implementations(T: int):
    out = [("ours (chunked torch)", lambda *a: torch_chunk_ssd(*a, chunk_size=CHUNK)[0], True)]
    bounds = torch.tensor([0, T // 8, T // 2, T // 2 + T // 16, T], dtype=torch.int32)
    out.append(("ours, packed row of 4 docs", lambda *a: torch_chunk_ssd(*a, cu_seqlens=bounds, chunk_size=CHUNK)[0],
                True))
    try:
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan  # optional: mamba2

        out.append(("transformers mamba2_chunk_scan",
                    lambda x, dt, A, B, C, D: mamba2_chunk_scan(x, dt, A, B, C, chunk_size=CHUNK, D=D), True))
    except ImportError:
        print("# transformers' Mamba-2 not importable: skipped")
    if T <= 2048:
        out.append(("naive recurrent (reference)", lambda *a: naive_ssd(*a)[0], False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# SSD fwd+bwd, fp32, B=1, H={H}, P={P}, N={N}, G={G}, chunk {CHUNK}, threads {torch.get_num_threads()}")
    print(f"{'T':>6}  {'implementation':32s} {'fwd s':>8} {'bwd s':>8} {'total s':>8} {'vs ours':>8}")
    for T in args.lengths:
        ours_total = None
        for name, fn, repeat in implementations(T):
            fwd, bwd = time_fwd_bwd(fn, make_inputs(T), args.repeats if repeat else 1, warmup=repeat)
            total = fwd + bwd
            ours_total = ours_total or total
            print(f"{T:>6}  {name:32s} {fwd:8.3f} {bwd:8.3f} {total:8.3f} {total / ours_total:7.1f}x", flush=True)


if __name__ == "__main__":
    main()
