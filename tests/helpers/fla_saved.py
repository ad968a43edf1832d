"""What fla's chunk functions allocate and save, against the estimator's stand-in (`hylo.kernels.fla_shapes`).

fla's own `chunk_gated_delta_rule` and `chunk_simple_gla` run on small CPU tensors under Triton's interpreter
(the harness of tests/helpers/fla_interpret.py; fla must be imported after TRITON_INTERPRET=1, so this runs in
a fresh process: `python -m tests.helpers.fla_saved --out results.json` from the repository's root), forward and
backward; the stand-in runs on fake tensors of the same shapes. For each, per case: the tensors the autograd
function saves (`saved_tensors_hooks`: shape, dtype, bytes), the tensors the pass creates (every factory op:
`empty`, `zeros`, `*_like`, `new_*`, and the copies and sums that make a new tensor), the outputs and the
gradients. tests/kernels/test_fla_shapes.py compares them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the ops that create a tensor (not a view) in fla's Python code and in the stand-in
CREATES = ("empty", "empty_like", "zeros", "zeros_like", "new_empty", "new_zeros", "empty_strided", "clone",
           "sum", "_to_copy", "contiguous")


def _desc(t: Any) -> list | None:
    import torch

    if not isinstance(t, torch.Tensor):
        return None
    return [list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()]


def trace(run: Callable[[], Any]) -> dict[str, Any]:
    """`run()` gives (inputs, forward, mode): run forward and backward inside `mode` (the fake mode or none),
    recording what the pass saves and creates."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    rec: dict[str, Any] = {"saved": [], "created": {"forward": [], "backward": []}}
    phase = ["forward"]

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ in CREATES and isinstance(out, torch.Tensor):
                rec["created"][phase[0]].append(_desc(out))
            return out

    def pack(t):
        rec["saved"].append(_desc(t))
        return t

    inputs, forward, mode = run()
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Created():
            o, ht = forward()
        rec["outputs"] = [_desc(o), _desc(ht)]
        outs = [x for x in (o, ht) if x is not None]
        cotangents = [torch.ones_like(x) for x in outs]
        phase[0] = "backward"
        with Created():
            grads = torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)
        rec["grads"] = [_desc(g) for g in grads]
    return rec


def cases() -> dict[str, dict[str, Any]]:
    """Small shapes: GDN on a packed row (documents crossing chunks, states in and out), on a batch, at chunk
    size 32; simple GLA (the Mamba-2 scan's call) on a packed row with states, and on a batch."""
    return {
        "gdn/packed": dict(op="gdn", B=1, T=100, H=2, K=32, V=64, cu=[0, 37, 100], states=True, chunk=64),
        "gdn/batch": dict(op="gdn", B=2, T=80, H=2, K=32, V=32, cu=None, states=False, chunk=64),
        "gdn/chunk32": dict(op="gdn", B=1, T=70, H=1, K=16, V=32, cu=[0, 70], states=True, chunk=32),
        "ssd/packed": dict(op="gla", B=1, T=100, H=2, K=16, V=32, cu=[0, 37, 100], states=True, chunk=None, dtype="float16"),
        "ssd/batch": dict(op="gla", B=2, T=70, H=3, K=16, V=16, cu=None, states=False, chunk=None, dtype="float16"),
    }


def make_run(case: dict[str, Any], fn: Callable[..., Any], fake: bool) -> Callable[[], Any]:
    """(inputs needing gradients, forward()) of `case` through `fn` (fla's function or the stand-in's)."""
    import torch

    # bf16 where the interpreter runs it (the GDN kernels); the simple-GLA backward's bf16 it does not
    dt = getattr(torch, case.get("dtype", "bfloat16"))

    def run():
        B, T, H, K, V = (case[k] for k in "BTHKV")
        N = len(case["cu"]) - 1 if case["cu"] else B
        torch.manual_seed(0)

        def t(*shape, dtype=dt, fill=None):
            x = torch.randn(*shape, dtype=torch.float32) if fill is None else fill(shape)
            return x.to(dtype).requires_grad_()

        q, k = t(B, T, H, K), t(B, T, H, K)
        v = t(B, T, H, V)
        g = t(B, T, H, dtype=torch.float32, fill=lambda s: -torch.rand(s) * 0.1)
        h0 = t(N, H, K, V, dtype=torch.float32) if case["states"] else None
        kw: dict[str, Any] = {}
        if case["cu"]:
            kw["cu_seqlens"] = torch.tensor(case["cu"], dtype=torch.long)
            kw["cu_seqlens_cpu"] = torch.tensor(case["cu"], dtype=torch.long)
        if case["op"] == "gdn":
            beta = t(B, T, H, fill=lambda s: torch.rand(s))
            inputs = [q, k, v, g, beta] + ([h0] if h0 is not None else [])

            def forward():
                return fn(q, k, v, g, beta, initial_state=h0, output_final_state=case["states"],
                          use_qk_l2norm_in_kernel=True, chunk_size=case["chunk"], **kw)
        else:
            h0 = h0.transpose(-1, -2).contiguous().detach().requires_grad_() if h0 is not None else None
            inputs = [q, k, v, g] + ([h0] if h0 is not None else [])

            def forward():
                return fn(q, k, v, g=g, scale=1.0, initial_state=h0, output_final_state=case["states"],
                          state_v_first=True, **kw)
        mode: Any = contextlib.nullcontext()
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)
            inputs = [mode.from_tensor(x.detach()).requires_grad_() for x in inputs]
            q, k, v, g = inputs[:4]
            rest = inputs[4:]
            if case["op"] == "gdn":
                beta, rest = rest[0], rest[1:]
            h0 = rest[0] if rest else None
        return inputs, forward, mode

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    from tests.helpers.fla_interpret import install

    install()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla

    from hylo.kernels.fla_shapes import FlaShapes

    stand_in = FlaShapes()
    results: dict[str, Any] = {}
    for name, case in cases().items():
        fla_fn = chunk_gated_delta_rule if case["op"] == "gdn" else chunk_simple_gla
        ours = stand_in.chunk_gated_delta_rule if case["op"] == "gdn" else stand_in.chunk_simple_gla
        results[name] = {"fla": trace(make_run(case, fla_fn, fake=False)),
                         "stand_in": trace(make_run(case, ours, fake=True))}
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
