"""Sequence parallelism (one row split over N GPUs) for the shipped recipes: the longest context per GPU at N = 1, 2, 4, 8, the 3B
recipe at 128K on H100s, each recipe on one 8-GPU MI300X node, and the communication per layer (Ulysses against
gathering MLA's latent), from the step estimate (pipeline/estimate/: step.py, sp.py).

    python bench/sp_tables.py --json sp.json        # measure (minutes of CPU per recipe) and print
    python bench/sp_tables.py --from-json sp.json   # print again from the kept measurements
    python bench/sp_tables.py --recipe llama-3.2-3b-14mla14gdn-64k --json 3b.json   # one recipe (one per process)

Per GPU at N, stage 2 as each recipe configures it (bf16, activation checkpointing, top-64 targets from the Serve
pool or the offline cache: the same records on the training GPU), ZeRO-3 over W training GPUs:
* one rank's own step is measured at L = 8K, 16K and 32K tokens (`estimate_step`, fake tensors; the recipe's
  packed documents), at W = 4 (the recipes' stage 2) and W = 8 (a node of training GPUs); from 16K on its peak
  is affine in L (the activations grow by the same GiB per token; at 8K the peak can sit in a fixed term), so
  the peak at L = T / N is the line through the points from `FIT_FROM` on (its largest residual printed);
* plus the extras of the split (`estimate_sp.measure_mla_extra`): one split layer measured on fake tensors
  with torch's fake process group at T = 64K, N = 2, minus the same layer unsplit: the MLA layer's (the last
  rank's keys from the row's start when one document fills the row) scaled by the earlier keys E = T - T / N
  (12.72-12.88 KiB per earlier key from 64K to 256K and N = 2 to 8 for the 3B recipe), the GDN layer's (its
  zero-start, transition and second passes, priced as fla's kernels hold them) by the rank's T / N tokens;
  with checkpointing one layer's backward at a time, so the larger of the two; and the gathered GDN states
  (analytic, a few MiB).
  `hylo estimate --sequence-parallel N` runs the whole split step instead (minutes per point: too slow for a
  search over lengths); at the 3B recipe's 128K over 8 GPUs it gives 31.1 GiB, this model 32.5;
* "longest context": the largest T, a multiple of 1K, whose peak is within 90 % of the GPU's memory (`GPU.fits`),
  searched up to 4M tokens. Above 32K tokens per rank it extrapolates the line.
* with the recipe's teacher in-process (on every training GPU; pipeline/estimate/sp_teacher.py): the larger of
  the rank's step plus the teacher's weights and the teacher's forward on the step's start (kept per W in the
  measurements: `start_bytes`). The forward is measured at 16K and 32K tokens (linear in them) and run whole
  (T tokens, today) or split (T / N tokens, plus one layer's all-gather or all-to-all buffers). Measurements
  kept without `start_bytes` print no such table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.pipeline.estimate import GPUS, estimate_step, shapes_of  # noqa: E402
from hylo.pipeline.estimate.sp import STATES, Dims, communication, extra_memory, measure_mla_extra  # noqa: E402
from hylo.pipeline.estimate.sp_teacher import (  # noqa: E402
    TeacherDims,
    measure_forward,
    transient_buffers,
    ulysses_problem,
)
from hylo.pipeline.train.config import load_stage_config  # noqa: E402

RECIPES = [REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml", REPO / "configs" / "llama-3.2-3b-14mla14gdn-64k.yaml",
           REPO / "configs" / "qwen3-1.7b-7mla21gdn-64k.yaml"]
LOCAL = (8192, 16384, 32768)
# the line is fitted from this many tokens per rank on: with the linear layers priced as fla holds them, the
# 3B recipe's peak at 8K sits in a fixed term (W = 4: 21.8 GiB at 8K, 22.0 at 16K, 29.4 at 32K), and the line
# through 16K and 32K gives the split step measured at 128K over 2 GPUs (39.4 GiB at W = 8) within 0.1 GiB
FIT_FROM = 16384
NS = (1, 2, 4, 8)
WORLDS = (4, 8)
MAX_K = 4096
# the tokens the in-process teacher's forward is measured at (its activations are linear in them)
TEACHER_TOKENS = (16384, 32768)
GIB = 1 << 30


def _configs(path: Path):
    cfg = load_stage_config(2, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shapes = shapes_of(cfg, load_stage_config(1, path))
    return cfg, shapes


def measure(locals_: tuple[int, ...] = LOCAL, recipes: list[Path] = RECIPES) -> dict:
    """Per recipe: the rank's step peak (bytes) at each L and W, and its FLOPs."""
    out: dict = {}
    for path in recipes:
        cfg, shapes = _configs(path)
        rows = []
        for L in locals_:
            t0 = time.perf_counter()
            e = estimate_step(cfg, L, WORLDS[0], torch.bfloat16, gpu=True, shapes=shapes, other_worlds=WORLDS[1:])
            peaks = {WORLDS[0]: e.peak_bytes, **{w: e.peaks_by_world[w] for w in WORLDS[1:]}}
            rows.append({"tokens": L, "peak_bytes": {str(w): p for w, p in peaks.items()}, "flops": e.total_flops,
                         # the states at the step's start per GPU (the in-process teacher's forward sits on them)
                         "start_bytes": {str(w): start_at(e, cfg, w) for w in WORLDS}})
            print(f"[measured] {path.stem} L={L}: " + ", ".join(f"W={w} {p / GIB:.1f} GiB" for w, p in peaks.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        out[path.stem] = rows
    return out


def start_at(e, cfg, W: int) -> float:
    """The step's start per GPU at ZeRO-3 world W from its estimate at e.world_size: the sharded states (parameters,
    fp32 masters, AdamW moments) over W, the gathered parameters and reduce bucket at W (step.estimate_step)."""
    W0 = e.world_size
    states = e.memory["parameters"] + e.memory["optimizer states (fp32 master + AdamW)"]
    zero = e.memory.get("ZeRO-3 gathered parameters + reduce bucket", 0.0)
    el = 2 if e.dtype == "bfloat16" else 4
    bucket = cfg.deepspeed.reduce_bucket_size * el
    gathered = (zero - bucket) / (1 - 1 / W0) * (1 - 1 / W) if W0 > 1 else 0.0
    return e.start_bytes - states - zero + states * W0 / W + (gathered + bucket if W > 1 else 0.0)


def fit(rows: list[dict], W: int) -> tuple[float, float, float]:
    """Least-squares peak = a + b L over the measured L from FIT_FROM on; (a, b, largest residual in bytes)."""
    rows = [r for r in rows if r["tokens"] >= FIT_FROM] or rows
    xs = [r["tokens"] for r in rows]
    ys = [r["peak_bytes"][str(W)] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(a + b * x - y) for x, y in zip(xs, ys))


class Recipe:
    def __init__(self, name: str, rows: list[dict]) -> None:
        self.name = name
        self.cfg, shapes = _configs(REPO / "configs" / f"{name}.yaml")
        self.shapes, self.rows = shapes, rows
        self.hc = shapes.student
        self.ckpt = bool(self.cfg.model.activation_checkpointing)
        self.fits = {W: fit(rows, W) for W in WORLDS}
        self.dtype_bytes = torch.empty((), dtype=torch.bfloat16).element_size()

        # one split MLA layer's extra per earlier key and one split linear layer's per token of the rank
        # (T = 64K, N = 2: 32K earlier keys, 32K tokens a rank)
        self.mla_per_key = measure_mla_extra(self.hc, 65536, 2, torch.bfloat16) / 32768
        self.linear_per_token = measure_mla_extra(self.hc, 65536, 2, torch.bfloat16, kind="linear") / 32768

    def peak(self, T: int, N: int, W: int) -> float:
        a, b, _ = self.fits[W]
        if N == 1:
            return a + b * T
        # with checkpointing one layer's backward at a time: the larger of the two split layers' extras
        layer = max(self.mla_per_key * (T - T // N), self.linear_per_token * T / N)
        return a + b * T / N + layer + extra_memory(self.hc, T, N, self.dtype_bytes, self.ckpt)[STATES]

    def longest(self, N: int, W: int, gpu, peak=None) -> int:
        """Largest T (a multiple of 1K, T / N whole) that fits `gpu`, 0 if none; MAX_K K if all do. `peak(T, N,
        W)`: the peak to fit (default `self.peak`)."""
        peak = peak or self.peak
        best = 0
        for k in range(1, MAX_K + 1):
            T = k * 1024
            if T % N == 0 and gpu.fits(peak(T, N, W)):
                best = T
        return best

    def teacher(self) -> None:
        """The recipe's teacher in-process (on every training GPU): its forward measured at TEACHER_TOKENS (linear
        in the tokens it runs: SDPA's causal kernel), its weights, the step's start per GPU."""
        t_cfg = self.shapes.teacher
        self.td = TeacherDims.of(t_cfg)
        f = [measure_forward(t_cfg, L, torch.bfloat16) for L in TEACHER_TOKENS]
        self.t_weights = f[0].weights
        self.t_slope = (f[1].activations - f[0].activations) / (f[1].tokens - f[0].tokens)
        self.t_base = f[0].activations - self.t_slope * f[0].tokens
        self.starts = {W: self.rows[0]["start_bytes"][str(W)] for W in WORLDS}

    def peak_teacher(self, T: int, N: int, W: int, mode: str) -> float:
        """With the teacher in-process: the larger of the student's step (plus the teacher's weights) and the
        teacher's forward on the step's start (sp_teacher.py), the teacher run `mode`."""
        run = T if mode == "whole" or N == 1 else T // N
        # the scheme's buffers (their analytic bound); run whole, the row's hidden states copied out
        buffers = sum(transient_buffers(self.td, T, N, 2, mode).values()) + (T * self.td.hidden * 2 if run == T else 0)
        forward = self.starts[W] + self.t_weights + self.t_base + self.t_slope * run + buffers
        return max(self.peak(T, N, W) + self.t_weights, forward)


def _k(T: int) -> str:
    if T == 0:
        return "none"
    if T >= MAX_K * 1024:
        return f">= {MAX_K // 1024}M"
    return f"{T // 1024:,}K"


def tables(data: dict) -> str:
    recipes = [Recipe(name, rows) for name, rows in data.items()]
    out = ["Fit of one rank's step peak, a + b L (GiB, GiB per 1K tokens), largest residual over L = "
           + ", ".join(f"{x // 1024}K" for x in LOCAL if x >= FIT_FROM) + "; the split layers' extras (KiB per earlier key, per "
           "token of the rank):", ""]
    out += ["| recipe | W | a | b | residual | MLA extra per earlier key | GDN extra per token |",
            "|---|---|---|---|---|---|---|"]
    for r in recipes:
        for W in WORLDS:
            a, b, res = r.fits[W]
            out.append(f"| {r.name} | {W} | {a / GIB:.2f} | {b * 1024 / GIB:.3f} | {res / GIB:.2f} | "
                       f"{r.mla_per_key / 1024:.1f} | {r.linear_per_token / 1024:.1f} |")

    W = 8
    out += ["", f"Longest context per training GPU (ZeRO-3 over W = {W}; the row split over N GPUs):", ""]
    out += ["| recipe | GPU | " + " | ".join(f"N = {n}" for n in NS) + " |", "|---|---|" + "---|" * len(NS)]
    for r in recipes:
        for i, g in enumerate(GPUS):
            out.append(f"| {r.name if i == 0 else ''} | {g.name} | "
                       + " | ".join(_k(r.longest(n, W, g)) for n in NS) + " |")

    r3 = next((r for r in recipes if "3b" in r.name), recipes[0])
    h100 = next(g for g in GPUS if g.name == "H100")
    T = 131072
    out += ["", f"{r3.name} at 128K per H100 ({h100.memory_gib:.1f} GiB, fits within {0.9 * h100.memory_gib:.1f}):", ""]
    out += ["| N | tokens per GPU | peak, W = 4 | fits | peak, W = 8 | fits |", "|---|---|---|---|---|---|"]
    for n in NS:
        cells = []
        for Wn in WORLDS:
            p = r3.peak(T, n, Wn)
            cells += [f"{p / GIB:.1f} GiB", "yes" if h100.fits(p) else "no"]
        out.append(f"| {n} | {T // n // 1024}K | " + " | ".join(cells) + " |")

    mi = next(g for g in GPUS if g.name == "MI300X")
    out += ["", "One node of 8 MI300X: as the recipes run stage 2 (4 training GPUs beside 4 teacher replicas: "
            "W = 4, N <= 4), and all 8 training with the offline top-k cache (W = 8, N = 8):", ""]
    out += ["| recipe | 4 training + 4 replicas: N = 1 | N = 2 | N = 4 | 8 training (cache): N = 8 |",
            "|---|---|---|---|---|"]
    for r in recipes:
        out.append(f"| {r.name} | " + " | ".join(_k(r.longest(n, 4, mi)) for n in (1, 2, 4))
                   + f" | {_k(r.longest(8, 8, mi))} |")

    with_teacher = [r for r in recipes if "start_bytes" in r.rows[0]]
    if with_teacher:
        W = 8
        out += ["", f"Longest context per training GPU with the recipe's teacher in-process (ZeRO-3 over W = {W}): "
                "the teacher run whole on every GPU (today) / split with the row by the all-gather / by Ulysses:", ""]
        out += ["| recipe (teacher) | GPU | " + " | ".join(f"N = {n}" for n in NS) + " |", "|---|---|" + "---|" * len(NS)]
        for r in with_teacher:
            r.teacher()
            tname = Path(r.cfg.teacher.model.path).name
            for i, g in enumerate(GPUS):
                cells = []
                for n in NS:
                    whole = r.longest(n, W, g, lambda T, N, Wn, r=r: r.peak_teacher(T, N, Wn, "whole"))
                    if n == 1:
                        cells.append(_k(whole))
                        continue
                    split = [r.longest(n, W, g, lambda T, N, Wn, r=r, m=m: r.peak_teacher(T, N, Wn, m))
                             if m == "allgather" or not ulysses_problem(r.td, n) else None
                             for m in ("allgather", "ulysses")]
                    cells.append(" / ".join(_k(x) if x is not None else "n/a" for x in (whole, *split)))
                out.append(f"| {f'{r.name} ({tname})' if i == 0 else ''} | {g.name} | " + " | ".join(cells) + " |")

    out += ["", "Communication per layer and GPU per step (forward, again in the checkpoint's recompute, backward), "
            "MiB, and the group's bytes per token of the row (B/tok, at 64K: the same at any length for MLA's two "
            "schemes, half at 128K for state passing, a fixed amount per step), bf16 activations, fp32 states:", ""]
    out += ["| recipe | layer (count), scheme | N | B/tok | MiB at 64K | MiB at 128K |", "|---|---|---|---|---|---|"]
    for r in recipes:
        d = Dims.of(r.hc)
        counts = {"MLA": d.n_mla, "GDN": d.n_linear, "Mamba-2": d.n_linear}
        first = True
        for n in NS[1:]:
            at = {T: communication(r.hc, T, n, r.dtype_bytes, r.ckpt) for T in (65536, 131072)}
            for i, c in enumerate(at[65536]):
                per = "n/a" if c.note else f"{c.per_row_token:,.0f}"
                mib = ["n/a" if at[T][i].note else f"{at[T][i].total / 2 ** 20:,.1f}" for T in at]
                out.append(f"| {r.name if first else ''} | {c.layer} ({counts[c.layer]}), {c.scheme} | {n} | {per} | "
                           + " | ".join(mib) + " |" + (f" {c.note}" if c.note else ""))
                first = False
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="keep the measurements here")
    p.add_argument("--from-json", type=Path, default=None, nargs="+",
                   help="print from kept measurements (no estimate runs; several files: their recipes together)")
    p.add_argument("--recipe", action="append", default=None, choices=[r.stem for r in RECIPES],
                   help="measure only this recipe (repeatable; default all three)")
    args = p.parse_args()
    if args.from_json:
        data = {}
        for f in args.from_json:
            data.update(json.loads(f.read_text()))
    else:
        data = measure(recipes=[r for r in RECIPES if args.recipe is None or r.stem in args.recipe])
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"bench/sp_tables.py, {datetime.date.today()}, commit {commit}\n")
    print(tables(data))


if __name__ == "__main__":
    main()
