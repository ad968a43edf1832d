"""One training step of the demo, profiled by op (torch.profiler): where a CPU step's time goes.

    python bench/step_profile.py                      # stage 2, 4,096 tokens, 2 threads
    python bench/step_profile.py --tokens 2048 --top 40 --trace /tmp/step.json

The step is bench/estimate_check.py's: stage 2 of configs/demo-smollm2.yaml (the converted SmolLM2-135M
student, 15 MLA + 15 GDN layers, the in-process teacher, fused KL over hidden states, activation
checkpointing, AdamW), fp32, one packed row, world size 1, `PlainEngine`, random weights, in a process set
up as a CPU training worker is (kernels/backend.keep_freed_host_memory; `HYLO_HOST_MALLOC=system` profiles it
without). One warm-up step, one plain step, then one step under the profiler. Printed:
* the ops by self CPU time (time inside the op itself, not its children), with their call counts;
* the same time grouped into families: matrix products (the part a GEMM rate bounds), element-wise and
  reductions, copies and layout changes, indexing, the rest, and the time outside every aten op (Python,
  the autograd engine's own work): the part of the step that is not matrix products is what a faster
  step has to recover;
* the step's own ranges (`hylo::*` record_function ranges, where the code marks them).
`--trace` writes a Chrome trace to open in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from estimate_check import configs, demo_step  # noqa: E402  (torch-free: its torch imports are lazy)

FAMILIES = {
    "matrix products": ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_scaled_dot_product",
                        "scaled_dot_product", "triangular_solve", "linalg_solve_triangular", "conv"),
    "copies and layout": ("copy_", "clone", "contiguous", "to", "_to_copy", "cat", "stack", "pad",
                          "constant_pad_nd", "transpose", "permute", "view", "reshape", "expand", "t",
                          "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "chunk", "unbind",
                          "as_strided", "empty", "empty_like", "zeros", "zeros_like", "ones", "full", "fill_",
                          "zero_", "new_zeros", "new_empty", "resize_", "detach", "alias", "flatten",
                          "unflatten", "movedim", "_unsafe_view", "lift_fresh", "set_"),
    "indexing": ("index", "index_put_", "index_select", "gather", "scatter", "scatter_add_", "masked_fill",
                 "masked_fill_", "index_add_", "nonzero", "where", "masked_select", "take", "_index_put_impl_",
                 "index_copy_", "masked_scatter_", "embedding", "embedding_dense_backward"),
}


def family(name: str) -> str:
    op = name.removeprefix("aten::")
    for fam, ops in FAMILIES.items():
        if op in ops or any(op.startswith(p) for p in ops if fam == "matrix products"):
            return fam
    return "element-wise, reductions and the rest"


def build(tokens: int, threads: int):
    import torch  # lazy: torch

    torch.set_num_threads(threads)

    from hylo.kernels.backend import keep_freed_host_memory  # lazy: torch
    from hylo.pipeline.estimate import DOC_TOKENS, shapes_of, synthetic_row  # lazy: torch
    from hylo.pipeline.train import stage2  # lazy: torch

    keep_freed_host_memory()  # as a CPU training worker runs (HYLO_HOST_MALLOC=system: malloc as it was)
    cfg, s1 = configs()
    shapes = shapes_of(cfg, s1)
    torch.manual_seed(0)
    task, ctx = demo_step(cfg, shapes)
    row = synthetic_row(tokens, shapes.student.vocab_size, DOC_TOKENS)
    return (lambda: stage2.train_step(task, [row], ctx)), len(row.host) - 1


def product_flops(op: str, shapes: list) -> float:
    """2 x m x n x k of one matrix product from its recorded input shapes (0 where they do not say)."""
    try:
        if op in ("mm", "addmm", "addmm_"):
            a, b = shapes[-2:]
            return 2.0 * a[0] * a[1] * b[1]
        if op in ("bmm", "baddbmm", "baddbmm_"):
            a, b = shapes[-2:]
            return 2.0 * a[0] * a[1] * a[2] * b[2]
    except (IndexError, TypeError, ValueError):
        pass
    return 0.0


def print_shapes(prof, top: int, total: float) -> None:
    """The matrix products grouped by shape: self time, FLOPs, and the rate each shape reached in the step."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        op = e.key.removeprefix("aten::")
        if op not in ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"):
            continue
        flops = product_flops(op, [list(s) for s in e.input_shapes if s]) * e.count
        rows.append((e.self_cpu_time_total, op, e.input_shapes, e.count, flops))
    rows.sort(key=lambda r: -r[0])
    print(f"\n{'product, input shapes':64s} {'calls':>6s} {'self s':>7s} {'share':>6s} {'GFLOP/s':>8s}")
    for us, op, shapes, n, flops in rows[:top]:
        dims = " ".join("x".join(map(str, s)) for s in shapes if s)
        rate = f"{flops / us / 1e3:8.1f}" if flops and us else f"{'-':>8s}"
        print(f"{(op + ' ' + dims)[:64]:64s} {n:6d} {us / 1e6:7.2f} {us / total:6.1%} {rate}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=30, help="ops listed by self CPU time")
    p.add_argument("--trace", type=Path, default=None, help="write a Chrome trace here")
    p.add_argument("--shapes", type=int, default=15,
                   help="matrix-product shapes listed by self time, with the rate each reached")
    args = p.parse_args()

    from torch.profiler import ProfilerActivity, profile  # lazy: torch

    step, docs = build(args.tokens, args.threads)
    t0 = time.perf_counter()
    step()
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()
    plain = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes > 0) as prof:
        t0 = time.perf_counter()
        step()
        profiled = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    print(f"stage-2 step of the demo, {args.tokens} tokens ({docs} documents), fp32, {args.threads} threads: "
          f"warm-up {warm:.1f} s, step {plain:.1f} s, profiled step {profiled:.1f} s")

    avg = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = profiled * 1e6
    by_self = sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\n{'op':44s} {'calls':>8s} {'self s':>8s} {'share':>6s}  family")
    for e in by_self[: args.top]:
        print(f"{e.key:44s} {e.count:8d} {e.self_cpu_time_total / 1e6:8.2f} {e.self_cpu_time_total / total:6.1%}  "
              f"{family(e.key)}")
    fams: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in avg:
        f = fams[family(e.key)]
        f[0] += e.self_cpu_time_total
        f[1] += e.count
    in_ops = sum(f[0] for f in fams.values())
    print(f"\n{'family':44s} {'calls':>8s} {'self s':>8s} {'share':>6s}")
    for name, (us, n) in sorted(fams.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:44s} {n:8d} {us / 1e6:8.2f} {us / total:6.1%}")
    print(f"{'outside every aten op (Python, autograd)':44s} {'':8s} {(total - in_ops) / 1e6:8.2f} "
          f"{(total - in_ops) / total:6.1%}")
    if args.shapes:
        print_shapes(prof, args.shapes, total)
    ranges = [e for e in prof.key_averages() if not e.key.startswith("aten::") and "::" in e.key
              and not e.key.startswith(("autograd::", "torch::autograd"))]
    if ranges:
        print(f"\n{'range':44s} {'calls':>8s} {'total s':>8s} {'share':>6s}")
        for e in sorted(ranges, key=lambda e: -e.cpu_time_total)[:20]:
            print(f"{e.key[:44]:44s} {e.count:8d} {e.cpu_time_total / 1e6:8.2f} {e.cpu_time_total / total:6.1%}")


if __name__ == "__main__":
    main()
