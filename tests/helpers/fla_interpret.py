"""The GPU branch on CPU: fla's Triton kernels (and the fused KL's) run through Triton's interpreter.

Our calls into flash-linear-attention (`kernels/gdn/chunk.py`, `kernels/ssd/chunk.py`) and the model's
GPU branch are checked on CPU tensors here, against the torch branch. Two things stop fla's kernels
under `TRITON_INTERPRET=1`; both are patched in this harness, in Triton's interpreter and autotuner,
never in fla:

* the autotuner benchmarks every config, which needs a GPU driver ("0 active drivers"): here it keeps
  the first config of each kernel (`Autotuner.prune_configs`), and the timing of that one config is not
  measured (`Autotuner._bench`; Triton 3.7 times even a single config, 3.9 does not);
* inside a compiled kernel the index of a `for ... in range(n)` / `tl.range(n)` loop is an int32 tensor,
  and fla calls `.to(tl.int64)` on it; the interpreter hands out Python ints. Here the interpreter's
  source rewrite (`FunctionRewriter.ast_transformer`) also wraps those loops so that the index is an
  interpreter tensor, as compiled (`tl.static_range` loops stay Python ints, as compiled).

fla decorates its kernels when it is imported, so TRITON_INTERPRET=1 must be set before that: the checks
run in a fresh process (`python -m tests.helpers.fla_interpret --out results.json` from the repository's
root, what `tests/kernels/test_gpu_branch_cpu.py` starts) with `hylo.kernels.backend.forced_mode("gpu")`
(every GPU branch on CPU tensors) against `forced_mode("torch")`. In the GPU branch the torch ops are replaced by ones that
raise, so a case cannot pass by falling back to the torch path.

Cases: every fla call site (GDN `chunk_gated_delta_rule`, SSD `chunk_simple_gla`) forward and backward
(every input's gradient, the initial state's included) on batches and on packed rows whose documents
cross chunk boundaries, with and without initial/final states, and decoding (T = 1 with a state through the
chunk op; a prefill then single-token steps through the recurrent op, fla's `fused_recurrent_*`); then a
tiny HyLo model (MLA + GDN, MLA + Mamba-2): forward and every gradient on a packed row, cached decoding
(a prefill, then single-token steps through fla's recurrent kernels: a chunk kernel at T = 1 fails the case),
and one stage-2 step (`pipeline/train/stage2.train_step` with `PlainEngine`, the fused KL's Triton
kernels interpreted).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4  # relative error (norm of the difference / norm of the reference), fp32 vs fp64
# AdamW's first step divides each gradient by its own magnitude, so rounding-level differences in
# near-zero gradients reach the update itself (measured 4e-5 here); the parameters after it are at 1e-8
UPDATE_TOL = 1e-3


# ------------------------------------------------------------------------------------ the harness
def install() -> None:
    """Patch Triton's autotuner and interpreter so that fla's kernels run on CPU (idempotent)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before importing triton or fla")
    if any(m == "fla" or m.startswith("fla.") for m in sys.modules):
        raise RuntimeError("fla was imported before the interpreter harness: its kernels are not interpreted")
    from triton.runtime import autotuner, interpreter

    if getattr(autotuner.Autotuner.prune_configs, "_hylo_first_config", False):
        return
    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    def untimed(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]

    first_config._hylo_first_config = True
    autotuner.Autotuner.prune_configs = first_config
    autotuner.Autotuner._bench = untimed

    def tensor_indices(it):
        for i in it:
            yield interpreter.interpreter_semantic.to_tensor(i, False)

    class LoopIndexTensors(interpreter.ASTTransformer):
        def visit_For(self, node: ast.For) -> ast.For:
            node = self.generic_visit(node)
            f = node.iter.func if isinstance(node.iter, ast.Call) else None
            if (isinstance(f, ast.Name) and f.id == "range") or (isinstance(f, ast.Attribute) and f.attr == "range"):
                node.iter = ast.Call(func=ast.Name(id="_hylo_tensor_indices", ctx=ast.Load()), args=[node.iter],
                                     keywords=[])
            return node

    # the rewritten kernels run with the interpreter module's globals added to theirs
    interpreter._hylo_tensor_indices = tensor_indices
    interpreter.FunctionRewriter.ast_transformer = LoopIndexTensors()


@contextlib.contextmanager
def gpu_branch() -> Iterator[None]:
    """Every GPU branch on CPU tensors, with the torch ops it replaces made to raise."""
    import hylo.kernels.fused_kl.chunked as chunked
    import hylo.kernels.gdn.chunk as gdn_chunk
    import hylo.kernels.ssd.chunk as ssd_chunk
    from hylo.kernels.backend import forced_mode

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a torch op ran on the GPU branch")

    import hylo.kernels.gdn.recurrent as gdn_recurrent
    import hylo.kernels.ssd.recurrent as ssd_recurrent

    targets = [(gdn_chunk, "torch_chunk_gated_delta_rule"), (ssd_chunk, "torch_chunk_ssd"),
               (gdn_recurrent, "torch_recurrent_gated_delta_rule"), (ssd_recurrent, "torch_recurrent_ssd"),
               (chunked, "dense_kl_step_torch"), (chunked, "topk_kl_step_torch")]
    saved = [getattr(m, n) for m, n in targets]
    for m, n in targets:
        setattr(m, n, forbidden)
    try:
        with forced_mode("gpu"):
            yield
    finally:
        for (m, n), v in zip(targets, saved):
            setattr(m, n, v)


FLA_ENTRIES = (("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
               ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
               ("fla.ops.simple_gla", "chunk_simple_gla"), ("fla.ops.simple_gla", "fused_recurrent_simple_gla"))


@contextlib.contextmanager
def fla_calls() -> Iterator[list[tuple[str, int]]]:
    """Records (fla function, T) of every call our code makes into fla's GDN / simple-GLA entry points (our call
    sites import them from these modules at call time)."""
    calls: list[tuple[str, int]] = []
    saved = []
    for mod_name, fn_name in FLA_ENTRIES:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)
        saved.append((mod, fn_name, fn))

        def recorded(q: Any, *args: Any, _fn: Any = fn, _name: str = fn_name, **kwargs: Any) -> Any:
            calls.append((_name, int(q.shape[1])))
            return _fn(q, *args, **kwargs)

        setattr(mod, fn_name, recorded)
    try:
        yield calls
    finally:
        for mod, fn_name, fn in saved:
            setattr(mod, fn_name, fn)


def check_decode_kernels(calls: list[tuple[str, int]]) -> dict[str, Any]:
    """Single-token steps went to fla's recurrent kernels, never to a chunk kernel at T = 1."""
    chunk_t1 = [c for c in calls if c[1] == 1 and not c[0].startswith("fused_recurrent")]
    recurrent = [c for c in calls if c[0].startswith("fused_recurrent")]
    if chunk_t1 or not recurrent:
        raise AssertionError(f"single-token steps must use fla's recurrent kernels; fla calls (name, T): {calls}")
    return {"fla calls (name, T)": sorted(set(calls))}


def rel_err(ref: Any, out: Any) -> float:

    ref, out = ref.detach().double(), out.detach().double()
    if ref.shape != out.shape:
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def tolerance(rec: dict[str, Any], key: str) -> float:
    return rec.get("tol", {}).get(key, TOL)


def compare(ref: dict[str, Any], out: dict[str, Any]) -> dict[str, float]:
    return {k: rel_err(ref[k], out[k]) for k in ref}


# ------------------------------------------------------------------------------------ op cases
def gdn_inputs(B: int, T: int, N: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    H, K, V = 2, 16, 32
    return {"q": torch.randn(B, T, H, K, generator=g), "k": torch.randn(B, T, H, K, generator=g),
            "v": torch.randn(B, T, H, V, generator=g), "g": F.logsigmoid(torch.randn(B, T, H, generator=g) + 2),
            "beta": torch.rand(B, T, H, generator=g), "h0": torch.randn(N, H, K, V, generator=g) * 0.5}


def ssd_inputs(B: int, T: int, N: int, seed: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    H, P, G, S = 4, 8, 2, 16
    return {"x": torch.randn(B, T, H, P, generator=g), "dt": F.softplus(torch.randn(B, T, H, generator=g) - 1),
            "A": -torch.rand(H, generator=g) - 0.2, "B": torch.randn(B, T, G, S, generator=g),
            "C": torch.randn(B, T, G, S, generator=g), "D": torch.randn(H, generator=g),
            "h0": torch.randn(N, H, P, S, generator=g) * 0.5}


def run_op(op: str, inputs: dict[str, Any], cu: list[int] | None, states: bool, chunk_size: int,
           dtype: Any) -> dict[str, Any]:
    """Our call site (`chunk_gated_delta_rule` / `chunk_ssd`), forward and backward: outputs and grads."""
    import torch

    from hylo.kernels.gdn import chunk_gated_delta_rule
    from hylo.kernels.ssd import chunk_ssd

    leaves = {k: v.to(dtype).requires_grad_() for k, v in inputs.items() if states or k != "h0"}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    h0 = leaves.get("h0")
    if op == "gdn":
        o, ht = chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                       initial_state=h0, output_final_state=states, cu_seqlens=cu_t,
                                       use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    else:
        o, ht = chunk_ssd(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], leaves["D"],
                          initial_state=h0, output_final_state=states, cu_seqlens=cu_t, chunk_size=chunk_size)
    gen = torch.Generator().manual_seed(99)
    loss = (o * torch.randn(o.shape, generator=gen).to(dtype)).sum()
    res = {"out": o}
    if states:
        assert ht is not None
        loss = loss + (ht * torch.randn(ht.shape, generator=gen).to(dtype)).sum()
        res["final_state"] = ht
    loss.backward()
    res.update({f"d{k}": v.grad for k, v in leaves.items()})
    return res


OP_CASES: dict[str, dict[str, Any]] = {}


def op_case(name: str, op: str, B: int, T: int, cu: list[int] | None, states: bool, chunk_size: int = 64,
            site: str = "") -> None:
    OP_CASES[name] = {"op": op, "B": B, "T": T, "cu": cu, "states": states, "chunk_size": chunk_size,
                      "site": site}


for _op, _site in (("gdn", "kernels/gdn/chunk.py chunk_gated_delta_rule -> fla chunk_gated_delta_rule"),
                   ("ssd", "kernels/ssd/chunk.py fla_chunk_ssd -> fla chunk_simple_gla")):
    # two sequences of 63 tokens, states in and out
    op_case(f"{_op}/batch/states", _op, 2, 63, None, True, site=_site)
    # a packed row of 3 documents, the middle one crossing the 64-token chunk boundary, and 16-token
    # chunks (many boundaries) for GDN
    op_case(f"{_op}/packed/states", _op, 1, 100, [0, 37, 90, 100], True, 16 if _op == "gdn" else 64, site=_site)
    op_case(f"{_op}/packed/no-states", _op, 1, 100, [0, 5, 70, 100], False, site=_site)
    # decoding: one token per sequence, from a state (what the layer does with a cache)
    op_case(f"{_op}/decode/states", _op, 3, 1, None, True, site=_site)
# decoding as a layer with a cache does it: a prefill, then single-token steps through the recurrent op
for _op, _site in (("gdn", "kernels/gdn/recurrent.py recurrent_gated_delta_rule -> fla fused_recurrent_gated_delta_rule"),
                   ("ssd", "kernels/ssd/recurrent.py fla_recurrent_ssd -> fla fused_recurrent_simple_gla")):
    op_case(f"{_op}/decode/prefill+4-steps", _op, 2, 24, None, True, site=_site)
    OP_CASES[f"{_op}/decode/prefill+4-steps"]["prefill"] = 20
# a chunk size fla's GDN kernel does not take (16, 32, 64 only): the call site passes fla one it takes
op_case("gdn/batch/chunk_size=128", "gdn", 2, 63, None, True, 128,
        site="kernels/gdn/chunk.py chunk_gated_delta_rule -> fla chunk_gated_delta_rule")


def run_decode_op(op: str, inputs: dict[str, Any], prefill: int, dtype: Any) -> dict[str, Any]:
    """A prefill through the chunk op, then one token at a time through the recurrent op (what a layer with a
    cache does), each step from the previous state: every output and the state after the last step."""
    import torch

    from hylo.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
    from hylo.kernels.ssd import chunk_ssd, recurrent_ssd

    x = {k: v.to(dtype) for k, v in inputs.items()}
    per_token = ("q", "k", "v", "g", "beta") if op == "gdn" else ("x", "dt", "B", "C")
    T = x[per_token[0]].shape[1]
    state, outs = x["h0"], []
    for s, e in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
        p = {k: (v[:, s:e] if k in per_token else v) for k, v in x.items()}
        if op == "gdn":
            fn = chunk_gated_delta_rule if e - s > 1 else recurrent_gated_delta_rule
            o, state = fn(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        else:
            fn = chunk_ssd if e - s > 1 else recurrent_ssd
            o, state = fn(p["x"], p["dt"], p["A"], p["B"], p["C"], p["D"], initial_state=state,
                          output_final_state=True)
        outs.append(o)
    return {"prefill out": outs[0], "decoded out": torch.cat(outs[1:], 1), "final_state": state}


def check_decode_op(name: str) -> dict[str, Any]:
    import torch

    from hylo.kernels.backend import forced_mode

    c = OP_CASES[name]
    inputs = (gdn_inputs if c["op"] == "gdn" else ssd_inputs)(c["B"], c["T"], c["B"], seed=len(name))
    with forced_mode("torch"):
        ref = run_decode_op(c["op"], inputs, c["prefill"], torch.float64)
    with gpu_branch(), fla_calls() as calls:
        out = run_decode_op(c["op"], inputs, c["prefill"], torch.float32)
    return {"site": c["site"], "packed": False, "states": True, "T": c["T"], "cu_seqlens": None,
            "chunk_size": c["chunk_size"], "directions": ["forward"], "checked": "interpreter",
            "rel_err": compare(ref, out), **check_decode_kernels(calls),
            "note": f"prefill {c['prefill']} tokens (chunk op), then {c['T'] - c['prefill']} single-token steps "
                    "(recurrent op), each from the previous step's state"}


def check_op(name: str) -> dict[str, Any]:
    import torch

    from hylo.kernels.backend import forced_mode

    c = OP_CASES[name]
    if c.get("prefill"):
        return check_decode_op(name)
    n = c["B"] if c["cu"] is None else len(c["cu"]) - 1
    inputs = (gdn_inputs if c["op"] == "gdn" else ssd_inputs)(c["B"], c["T"], n, seed=len(name))
    with forced_mode("torch"):
        ref = run_op(c["op"], inputs, c["cu"], c["states"], c["chunk_size"], torch.float64)
    with gpu_branch():
        out = run_op(c["op"], inputs, c["cu"], c["states"], c["chunk_size"], torch.float32)
    return {"site": c["site"], "packed": c["cu"] is not None, "states": c["states"], "T": c["T"],
            "cu_seqlens": c["cu"], "chunk_size": c["chunk_size"], "directions": ["forward", "backward"],
            "checked": "interpreter", "rel_err": compare(ref, out)}


# ------------------------------------------------------------------------------------ model cases
def gpu_check_module() -> Any:
    """bench/gpu_check.py's tiny configurations and stage-2 task (the same student the GPU check builds)."""
    name = "hylo_bench_gpu_check"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def tiny_student(variant: str) -> Any:
    import torch

    from hylo.modeling import HyLoForCausalLM

    gc = gpu_check_module()
    torch.manual_seed(0)
    model = HyLoForCausalLM(gc.hylo_config(variant, True)).float()
    kinds = {model.config.layer_type(i) for i in range(model.config.n_layer)}
    assert kinds == {"mla", "gdn" if variant == "8mla8gdn" else "mamba2"}, kinds
    return model


def model_fwd_bwd(model: Any, cu: list[int]) -> dict[str, Any]:
    import torch

    from hylo.kernels.varlen import DocBounds

    T = cu[-1]
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(5))
    model.zero_grad(set_to_none=True)
    bounds = DocBounds.from_host(cu, T, "cpu")
    logits = model(input_ids=ids, position_ids=bounds.positions[None], cu_seqlens=bounds).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    res = {"logits": logits}
    res.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.requires_grad})
    missing = [n for n, g in res.items() if g is None]
    assert not missing, f"no gradient for {missing[:5]}"
    return res


def check_model(variant: str) -> dict[str, Any]:
    import copy

    import torch

    from hylo.kernels.backend import forced_mode

    model = tiny_student(variant)
    cu = [0, 37, 90, 100]
    ref_model = copy.deepcopy(model).double()
    with forced_mode("torch"):
        ref = model_fwd_bwd(ref_model, cu)
    with gpu_branch():
        out = model_fwd_bwd(model, cu)
    errs = compare(ref, out)
    worst = max(errs, key=errs.get)
    return {"checked": "interpreter", "packed": True, "cu_seqlens": cu, "directions": ["forward", "backward"],
            "n_gradients": len(errs) - 1, "rel_err": {"logits": errs["logits"], "worst gradient": errs[worst]},
            "worst": worst, "layers": sorted({model.config.layer_type(i) for i in range(model.config.n_layer)}),
            "torch_dtype": str(torch.float64)}


def model_decode(model: Any) -> dict[str, Any]:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache()
    out = model(input_ids=ids[:, :6], cache=cache, use_cache=True)
    steps = [out.logits[:, -1]]
    for t in range(6, 9):
        out = model(input_ids=ids[:, t:t + 1], cache=out.cache, use_cache=True)
        steps.append(out.logits[:, -1])
    return {"prefill logits": steps[0], "decoded logits": torch.stack(steps[1:], 1)}


def check_decode(variant: str) -> dict[str, Any]:
    import copy

    import torch

    from hylo.kernels.backend import forced_mode

    model = tiny_student(variant).eval()
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        with forced_mode("torch"):
            ref = model_decode(ref_model)
        with gpu_branch(), fla_calls() as calls:
            out = model_decode(model)
    return {"checked": "interpreter", "packed": False, "directions": ["forward"], "rel_err": compare(ref, out),
            **check_decode_kernels(calls),
            "note": "prefill 6 tokens (fla's chunk kernel), then 3 single-token steps from the cache (fla's recurrent "
                    "kernel)"}


def check_step(variant: str) -> dict[str, Any]:
    import torch

    import hylo.kernels.fused_kl.triton_kernel as triton_kernel
    from hylo.kernels.backend import forced_mode
    from hylo.pipeline.data.rows import check_row
    from hylo.pipeline.train.stage2 import train_step

    gc = gpu_check_module()
    sh, device = gc.TINY, torch.device("cpu")
    triton_kernel.BLOCK_V_MAX = 64  # fewer interpreted vocabulary blocks
    results = {}
    for branch, ctx_mgr in (("torch", lambda: forced_mode("torch")), ("gpu", gpu_branch)):
        torch.manual_seed(1)
        teacher = gc.teacher_8b(sh, device, torch.float32)
        task, _ = gc.stage2_task(variant, sh, device, torch.float32, teacher, "plain")
        ctx = gc.solo_context(task.cfg, device, torch.float32)
        row = check_row(gc.packed_row(100, 3, task.student.config.vocab_size, seed=2))
        start = torch.cat([p.detach().flatten() for p in task.student.parameters()])
        with ctx_mgr():
            res = train_step(task, [row], ctx)
        after = torch.cat([p.detach().flatten() for p in task.student.parameters()])
        # the update alone (the parameters minus their start) too: the step is small
        results[branch] = {"kl_sum": torch.tensor(res.sums["kl_sum"]), "loss_sum": torch.tensor(res.sums["loss_sum"]),
                           "grad_norm": torch.tensor(res.grad_norm), "parameters after the step": after,
                           "update": after - start}
        del task
    return {"checked": "interpreter", "packed": True, "cu_seqlens": gc.packed_row(100, 3, 2)["cu_seqlens"].tolist(),
            "directions": ["forward", "backward", "optimizer step"], "rel_err": compare(results["torch"], results["gpu"]),
            "tol": {"update": UPDATE_TOL},
            "note": "pipeline/train/stage2.train_step with PlainEngine; fp32 on both branches"}


MODEL_CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "model/mla+gdn/fwd-bwd": lambda: check_model("8mla8gdn"),
    "model/mla+mamba2/fwd-bwd": lambda: check_model("4mla12m2"),
    "model/mla+gdn/decode": lambda: check_decode("8mla8gdn"),
    "model/mla+mamba2/decode": lambda: check_decode("4mla12m2"),
    "model/mla+gdn/stage2-step": lambda: check_step("8mla8gdn"),
    "model/mla+mamba2/stage2-step": lambda: check_step("4mla12m2"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fla's and the fused KL's kernels interpreted on CPU vs the torch path")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--cases", default="", help="comma-separated case-name prefixes (default: all)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"
    install()
    import warnings

    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.filterwarnings("ignore")  # fla: "Triton is not supported on current platform, roll back to CPU"
    cases: dict[str, Callable[[], dict[str, Any]]] = {n: (lambda n=n: check_op(n)) for n in OP_CASES}
    cases.update(MODEL_CASES)
    wanted = [p for p in args.cases.split(",") if p]
    results: dict[str, Any] = {}
    for name, fn in cases.items():
        if wanted and not any(name.startswith(p) for p in wanted):
            continue
        t0 = time.perf_counter()
        try:
            rec = fn()
            rec["ok"] = all(e <= tolerance(rec, k) for k, e in rec["rel_err"].items())
        except Exception as exc:
            rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = rec
        print(f"{name}: {'ok' if rec['ok'] else 'FAIL'} {rec.get('rel_err', rec.get('error'))} {rec['seconds']} s",
              flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
