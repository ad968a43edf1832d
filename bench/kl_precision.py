"""Loss and gradient error of the fused losses' precision modes against fp64, on CPU.

    python bench/kl_precision.py                  # bf16 inputs, N=512, H=256, V=4,096 (about 10 s)
    python bench/kl_precision.py --dtype float16  # fp16 inputs

The CPU reproduces the GPU's arithmetic (kernels/fused_kl/gemm.py: a bf16 x bf16 product is exact in fp32;
only the order of the fp32 additions differs), so these are the errors of each mode on a GPU up to that
order. Rows: the dense loss (hidden-state teacher), the top-k loss (k = 16 with a tail) and the
cross-entropy, each in `accurate` and `fast` mode, and `fp32-in`: the same values passed as fp32 (the
arithmetic of the path before tensor cores, which upcast bf16 inputs). Columns: relative errors
||got - ref|| / ||ref|| against the fp64 reference on the same (bf16-valued) inputs: the loss, the
gradients before their final rounding (fp32 accumulators) and as returned (input dtype) against the
fp64 gradient rounded to the input dtype (gpu-check's measure). A quarter of the tokens are masked.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.kernels import fused_kl  # noqa: E402
from hylo.kernels.fused_kl import chunked  # noqa: E402

PATHS = ("dense", "topk", "ce")
MODES = ("accurate", "fast", "fp32-in")


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


def measure(path: str, mode: str, x: dict, ref: tuple | None = None) -> dict[str, float]:
    """Relative errors of one path in one mode: loss, gradients unrounded (fp32) and as returned."""
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
    out["dh_out"] = rel_err(ref[1].to(dtype), dh.to(dtype))
    out["dw_out"] = rel_err(ref[2].to(dtype), dw.to(dtype))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    x = make_inputs(args.n, args.hidden, args.vocab, dtype)
    print(f"{args.dtype} inputs, N={args.n}, H={args.hidden}, V={args.vocab}; relative errors against fp64")
    print(f"{'path':6} {'mode':9} {'loss':>9} {'dh fp32':>9} {'dw fp32':>9} {'dh out':>9} {'dw out':>9}")
    for path in PATHS:
        ref = reference(path, x)
        for mode in MODES:
            e = measure(path, mode, x, ref)
            print(f"{path:6} {mode:9} {e['loss']:9.1e} {e['dh']:9.1e} {e['dw']:9.1e} {e['dh_out']:9.1e} "
                  f"{e['dw_out']:9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
