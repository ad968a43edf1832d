"""Each precision mode of the fused losses: its error against fp64 on CPU, and what it costs in the step.

    python bench/kl_precision.py                  # errors (bf16, N=512, H=256, V=4,096, ~10 s), then each
                                                  # mode's cost in the three 64K recipes' step (~7 min)
    python bench/kl_precision.py --tokens 4096    # the step's cost at 4,096-token rows (~2 min)
    python bench/kl_precision.py --no-step        # errors and the rule's choice only
    python bench/kl_precision.py --dtype float16  # fp16 inputs

The CPU reproduces the GPU's arithmetic (kernels/fused_kl/gemm.py: a bf16 x bf16 product is exact in fp32;
only the order of the fp32 additions differs), so these are the errors of each mode on a GPU up to that
order. Rows: the dense loss (hidden-state teacher), the top-k loss (k = 16 with a tail) and the
cross-entropy, each in `accurate` and `fast` mode; `fp32-in`: the same values passed as fp32 (the
arithmetic of the path before tensor cores, which upcast bf16 inputs); `cast`: the fp64 gradient itself
rounded to the input dtype (the error any gradient of that dtype has). A quarter of the tokens are masked.
Columns: relative errors ||got - ref|| / ||ref|| against the fp64 reference on the same (bf16-valued)
inputs: the loss; the gradients before their final cast (fp32 accumulators) and after it (as returned,
input dtype), both against the true fp64 gradient, and after it as a multiple of `cast`'s error; and as
returned against the fp64 gradient rounded to the input dtype (gpu-check's measure).

The rule (`choose`): the default is the cheapest mode whose gradients, as returned, are within `RULE_FACTOR`
(2x, one bit of the significand) of the cast's own error, on every path. The caller only ever sees the
gradient after the cast. The cost of a mode is the fused loss's FLOPs as the step estimate prices them
(pipeline/estimate: fake tensors, FlopCounterMode's formulas, the GPU's chunking): `loss_flops` for the
fused top-k loss alone, `step_flops` for a recipe's whole training step (`estimate_step`, the training GPU's
step of `hylo estimate` without its teacher replica or advice).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.kernels import fused_kl  # noqa: E402
from hylo.kernels.fused_kl import chunked  # noqa: E402
from hylo.logs import get_logger  # noqa: E402

logger = get_logger("bench.kl_precision")

PATHS = ("dense", "topk", "ce")
MODES = ("accurate", "fast", "fp32-in")
# the modes a config chooses between (hylo.kernels.fused_kl.gemm.PRECISIONS)
CHOICES = ("accurate", "fast")
# a mode qualifies when its returned gradients are within this multiple of the cast's own error: one bit of
# the significand (bf16 keeps 8, fp16 11)
RULE_FACTOR = 2.0
# the recipes whose step prices each mode (configs/)
RECIPES = ("llama-3.2-1b-8mla8gdn-64k", "llama-3.2-3b-14mla14gdn-64k", "qwen3-1.7b-7mla21gdn-64k")


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double().flatten(), got.detach().double().flatten()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-300))


@contextlib.contextmanager
def unrounded_gradients() -> Iterator[list[torch.Tensor]]:
    """The fused op's gradients before their final cast to the input dtype (its fp32 accumulators), in the
    order it casts them (hidden, weight): autograd would cast a gradient to its input's dtype anyway."""
    original, seen = chunked._cast, []

    def keep(grad, like):
        if grad is not None:
            seen.append(grad.clone())
        return original(grad, like)

    chunked._cast = keep
    try:
        yield seen
    finally:
        chunked._cast = original


def make_inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Inputs of `dtype` (student logits of std ~2, a teacher of its own), the top-k record and the labels."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 2 * hidden ** -0.5).to(dtype)
    th = torch.randn(n, hidden, generator=g).to(dtype)
    tw = (torch.randn(vocab, hidden, generator=g) * 2 * hidden ** -0.5).to(dtype)
    mask = torch.rand(n, generator=g) > 0.25
    rec = fused_kl.topk_from_logits(th.double() @ tw.double().t(), 16, dtype=torch.float32)
    labels = torch.randint(0, vocab, (n,), generator=g)
    return {"h": h, "w": w, "th": th, "tw": tw, "mask": mask, "topk": rec, "labels": labels}


def _loss(path: str, x: dict, h: torch.Tensor, w: torch.Tensor, precision: str | None) -> torch.Tensor:
    """The fused op (precision given) or its fp64 reference (precision None) of `path` on (h, w)."""
    if path == "ce":
        if precision is None:
            return fused_kl.naive_cross_entropy(h, w, x["labels"], mask=x["mask"])
        return fused_kl.fused_linear_cross_entropy(h, w, x["labels"], mask=x["mask"], precision=precision)
    teacher = ({"teacher_topk": x["topk"]} if path == "topk"
               else {"teacher_hidden": x["th"].to(h.dtype), "teacher_weight": x["tw"].to(h.dtype)})
    if precision is None:
        return fused_kl.naive_kl_div(h, w, mask=x["mask"], **teacher)
    return fused_kl.fused_linear_kl_div(h, w, mask=x["mask"], chunk_size=64, precision=precision, **teacher)


def reference(path: str, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 loss and gradients on the inputs' values."""
    h, w = (x[k].double().requires_grad_() for k in ("h", "w"))
    loss = _loss(path, x, h, w, None)
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def cast_error(ref: tuple, dtype: torch.dtype) -> dict[str, float]:
    """The error of the fp64 gradients rounded to `dtype`: what the final cast alone costs any mode."""
    return {"dh": rel_err(ref[1], ref[1].to(dtype)), "dw": rel_err(ref[2], ref[2].to(dtype))}


def measure(path: str, mode: str, x: dict, ref: tuple | None = None) -> dict[str, float]:
    """Relative errors of one path in one mode: the loss; the gradients before the final cast (`dh`, `dw`,
    fp32) and after it (`dh_true`, `dw_true`), both against the true fp64 gradient; and after it against
    the fp64 gradient rounded to the input dtype (`dh_out`, `dw_out`, gpu-check's measure)."""
    ref = reference(path, x) if ref is None else ref
    dtype = x["h"].dtype
    ins = dtype if mode != "fp32-in" else torch.float32
    precision = mode if mode != "fp32-in" else "accurate"
    out = {}
    h, w = (x[k].to(ins).requires_grad_() for k in ("h", "w"))
    with unrounded_gradients() as seen:
        loss = _loss(path, x, h, w, precision)
        dh, dw = torch.autograd.grad(loss, [h, w])
    out["loss"] = rel_err(ref[0], loss)
    out["dh"], out["dw"] = rel_err(ref[1], seen[0]), rel_err(ref[2], seen[1])
    # as a caller receives them (an fp32-in caller would cast them to the student's dtype as well)
    dh, dw = dh.to(dtype), dw.to(dtype)
    out["dh_true"], out["dw_true"] = rel_err(ref[1], dh), rel_err(ref[2], dw)
    out["dh_out"], out["dw_out"] = rel_err(ref[1].to(dtype), dh), rel_err(ref[2].to(dtype), dw)
    return out


def cast_multiple(e: dict[str, float], cast: dict[str, float]) -> float:
    """The larger of the two returned gradients' errors as a multiple of the cast's own error."""
    return max(e["dh_true"] / cast["dh"], e["dw_true"] / cast["dw"])


def choose(multiples: dict[str, float], cost: dict[str, float], factor: float = RULE_FACTOR) -> str:
    """The rule: the cheapest mode whose returned gradients are within `factor` of the cast's own error
    (`multiples`: each mode's worst `cast_multiple` over the paths); where none is, the most accurate."""
    within = [m for m in multiples if multiples[m] <= factor]
    if not within:
        return min(multiples, key=multiples.__getitem__)
    return min(within, key=cost.__getitem__)


def loss_flops(mode: str, tokens: int, hidden: int, vocab: int, k: int = 64) -> int:
    """FLOPs of the fused top-k KL (the recipes' teacher: top-k + tail from the Serve pool) forward and
    backward on `tokens` bf16 rows, as the step estimate prices it: fake tensors, its FLOP formulas, a GPU's
    chunk size."""
    from hylo.kernels.fused_kl.inputs import deferred_checks
    from hylo.pipeline.estimate.fake import fake_tensors, flop_registry
    from hylo.pipeline.estimate.step import gpu_chunk_size

    with fake_tensors(gpu=True) as host, deferred_checks():
        host.flop_registry = flop_registry()
        h = torch.empty(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        rec = fused_kl.TeacherTopK(torch.empty(tokens, k, dtype=torch.bfloat16),
                                   torch.zeros(tokens, k, dtype=torch.int32), torch.empty(tokens))
        loss = fused_kl.fused_linear_kl_div(h, w, teacher_topk=rec, precision=mode,
                                            chunk_size=gpu_chunk_size(tokens, vocab))
        torch.autograd.grad(loss, [h, w])
    return host.flops


def step_estimate(recipe: str, mode: str, tokens: int) -> Any:
    """One training step of `configs/<recipe>.yaml` in `mode` (`estimate_step` on fake tensors under the
    GPU's rules, as `hylo estimate` measures the training GPU): its FLOPs by phase and dtype, its peak."""
    from hylo.pipeline.estimate.shapes import conversion_for_student, shapes_of
    from hylo.pipeline.estimate.step import estimate_step
    from hylo.pipeline.train.config import load_stage_config

    path = str(REPO / "configs" / f"{recipe}.yaml")
    overrides = [f"kd.kl_precision={mode}"]
    cfg = load_stage_config(2, path, overrides)
    stage1 = conversion_for_student(cfg, path, overrides)
    return estimate_step(cfg, tokens, None, torch.bfloat16, gpu=True, shapes=shapes_of(cfg, stage1), stage1=stage1)


def error_table(x: dict) -> tuple[list[str], dict[str, float]]:
    """The error table's lines and each config mode's worst multiple of the cast's error over the paths."""
    dtype = x["h"].dtype
    lines = [f"{'':16} {'':>9}  {'before the cast':^19}  {'after the cast, vs fp64':^29}  "
             f"{'vs fp64 rounded':^19}",
             f"{'path':6} {'mode':9} {'loss':>9}  {'dh':>9} {'dw':>9}  {'dh':>9} {'dw':>9} {'x cast':>9}  "
             f"{'dh':>9} {'dw':>9}"]
    worst = dict.fromkeys(CHOICES, 0.0)
    for path in PATHS:
        ref = reference(path, x)
        cast = cast_error(ref, dtype)
        for mode in MODES:
            e = measure(path, mode, x, ref)
            m = cast_multiple(e, cast)
            if mode in worst:
                worst[mode] = max(worst[mode], m)
            lines.append(f"{path:6} {mode:9} {e['loss']:9.1e}  {e['dh']:9.1e} {e['dw']:9.1e}  {e['dh_true']:9.1e} "
                         f"{e['dw_true']:9.1e} {m:8.2f}x  {e['dh_out']:9.1e} {e['dw_out']:9.1e}")
        lines.append(f"{path:6} {'cast':9} {'':9}  {'':9} {'':9}  {cast['dh']:9.1e} {cast['dw']:9.1e} "
                     f"{1:8.2f}x".rstrip())
    return lines, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=65536, help="row length of the recipes' step (default 65,536)")
    ap.add_argument("--no-step", action="store_true", help="skip the recipes' step (its ~7 min)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    x = make_inputs(args.n, args.hidden, args.vocab, dtype)
    print(f"{args.dtype} inputs, N={args.n}, H={args.hidden}, V={args.vocab}; relative errors against fp64")
    lines, worst = error_table(x)
    print("\n".join(lines))
    cost = {m: loss_flops(m, args.n, args.hidden, args.vocab, k=16) for m in CHOICES}
    chosen = choose(worst, cost)
    print(f"\nthe rule: the cheapest mode whose returned gradients are within {RULE_FACTOR:g}x the cast's own "
          f"error on every path")
    for m in CHOICES:
        nvh = cost[m] / (args.n * args.vocab * args.hidden)
        print(f"  {m:9} worst {worst[m]:.2f}x the cast's error; the fused top-k loss: {nvh:.0f} N V H FLOPs")
    print(f"  chosen: {chosen}")
    if args.no_step:
        return 0
    from hylo.pipeline.estimate.gpus import GPUS
    from hylo.pipeline.estimate.step import dtype_totals

    gpus = {g.name: g for g in GPUS}
    print(f"\nthe training step of each recipe at {args.tokens:,} tokens (estimate_step: bf16, GPU rules), TFLOP a "
          f"row; its lower bound (each dtype at its dense peak)")
    print(f"{'recipe':28} {'mode':9} {'fused loss':>10} {'step':>8} {'loss share':>10} {'accurate adds':>15} "
          f"{'peak GiB':>8} {'H100 s':>7} {'MI300X s':>8}")
    for recipe in RECIPES:
        ests = {}
        for m in CHOICES:
            logger.info(f"pricing {recipe} in {m} mode at {args.tokens:,} tokens")
            ests[m] = step_estimate(recipe, m, args.tokens)
        fast_total = sum(ests["fast"].flops.values())
        for m, e in ests.items():
            f, total = e.flops["fused loss"], sum(e.flops.values())
            extra = total - fast_total
            adds = f"+{extra / 1e12:.1f} ({extra / total:.1%})" if m == "accurate" else ""
            by_dtype = dtype_totals(e.flops_by_dtype)
            print(f"{recipe:28} {m:9} {f / 1e12:10.1f} {total / 1e12:8.1f} {f / total:10.1%} {adds:>15} "
                  f"{e.peak_bytes / 2**30:8.1f} {gpus['H100'].time(by_dtype):7.2f} {gpus['MI300X'].time(by_dtype):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
