"""The table `hylo estimate` prints: one column per row length, the memory per GPU, the peak and which GPUs it
fits, the FLOPs by phase and by the dtype they run at, and their time at each GPU's dense peak of each dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hylo.pipeline.estimate.gpus import FIT_MARGIN, GIB, GPUS
from hylo.pipeline.estimate.step import Estimate


def format_gib(x: float) -> str:
    return f"{x / GIB:.1f}" if x >= 0.05 * GIB or x == 0 else f"{x / GIB:.2f}"


def format_tokens(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def per_key_lines(keys: list[str], ests: list[Any], value: Callable[[Any, str], float], label_width: int,
                  w: int) -> list[str]:
    """One table line per key: the key, then `value(estimate, key)` of each estimate (one decimal)."""
    return [f"  {k:<{label_width}}" + "".join(f"{value(e, k):>{w}.1f}" for e in ests) for k in keys]


ACTIVATIONS = "activations, temporaries, loss buffers"


def memory_lines(ests: list[Estimate], label_width: int, w: int, indent: str = "  ") -> list[str]:
    """The parts of each column's peak, one line each (they sum to it; ZeRO-3's per-GPU share where sharded), the
    fused loss's buffers under the activations where the peak falls inside the loss (`Estimate.loss_at_peak`)."""
    keys: list[str] = []
    for e in ests:
        keys += [k for k in e.memory if k not in keys]
    L = label_width - len(indent)
    lines = []
    for k in keys:
        vals = [e.memory.get(k, 0.0) for e in ests]
        if not any(vals):
            continue
        lines.append(f"{indent}{k:<{L}}" + "".join(f"{format_gib(v):>{w}}" for v in vals))
        if k == ACTIVATIONS and any(e.loss_at_peak for e in ests):
            lines.append(f"{indent}  {'of which the fused loss (peak inside it)':<{L - 2}}"
                         + "".join(f"{'-' if e.loss_at_peak is None else format_gib(e.loss_at_peak):>{w}}"
                                   for e in ests))
    return lines


def loss_line(ests: list[Estimate], label_width: int, w: int) -> list[str]:
    """The fused loss's own peak, on its own line: a figure beside the peak, not a part of it (the loss runs
    before the peak or after it, except where `memory_lines` shows it under the activations)."""
    if not any(e.loss_chunk_bytes for e in ests):
        return []
    return [f"{'the fused loss alone, its own peak':<{label_width}}"
            + "".join(f"{format_gib(e.loss_chunk_bytes):>{w}}" for e in ests),
            "  (above what was live when it began; not a part of the peak above unless listed under it)"]


def format_table(title: str, ests: list[Estimate]) -> str:
    """One column per length: the memory rows per GPU (the parts of the peak, each indented under what it is a
    part of), the peak, which GPUs it fits, FLOPs and times."""
    cols = [format_tokens(e.tokens) for e in ests]
    w = max(9, *(len(c) + 2 for c in cols))
    lines = [title, f"{'per GPU at the peak (GiB)':<44}" + "".join(f"{c:>{w}}" for c in cols)]
    lines += memory_lines(ests, 44, w)
    lines.append(f"{'peak (the sum of the lines above)':<44}" + "".join(f"{format_gib(e.peak_bytes):>{w}}" for e in ests))
    short = {"forward/backward": "fwd/bwd", "optimizer": "optimizer", "teacher forward": "forward"}
    lines.append(f"{'  reached in':<44}" + "".join(f"{short.get(e.peak_phase, e.peak_phase):>{w}}" for e in ests))
    lines += loss_line(ests, 44, w)
    lines += fits_lines([e.peak_bytes for e in ests], 44, w)
    phases: list[str] = []
    for e in ests:
        phases += [k for k in e.flops if k not in phases]
    lines.append(f"{'FLOPs per row (TFLOP; a step is grad_accum rows)':<44}")
    lines += per_key_lines(phases, ests, lambda e, k: e.flops.get(k, 0) / 1e12, 42, w)
    lines.append(f"  {'total':<42}" + "".join(f"{e.total_flops / 1e12:>{w}.1f}" for e in ests))
    lines += dtype_lines([e.gemm_flops_by_dtype for e in ests], 44, w)
    return "\n".join(lines)


def fits_lines(peaks: list[float], label_width: int, w: int) -> list[str]:
    """Which GPUs each column's peak fits (`GPU.fits`)."""
    lines = [f"fits (peak <= {1 - FIT_MARGIN:.0%} of the memory):"]
    for g in GPUS:
        lines.append(f"  {g.name + f' {g.memory_gib:.0f} GiB':<{label_width - 2}}"
                     + "".join(f"{('yes' if g.fits(p) else 'no'):>{w}}" for p in peaks))
    return lines


CLASS_NAMES = {"bf16": "bf16 (tensor cores)", "fp16": "fp16 (tensor cores)", "tf32": "tf32 (tensor cores)",
               "fp32": "fp32 (vector units)"}


def dtype_lines(by_dtype: list[dict[str, int]], label_width: int, w: int) -> list[str]:
    """The FLOPs of each column by the dtype class they run at (flops.py), the fp32 share where there is
    fp32, and the time at each GPU's dense peak of each class (gpus.py)."""
    L = label_width - 4
    classes: list[str] = []
    for d in by_dtype:
        classes += [k for k in d if k not in classes]
    lines = ["  by the dtype they run at (TFLOP):"]
    lines += [f"    {CLASS_NAMES.get(k, k + ' (no GPU rate: not timed)'):<{L}}"
              + "".join(f"{d.get(k, 0) / 1e12:>{w}.1f}" for d in by_dtype) for k in classes]
    if any(d.get("fp32") for d in by_dtype):
        lines.append(f"    {'fp32 share of the FLOPs':<{L}}"
                     + "".join(f"{d.get('fp32', 0) / max(sum(d.values()), 1):>{w}.1%}" for d in by_dtype))
    lines.append("time at each dtype's dense peak (s, a lower bound):")
    for g in GPUS:
        tf32 = f"{g.tf32_tflops:.0f}" if g.tf32_tflops else "-"
        label = f"{g.name} ({g.bf16_tflops:.0f} / {tf32} / {g.fp32_tflops:.0f})"
        times = [g.time(d) for d in by_dtype]
        lines.append(f"  {label:<{label_width - 2}}" + "".join("n/a".rjust(w) if t is None else f"{t:>{w}.2f}" for t in times))
    lines.append("  (TFLOP/s: bf16 / tf32 / fp32, gpus.py)")
    return lines
