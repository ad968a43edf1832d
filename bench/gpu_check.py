"""One prepared check of every GPU path of the project, at the released models' shapes.

    python bench/gpu_check.py --out OUT_DIR              # on one GPU (about 4-6 minutes on an H200)
    python bench/gpu_check.py --out OUT_DIR --tiny       # the same code at small shapes on CPU (~1 min)
    python bench/gpu_check.py --out OUT_DIR --cases 1,3  # a subset

Writes OUT_DIR/gpu_check.json (every figure, the versions, each case's error if it failed) and
OUT_DIR/gpu_check.md (a short table). Each case runs in its own try block: a failure is recorded (type,
message, the traceback's last lines) and the next case runs. Files of those names (and, with --case-seconds,
OUT_DIR/case_N/'s) that this project did not write are refused before anything runs (`--force` replaces them).

Cases (docs/gpu-check.md gives the shapes, the expected times and what the figures are compared with):
1. fused KL: our kernel (Triton on GPU) against the torch reference that materialises the logits
   (`naive_kl_div`: full logits + F.kl_div), teacher as hidden states + LM head and as top-64 + tail;
   loss / gradient relative errors, peak extra memory and forward+backward time, and Liger-Kernel's
   `LigerFusedLinearJSDLoss(beta=0)` beside them when it is importable;
2. GDN and Mamba-2 layers on a packed row: the GPU path (fla) against the project's torch path,
   outputs, every gradient and the final states, and the time of each;
3. MLA on a packed row with few and many documents, forward + backward: time and memory of the
   attention path the layer takes (grouped batched SDPA) beside the per-document SDPA loop;
4. the stage-2 step (`pipeline/train/stage2.train_step` with `PlainEngine` in place of DeepSpeed) at
   the 1B recipe's shape, 8MLA8GDN and 4MLA12M2 students, an 8B-shaped in-process teacher, fused KL
   over hidden states, activation checkpointing, AdamW: peak memory, step time, tokens/s, and the host
   synchronisations of one step;
5. decode: generated tokens/s and cache bytes of the 1B HyLo shape against the Llama-3.2-1B shape;
6. the same step through the project's DeepSpeed engine (ZeRO-3, world size 1), if DeepSpeed imports.

Timing: one untimed warm-up, then device events (CUDA) or perf_counter (CPU) around a synchronised
region. Memory: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was
allocated before (so "extra" is what the measured call itself added); None on CPU. Models have random
weights (no weights travel); figures that depend on the weights' values (losses) are only sanity checks.
`--tiny` uses small shapes, the Triton interpreter for the fused KL and the torch path elsewhere, so
that `tests/kernels/test_gpu_check.py` keeps this script running between loans.
Beside every memory figure measured, the step estimate's figure for the same call (`estimated_*`:
pipeline/estimate/, the call on fake tensors; `hylo estimate`), so the first GPU run also checks
the estimator; an estimate that fails is listed in `estimate_errors` and fails no case.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG_1B = REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"
GIB = 1 << 30
# The paper's figures for its 1B student (4MLA12M2) with an 8B teacher at 64K tokens (per GPU).
PAPER_64K_GIB = {"hidden-state fused KL + checkpointing": 54.2, "plain fused KL + checkpointing": 144.8,
                 "no fused KL": "out of memory"}

# Relative-error tolerances (the fused KL computes in fp32 whatever its inputs; the linear layers
# compare bf16 against an fp32 copy on GPU, fp32 against fp64 in --tiny).
TOL = {"kl_loss": 1e-4, "kl_grad": 1e-3, "layer_bf16": 3e-2, "layer_fp32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Shapes:
    kl: dict[str, int]
    linear: dict[str, int]
    mla: dict[str, Any]
    step: dict[str, Any]
    decode: dict[str, Any]
    deepspeed_tokens: int
    tiny: bool


FULL = Shapes(
    kl={"N": 16384, "H": 2048, "V": 128256, "HT": 4096, "k": 64},
    linear={"T": 16384, "docs": 8},
    mla={"T": 65536, "docs": (8, 64)},
    step={"tokens": (8192, 16384, 32768, 65536), "doc_tokens": 8192},
    decode={"context": (8192, 32768, 65536), "new_tokens": 32},
    deepspeed_tokens=16384,
    tiny=False,
)
TINY = Shapes(
    kl={"N": 24, "H": 16, "V": 64, "HT": 24, "k": 8},
    linear={"T": 96, "docs": 3},
    mla={"T": 256, "docs": (2, 16)},
    step={"tokens": (64,), "doc_tokens": 32},
    decode={"context": (32, 64), "new_tokens": 4},
    deepspeed_tokens=64,
    tiny=True,
)


# ------------------------------------------------------------------------------------ measuring
class Meter:
    """Time and peak extra memory of a callable on one device (see the module docstring)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], Any], warmup: bool = True) -> tuple[Any, float, int | None]:
        """(result of the timed call, seconds, peak bytes allocated beyond those live before it).

        The warm-up (kernel compilation, autotuning, library handles) runs on CUDA only."""
        torch = self.torch
        t_call = time.perf_counter()
        if warmup and self.cuda:
            fn()
        self.sync()
        if warmup and self.cuda:
            print(f"[gpu_check]   warm-up of {getattr(fn, '__qualname__', 'a call')}: "
                  f"{time.perf_counter() - t_call:.1f} s", flush=True)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.sync()
            return out, start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(self.device) - base
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0, None


def rel_err(ref: Any, got: Any) -> float:
    """||got - ref|| / ||ref|| in fp64 (inf when got holds NaN/inf)."""
    ref, got = ref.detach().double().flatten(), got.detach().double().flatten().to(ref.device)
    if not bool(got.isfinite().all()):
        return math.inf
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def gib(x: int | None) -> float | None:
    return None if x is None else round(x / GIB, 3)


def error_record(exc: BaseException) -> dict[str, Any]:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(lines).strip().splitlines()[-12:]
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": tail}


def kernels_mode(mode: str):
    """The kernel path for a block: kernels/backend.py's own switch (what HYLO_KERNELS sets process-wide)."""
    from hylo.kernels.backend import forced_mode

    return forced_mode(mode.lower())


def estimated_gib(setup: Callable[[], Any], run: Callable[[Any], Any]) -> float | None:
    """The step estimate's figure for a measured call (pipeline/estimate/step.estimate_call: the same call
    on fake CPU tensors, torch kernel paths, the accelerator's rules): its peak beyond its inputs, in GiB,
    recorded beside the measured `peak_extra_gib` so that a GPU run also checks the estimator. None (with the
    error in `estimate_errors`) when the estimate fails: the measured case still counts."""
    from hylo.pipeline.estimate import estimate_call

    try:
        return gib(estimate_call(setup, run))
    except Exception as exc:  # recorded, never fatal for the case
        ESTIMATE_ERRORS.append(f"{type(exc).__name__}: {exc}"[:500])
        return None


ESTIMATE_ERRORS: list[str] = []


def fake_build(factory: Callable[[], Any], dtype: Any):
    """`build(factory, cpu, dtype)` on the estimate's fake tensors (a module cannot be cast there in place)."""
    import torch

    from hylo.pipeline.estimate import cast_parameters

    with torch.device("cpu"):
        return cast_parameters(factory(), dtype)


def free_memory() -> None:
    # no gc.collect here (about a second per call with transformers loaded): tensors die by refcount
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ shapes
def llama_config(kind: str, tiny: bool):
    """Llama-3.2-1B / Llama-3.1-8B shapes (random weights), or small stand-ins for --tiny."""
    from transformers import LlamaConfig

    if tiny:
        big = kind == "8b"
        return LlamaConfig(vocab_size=300, hidden_size=48 if big else 32, intermediate_size=96 if big else 64,
                           num_hidden_layers=3 if big else 4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=12 if big else 16, max_position_embeddings=4096, tie_word_embeddings=not big,
                           rope_theta=500000.0)
    if kind == "8b":
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                           max_position_embeddings=131072, tie_word_embeddings=False)
    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True)


def hylo_config(variant: str, tiny: bool):
    """The 1B recipe's student (configs/llama-3.2-1b-8mla8gdn-64k.yaml's conversion options): `8mla8gdn`
    as released, or `4mla12m2` (4 MLA layers, 12 Mamba-2, the paper's memory comparison)."""
    import warnings

    from hylo.pipeline.train.config import load_stage_config
    from hylo.upcycle.options import hybrid_config_from_base

    convert = load_stage_config(1, CONFIG_1B).model.convert
    if tiny:
        convert = dataclasses.replace(convert, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                      qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16,
                                      max_position_embeddings=4096, yarn_original_max_position_embeddings=128)
    if variant == "4mla12m2":
        n = 4 if tiny else 16
        convert = dataclasses.replace(convert, linear_type="mamba2", mla_layers=[0, n - 1] if tiny else [0, 5, 10, 15])
    with warnings.catch_warnings():
        # the base's RoPE scaling is replaced by YaRN in the MLA layers (the recipe's choice)
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(llama_config("1b", tiny), convert)


def build(cls_or_fn: Callable[[], Any], device: Any, dtype: Any):
    """A model with random weights, initialised on the device (an 8B model is slow to initialise on CPU)."""
    import torch

    with torch.device(device):
        model = cls_or_fn()
    return model.to(dtype)


def packed_row(T: int, docs: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """A packed row of `docs` documents of (nearly) equal length, every label scored but each document's last."""
    import numpy as np

    rng = np.random.default_rng(seed)
    cu = np.linspace(0, T, docs + 1).round().astype(np.int32)
    pos = np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])
    mask = np.ones(T, dtype=bool)
    mask[cu[1:] - 1] = False
    return {"input_ids": rng.integers(0, vocab, T), "cu_seqlens": cu, "position_ids": pos, "loss_mask": mask}


# ------------------------------------------------------------------------------------ case 1
def case_fused_kl(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    """Our fused KL in each precision mode (`fused`: accurate, the default; `fused_fast`) against the full-logits
    reference and Liger's fused JSD, for the hidden-state and the top-k teachers, and our fused CE against the
    full-logits CE and cut-cross-entropy's where it imports: time, TFLOP performed and rate, extra memory,
    loss and gradient errors against the fp32 reference (returned in bf16)."""
    import torch

    from hylo.kernels.backend import use_gpu_kernels
    from hylo.kernels.fused_kl import (
        fused_linear_cross_entropy,
        fused_linear_kl_div,
        naive_cross_entropy,
        naive_kl_div,
        topk_from_logits,
    )
    from hylo.kernels.fused_kl.gemm import PRECISIONS

    N, H, V, HT, k = (sh.kl[x] for x in ("N", "H", "V", "HT", "k"))
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    h = (torch.randn(N, H, device=device, generator=g) * 1.0).to(bf16).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * H ** -0.5).to(bf16).requires_grad_()
    th = torch.randn(N, HT, device=device, generator=g).to(bf16)
    tw = (torch.randn(V, HT, device=device, generator=g) * 2 * HT ** -0.5).to(bf16)
    labels = torch.randint(0, V, (N,), device=device, generator=g)
    with torch.no_grad():
        rec = topk_from_logits_chunked(th, tw, k, topk_from_logits)
    teachers = {"hidden": {"teacher_hidden": th, "teacher_weight": tw}, "topk64_tail": {"teacher_topk": rec}}
    out: dict[str, Any] = {"shape": {"N": N, "H": H, "V": V, "H_teacher": HT, "k": k, "dtype": "bfloat16"},
                           "kernel": "triton" if use_gpu_kernels(h) else "torch"}
    # fast mode rounds the logit gradient to bf16 once, as Liger: its gradients are held to Liger's level
    grad_tol = {"accurate": TOL["kl_grad"], "fast": 1e-2}

    def fwd_bwd_on(fn, h, w, kw):
        h.grad = w.grad = None
        loss = fn(h, w, **kw)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def fwd_bwd(fn, **kw):
        return lambda: fwd_bwd_on(fn, h, w, kw)

    def estimate(fn, teacher):
        from hylo.pipeline.estimate import fake_like

        return estimated_gib(lambda: fake_like((h, w, teacher)), lambda s: fwd_bwd_on(fn, *s))

    def tflop(teacher_h: int, products: int) -> float:
        # student logits, teacher logits (hidden-state teacher), and each gradient product (2 per split half)
        return 2 * N * V * (H + teacher_h + 2 * products * H) / 1e12

    def measured(fn, teacher, ref, work: float) -> dict[str, Any]:
        (loss, dh, dw), t, m = meter.run(fwd_bwd(fn, **teacher))
        return {"seconds": t, "peak_extra_gib": gib(m), "loss": float(loss), "tflop": work, "tflop_per_s": work / t,
                "loss_rel_err": rel_err(ref[0], loss), "grad_hidden_rel_err": rel_err(ref[1], dh),
                "grad_weight_rel_err": rel_err(ref[2], dw)}

    def modes(res, fn, teacher, ref, teacher_h, estimated=True):
        for mode in PRECISIONS:
            key = "fused" if mode == "accurate" else f"fused_{mode}"
            run = functools.partial(fn, precision=mode)
            r = res[key] = {"precision": mode, **measured(run, teacher, ref, tflop(teacher_h, 1 + (mode == "accurate")))}
            if estimated:
                r["estimated_peak_extra_gib"] = estimate(run, teacher)
            r["within_tolerance"] = (r["loss_rel_err"] <= TOL["kl_loss"] and r["grad_hidden_rel_err"] <= grad_tol[mode]
                                     and r["grad_weight_rel_err"] <= grad_tol[mode])
            free_memory()

    for name, teacher in teachers.items():
        res: dict[str, Any] = {}
        ref, t_ref, m_ref = meter.run(fwd_bwd(naive_kl_div, **teacher))
        ref = (ref[0], ref[1].clone(), ref[2].clone())
        res["reference_full_logits"] = {"seconds": t_ref, "peak_extra_gib": gib(m_ref), "loss": float(ref[0]),
                                        "estimated_peak_extra_gib": estimate(naive_kl_div, teacher)}
        free_memory()
        modes(res, fused_linear_kl_div, teacher, ref, HT if name == "hidden" else 0)
        if name == "hidden":
            res["liger"] = liger_jsd(h, w, th, tw, meter, *ref)
            if res["liger"].get("available"):
                res["liger"]["tflop"] = tflop(HT, 1)
                res["liger"]["tflop_per_s"] = res["liger"]["tflop"] / res["liger"]["seconds"]
        del ref
        free_memory()
        out[name] = res

    # the CE path: the same op against a one-hot teacher (no teacher product)
    ce_args = {"labels": labels}
    ce: dict[str, Any] = {}
    ref, t_ref, m_ref = meter.run(fwd_bwd(lambda h, w, labels: naive_cross_entropy(h, w, labels), **ce_args))
    ref = (ref[0], ref[1].clone(), ref[2].clone())
    ce["reference_full_logits"] = {"seconds": t_ref, "peak_extra_gib": gib(m_ref), "loss": float(ref[0])}
    free_memory()
    modes(ce, lambda h, w, labels, precision: fused_linear_cross_entropy(h, w, labels, precision=precision),
          ce_args, ref, 0, estimated=False)
    ce["cut_cross_entropy"] = cut_cross_entropy_ce(h, w, labels, meter, *ref)
    if ce["cut_cross_entropy"].get("available"):
        ce["cut_cross_entropy"]["tflop"] = tflop(0, 1)
        ce["cut_cross_entropy"]["tflop_per_s"] = ce["cut_cross_entropy"]["tflop"] / ce["cut_cross_entropy"]["seconds"]
    del ref
    free_memory()
    out["ce"] = ce
    out["ok"] = all(out[n][key]["within_tolerance"] for n in (*teachers, "ce") for key in ("fused", "fused_fast"))
    return out


def topk_from_logits_chunked(th, tw, k: int, topk_from_logits, chunk: int = 2048):
    """The teacher's top-k record without a [N, V] logits tensor (fp32 logits chunk by chunk)."""
    import torch

    from hylo.kernels.fused_kl import TeacherTopK

    parts = [topk_from_logits(th[s:s + chunk].float() @ tw.float().t(), k, dtype=torch.float32)
             for s in range(0, th.shape[0], chunk)]
    return TeacherTopK(*(torch.cat([p[i] for p in parts]) for i in range(3)))


def liger_jsd(h, w, th, tw, meter: Meter, ref_loss, ref_dh, ref_dw) -> dict[str, Any]:
    """Liger-Kernel's chunked fused linear JSD at beta = 0 (forward KL(teacher || student)), mean over tokens."""
    import torch

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except Exception as exc:  # not installed here: recorded, not a failure of the case
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, temperature=1.0,
                                      compiled=h.is_cuda)
    labels = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)

    def run():
        h.grad = w.grad = None
        loss = loss_fn(h, w, th, tw, labels)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    (loss, dh, dw), t, m = meter.run(run)
    return {"available": True, "seconds": t, "peak_extra_gib": gib(m), "loss": float(loss),
            "loss_rel_err": rel_err(ref_loss, loss), "grad_hidden_rel_err": rel_err(ref_dh, dh),
            "grad_weight_rel_err": rel_err(ref_dw, dw), "compiled": h.is_cuda}


def cut_cross_entropy_ce(h, w, labels, meter: Meter, ref_loss, ref_dh, ref_dw) -> dict[str, Any]:
    """Apple's cut-cross-entropy (`linear_cross_entropy`, its default CCE kernel), mean over tokens."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as exc:  # not installed here: recorded, not a failure of the case
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}

    def run():
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, labels, reduction="mean")
        loss.backward()
        return loss.detach(), h.grad, w.grad

    try:
        (loss, dh, dw), t, m = meter.run(run)
    except Exception as exc:  # e.g. no CPU kernel: recorded, not a failure of the case
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    return {"available": True, "seconds": t, "peak_extra_gib": gib(m), "loss": float(loss),
            "loss_rel_err": rel_err(ref_loss, loss), "grad_hidden_rel_err": rel_err(ref_dh, dh),
            "grad_weight_rel_err": rel_err(ref_dw, dw)}


# ------------------------------------------------------------------------------------ case 2
def case_linear_layers(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    import torch

    from hylo.kernels.backend import use_fla
    from hylo.kernels.gdn import chunk_gated_delta_rule
    from hylo.kernels.ssd import chunk_ssd
    from hylo.kernels.varlen import DocBounds
    from hylo.modeling import build_mixer

    T, docs = sh.linear["T"], sh.linear["docs"]
    row = packed_row(T, docs, 8)
    bounds = DocBounds.from_host(row["cu_seqlens"], T, device)
    fast_dtype = torch.float32 if sh.tiny else torch.bfloat16
    ref_dtype = torch.float64 if sh.tiny else torch.float32
    tol = TOL["layer_fp32"] if sh.tiny else TOL["layer_bf16"]
    out: dict[str, Any] = {"shape": {"T": T, "docs": docs, "dtype": str(fast_dtype).replace("torch.", "")}}
    for variant, idx in (("gdn", 1), ("mamba2", 1)):
        cfg = hylo_config("8mla8gdn" if variant == "gdn" else "4mla12m2", sh.tiny)
        torch.manual_seed(0)
        layer = build(functools.partial(build_mixer, cfg, idx), device, fast_dtype)
        ref_layer = build(functools.partial(build_mixer, cfg, idx), device, ref_dtype)
        ref_layer.load_state_dict({k: v.to(ref_dtype) for k, v in layer.state_dict().items()})
        x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=fast_dtype)
        dy = torch.randn_like(x)
        path = "fla" if use_fla(x) else "torch"

        def run(mod, dtype, mode, x=x, dy=dy):
            def go():
                xi = x.detach().to(dtype).requires_grad_()
                mod.zero_grad(set_to_none=True)
                with kernels_mode(mode):
                    y = mod(xi, cu_seqlens=bounds)
                    y = y[0] if isinstance(y, tuple) else y
                    y.backward(dy.to(dtype))
                return y.detach(), xi.grad, {n: p.grad.clone() for n, p in mod.named_parameters()}
            return go

        (y, dx, grads), t_fast, m_fast = meter.run(run(layer, fast_dtype, "auto"))

        def fake_layer_and_input(variant=variant, idx=idx, cfg=cfg, x=x):
            from hylo.pipeline.estimate import fake_like

            return fake_build(functools.partial(build_mixer, cfg, idx), fast_dtype), fake_like(x)

        def layer_fwd_bwd(state, bounds=DocBounds.from_host(row["cu_seqlens"], T, "cpu")):
            mod, xi = state
            xi = xi.detach().requires_grad_()
            y = mod(xi, cu_seqlens=bounds)
            (y[0] if isinstance(y, tuple) else y).backward(torch.ones_like(y[0] if isinstance(y, tuple) else y))

        est_fast = estimated_gib(fake_layer_and_input, layer_fwd_bwd)
        (y_ref, dx_ref, grads_ref), t_ref, m_ref = meter.run(run(ref_layer, ref_dtype, "torch"))
        errs = {"output": rel_err(y_ref, y), "grad_input": rel_err(dx_ref, dx)}
        errs.update({f"grad_{n}": rel_err(grads_ref[n], g) for n, g in grads.items()})
        # final states: the layer's op on the same kind of inputs, GPU path against the torch path
        state_errs, t_op = op_final_states(variant, T, bounds, device, fast_dtype, ref_dtype, cfg, meter,
                                           chunk_gated_delta_rule, chunk_ssd)
        errs.update(state_errs)
        worst = max(errs.values())
        out[variant] = {"path": path, "seconds": t_fast, "peak_extra_gib": gib(m_fast),
                        "estimated_peak_extra_gib": est_fast, "torch_path_seconds": t_ref,
                        "torch_path_dtype": str(ref_dtype).replace("torch.", ""), "op_seconds": t_op,
                        "rel_err": errs, "max_rel_err": worst, "tolerance": tol, "within_tolerance": worst <= tol}
        del layer, ref_layer
        free_memory()
    out["ok"] = all(out[v]["within_tolerance"] for v in ("gdn", "mamba2"))
    return out


def op_final_states(variant, T, bounds, device, fast_dtype, ref_dtype, cfg, meter, gdn_op, ssd_op):
    """Outputs, input gradients and final states of the op alone (GDN rule / SSD scan), both paths."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(1)
    if variant == "gdn":
        Hh, K = cfg.gdn_num_heads, cfg.gdn_head_dim
        Vd = int(K * cfg.gdn_expand_v)
        shapes = {"q": (1, T, Hh, K), "k": (1, T, Hh, K), "v": (1, T, Hh, Vd), "g": (1, T, Hh), "beta": (1, T, Hh)}
    else:
        Hh, P, N, G = cfg.mamba2_dims
        shapes = {"x": (1, T, Hh, P), "dt": (1, T, Hh), "A": (Hh,), "B": (1, T, G, N), "C": (1, T, G, N)}
    raw = {n: torch.randn(s, device=device, generator=g) for n, s in shapes.items()}

    def inputs(dtype):
        d = {n: t.to(dtype) for n, t in raw.items()}
        if variant == "gdn":
            d["q"], d["k"] = F.normalize(d["q"], dim=-1), F.normalize(d["k"], dim=-1)
            d["g"], d["beta"] = F.logsigmoid(d["g"]), torch.sigmoid(d["beta"])
        else:
            # step and decay in fp32 at least, as the Mamba-2 layer passes them
            cd = torch.promote_types(dtype, torch.float32)
            d["dt"], d["A"] = F.softplus(raw["dt"].to(cd)), -torch.exp(raw["A"].to(cd))
        return {n: t.detach().requires_grad_() for n, t in d.items()}

    def run(dtype, mode):
        def go():
            d = inputs(dtype)
            with kernels_mode(mode):
                if variant == "gdn":
                    o, s = gdn_op(d["q"], d["k"], d["v"], d["g"], d["beta"], output_final_state=True,
                                  cu_seqlens=bounds)
                else:
                    o, s = ssd_op(d["x"], d["dt"], d["A"], d["B"], d["C"], output_final_state=True,
                                  cu_seqlens=bounds)
                (o.float().square().mean() + s.float().square().mean()).backward()
            return o.detach(), s.detach(), {n: t.grad for n, t in d.items()}
        return go

    (o, s, gr), t_op, _ = meter.run(run(fast_dtype, "auto"))
    (o_r, s_r, gr_r), _, _ = meter.run(run(ref_dtype, "torch"), warmup=False)
    errs = {"op_output": rel_err(o_r, o), "op_final_state": rel_err(s_r, s)}
    errs.update({f"op_grad_{n}": rel_err(gr_r[n], gr[n]) for n in gr})
    return errs, t_op


# ------------------------------------------------------------------------------------ case 3
def case_mla(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    import torch

    from hylo.kernels import packed_sdpa
    from hylo.kernels.varlen import DocBounds
    from hylo.layers.mla import MLAttention

    cfg = hylo_config("8mla8gdn", sh.tiny)
    dtype = torch.float32 if sh.tiny else torch.bfloat16
    torch.manual_seed(0)
    layer = build(lambda: MLAttention(cfg, 0), device, dtype)
    T = sh.mla["T"]
    out: dict[str, Any] = {"shape": {"T": T, "heads": cfg.num_attention_heads, "dtype": str(dtype)[6:]}}
    x = torch.randn(1, T, cfg.hidden_size, device=device, dtype=dtype)
    for docs in sh.mla["docs"]:
        bounds = DocBounds.from_host(packed_row(T, docs, 8)["cu_seqlens"], T, device)
        res: dict[str, Any] = {}
        results = {}
        for impl in ("grouped", "loop"):
            def go(impl=impl, bounds=bounds):
                xi = x.detach().requires_grad_()
                layer.zero_grad(set_to_none=True)
                with packed_sdpa.implementation(impl):
                    y = layer(xi, cu_seqlens=bounds)
                    y.float().square().mean().backward()
                return y.detach(), xi.grad
            (y, dx), t, m = meter.run(go)
            results[impl] = (y, dx)

            def mla_fwd_bwd(state, impl=impl, bounds=DocBounds.from_host(packed_row(T, docs, 8)["cu_seqlens"], T, "cpu")):
                mod, xi = state
                xi = xi.detach().requires_grad_()
                with packed_sdpa.implementation(impl):
                    mod(xi, cu_seqlens=bounds).float().square().mean().backward()

            def fake_mla():
                from hylo.pipeline.estimate import fake_like

                return fake_build(lambda: MLAttention(cfg, 0), dtype), fake_like(x)

            res[impl] = {"seconds": t, "peak_extra_gib": gib(m), "estimated_peak_extra_gib": estimated_gib(fake_mla, mla_fwd_bwd)}
        res["grouped_vs_loop_rel_err"] = max(rel_err(results["loop"][0], results["grouped"][0]),
                                             rel_err(results["loop"][1], results["grouped"][1]))
        res["speedup"] = res["loop"]["seconds"] / max(res["grouped"]["seconds"], 1e-12)
        out[f"docs{docs}"] = res
        del results
        free_memory()
    tol = 1e-4 if sh.tiny else 2e-2
    out["ok"] = all(out[f"docs{d}"]["grouped_vs_loop_rel_err"] <= tol for d in sh.mla["docs"])
    return out


# ------------------------------------------------------------------------------------ case 4 / 6
def stage2_task(variant: str, sh: Shapes, device: Any, dtype: Any, teacher_model: Any, engine: str):
    """The stage-2 task from pipeline/train/stage2.build around a random student; engine 'plain' or 'deepspeed'."""
    import torch

    from hylo.modeling import HyLoForCausalLM
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
    from hylo.pipeline.train import stage2
    from hylo.pipeline.train.config import Stage2Config
    from hylo.pipeline.train.plain_engine import plain_engine

    cfg = Stage2Config()
    cfg.deepspeed.zero_stage = 3 if engine == "deepspeed" else 0
    cfg.train.global_batch_sequences = 1
    cfg.ray.num_workers = 1  # one process: the micro-batches per step are global_batch_sequences / num_workers
    cfg.model.activation_checkpointing = True
    cfg.teacher.k = 0
    cfg.kd.chunk_size = None
    hcfg = hylo_config(variant, sh.tiny)
    torch.manual_seed(0)
    task = stage2.build(solo_context(cfg, device, dtype), lambda step: 1.0,
                        student=lambda: build(lambda: HyLoForCausalLM(hcfg), device, dtype),
                        engine=plain_engine(cfg.optim) if engine == "plain" else None,
                        teacher=lambda vocab: BoundTeacher(teacher_model, TargetSpec(cfg.teacher.k, cfg.teacher.form),
                                                           vocab))
    # ZeRO-3 partitions the parameters: ds_numel is each one's full size
    return task, sum(getattr(p, "ds_numel", p.numel()) for p in task.student.parameters() if p.requires_grad)


def teacher_8b(sh: Shapes, device: Any, dtype: Any):
    from transformers import LlamaForCausalLM

    from hylo.pipeline.teacher.model import TeacherModel

    cfg = llama_config("8b", sh.tiny)
    cfg._attn_implementation = "sdpa"
    model = build(lambda: LlamaForCausalLM(cfg), device, dtype)
    max_tokens = max(sh.step["tokens"])
    return TeacherModel(model, dtype=dtype, device=device, isolation="per_doc", max_forward_tokens=max_tokens)


def solo_context(cfg: Any, device: Any, dtype: Any):
    """A WorkerContext of one rank whose all-reduce is the identity (no process group needed)."""
    from hylo.pipeline.train.worker import SoloContext

    return SoloContext(cfg=cfg, rank=0, world_size=1, device=device, dtype=dtype, run_dir=Path("."), grad_accum=1)


def count_syncs(fn: Callable[[], Any], device: Any) -> dict[str, Any]:
    """Host synchronisations of one call: CUDA's sync debug mode on a GPU, the host-read log on CPU."""
    from hylo.kernels.fused_kl.inputs import deferred_checks
    from hylo.kernels.host_reads import HostReadLog, cuda_sync_log

    if device.type == "cuda":
        with cuda_sync_log() as messages:
            fn()
        return {"counter": "torch.cuda.set_sync_debug_mode('warn')", "count": len(messages),
                "first": messages[:8]}
    with deferred_checks(), HostReadLog() as log:
        fn()
    return {"counter": "hylo.kernels.host_reads.HostReadLog (CPU, GPU rule)", "count": len(log.reads),
            "reads": [f"{name} at {where}" for name, where in log.reads][:40]}


def case_step(sh: Shapes, device: Any, meter: Meter, engine: str = "plain") -> dict[str, Any]:
    import torch

    from hylo.pipeline.data.rows import check_row
    from hylo.pipeline.train.stage2 import train_step

    dtype = torch.float32 if sh.tiny else torch.bfloat16
    teacher = teacher_8b(sh, device, dtype)
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.model.parameters())
    out: dict[str, Any] = {"teacher": "Llama-3.1-8B shape" if not sh.tiny else "tiny Llama",
                           "teacher_weights_gib": gib(teacher_bytes), "dtype": str(dtype)[6:],
                           "activation_checkpointing": True, "kl": "fused over hidden states",
                           "paper_1b_4mla12m2_64k_gib": PAPER_64K_GIB}
    variants = ("8mla8gdn", "4mla12m2") if engine == "plain" else ("8mla8gdn",)
    sizes = sh.step["tokens"] if engine == "plain" else (sh.deepspeed_tokens,)
    for variant in variants:
        task, n_params = stage2_task(variant, sh, device, dtype, teacher, engine)
        ctx = solo_context(task.cfg, device, dtype)
        vocab = task.student.config.vocab_size
        res: dict[str, Any] = {"parameters": n_params}
        # warm-up at the smallest size: compiles kernels and allocates the optimiser state
        # the step takes the reader's checked rows (PackedRow with host boundaries), checked here once
        warm = check_row(packed_row(sizes[0], max(1, sizes[0] // sh.step["doc_tokens"]), vocab, seed=1))
        train_step(task, [warm], ctx)
        res["host_syncs_per_step"] = count_syncs(functools.partial(train_step, task, [warm], ctx), device)
        for T in sizes:
            row = check_row(packed_row(T, max(1, T // sh.step["doc_tokens"]), vocab, seed=2))
            free_memory()
            try:  # one size out of memory still leaves the others' figures
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                result, seconds, extra = meter.run(functools.partial(train_step, task, [row], ctx), warmup=False)
            except Exception as exc:
                res[f"T{T}"] = {"finite": False, "error": error_record(exc)}
                continue
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            res[f"T{T}"] = {"seconds": seconds, "tokens_per_s": T / seconds, "peak_gib": gib(peak),
                            "peak_without_teacher_weights_gib": gib(None if peak is None else peak - teacher_bytes),
                            "extra_over_steady_state_gib": gib(extra), "kl_sum": result.sums["kl_sum"],
                            "grad_norm": result.grad_norm, "finite": math.isfinite(result.sums["kl_sum"]),
                            **step_estimate(task.cfg, variant, sh, T, dtype)}
        out[variant] = res
        del task
        free_memory()
    out["ok"] = all(out[v][f"T{T}"]["finite"] for v in variants for T in sizes)
    return out


def step_estimate(cfg: Any, variant: str, sh: Shapes, T: int, dtype: Any) -> dict[str, Any]:
    """`hylo estimate`'s figures for the measured step (pipeline/estimate/step.estimate_step: the same
    step on fake tensors, world size 1, the accelerator's rules, the same row layout): its peak (to compare
    with `peak_gib`) and its peak over its start (with `extra_over_steady_state_gib`)."""
    from hylo.pipeline.estimate import Shapes as StepShapes
    from hylo.pipeline.estimate import estimate_step

    try:
        m = cfg.teacher.model
        teacher = dataclasses.replace(m, dtype=str(dtype).removeprefix("torch."), isolation="per_doc",
                                      max_forward_tokens=max(sh.step["tokens"]))
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, model=teacher),
                                  deepspeed=dataclasses.replace(cfg.deepspeed, zero_stage=0))
        doc = T // max(1, T // sh.step["doc_tokens"])
        est = estimate_step(cfg, T, 1, dtype, gpu=True, doc_tokens=(doc, doc),
                            shapes=StepShapes(hylo_config(variant, sh.tiny), teacher=llama_config("8b", sh.tiny)))
    except Exception as exc:  # recorded, never fatal for the case
        return {"estimate_error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"estimated_peak_gib": gib(int(est.peak_bytes)),
            "estimated_extra_over_start_gib": gib(int(est.peak_bytes - est.start_bytes)),
            "estimated_flops": est.total_flops}


def case_deepspeed(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:
        return {"ok": True, "skipped": f"deepspeed does not import: {type(exc).__name__}: {exc}"[:300]}
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        out = case_step(sh, device, meter, engine="deepspeed")
    finally:
        dist.destroy_process_group()
    out["engine"] = "DeepSpeed ZeRO-3, world size 1, " + ("NCCL" if device.type == "cuda" else "gloo")
    return out


# ------------------------------------------------------------------------------------ case 5
def cache_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from a cache object (attributes, lists, dicts)."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.numel() == 0:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(cache_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(cache_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(cache_bytes(v, seen) for v in vars(obj).values() if not callable(v))
    return 0


def case_decode(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from hylo.cache import HyLoCache
    from hylo.modeling import HyLoForCausalLM

    dtype = torch.float32 if sh.tiny else torch.bfloat16
    new = sh.decode["new_tokens"]
    out: dict[str, Any] = {"new_tokens": new, "batch": 1, "dtype": str(dtype)[6:]}
    hcfg = hylo_config("8mla8gdn", sh.tiny)
    lcfg = llama_config("1b", sh.tiny)
    lcfg._attn_implementation = "sdpa"
    models = {"hylo_8mla8gdn": (lambda: HyLoForCausalLM(hcfg), lambda n: HyLoCache(hcfg, max_length=n)),
              "llama_3.2_1b": (lambda: LlamaForCausalLM(lcfg), lambda n: DynamicCache())}
    for name, (make, make_cache) in models.items():
        torch.manual_seed(0)
        model = build(make, device, dtype).eval()
        res: dict[str, Any] = {}
        for ctx_len in sh.decode["context"]:
            ids = torch.randint(0, lcfg.vocab_size, (1, ctx_len), device=device)

            @torch.no_grad()
            def prefill_and_decode(model=model, ids=ids, make_cache=make_cache, ctx_len=ctx_len):
                cache = make_cache(ctx_len + new)
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                meter.sync()
                t0 = time.perf_counter()
                for _ in range(new):
                    nxt = logits.argmax(-1, keepdim=True)
                    logits = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                meter.sync()
                return cache, time.perf_counter() - t0

            t_ctx = time.perf_counter()
            try:  # one context out of memory still leaves the others' figures
                (cache, decode_s), total_s, extra = meter.run(prefill_and_decode)
                print(f"[gpu_check] decode {name} ctx {ctx_len}: measured in {time.perf_counter() - t_ctx:.1f} s",
                      flush=True)
            except Exception as exc:
                res[f"ctx{ctx_len}"] = {"error": error_record(exc), "cache_bytes": 0, "decode_tokens_per_s": math.nan}
                free_memory()
                continue

            @torch.no_grad()
            def fake_decode(state, make_cache=make_cache, ctx_len=ctx_len):
                fmodel, fids = state
                cache = make_cache(ctx_len + new)
                logits = fmodel(input_ids=fids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                for _ in range(new):
                    logits = fmodel(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True,
                                    logits_to_keep=1).logits[:, -1]

            def fake_model(make=make, ids=ids):
                from hylo.pipeline.estimate import fake_like

                return fake_build(make, dtype).eval(), fake_like(ids)

            res[f"ctx{ctx_len}"] = {"decode_tokens_per_s": new / decode_s, "prefill_plus_decode_seconds": total_s,
                                    "cache_bytes": cache_bytes(cache), "peak_extra_gib": gib(extra),
                                    "estimated_peak_extra_gib": estimated_gib(fake_model, fake_decode)}
            print(f"[gpu_check] decode {name} ctx {ctx_len}: with the estimate {time.perf_counter() - t_ctx:.1f} s",
                  flush=True)
            del cache
            free_memory()
        out[name] = res
        del model
        free_memory()
    for ctx_len in sh.decode["context"]:
        a, b = out["hylo_8mla8gdn"][f"ctx{ctx_len}"], out["llama_3.2_1b"][f"ctx{ctx_len}"]
        if a["cache_bytes"] and b["cache_bytes"]:
            out[f"cache_ratio_ctx{ctx_len}"] = a["cache_bytes"] / b["cache_bytes"]
    out["ok"] = all(out[m][f"ctx{c}"]["cache_bytes"] > 0 and math.isfinite(out[m][f"ctx{c}"]["decode_tokens_per_s"])
                    for m in models for c in sh.decode["context"])
    return out


# ------------------------------------------------------------------------------------ driver
CASES: dict[int, tuple[str, Callable[..., dict[str, Any]]]] = {
    1: ("fused_kl", case_fused_kl),
    2: ("gdn_mamba2", case_linear_layers),
    3: ("mla_packed", case_mla),
    4: ("stage2_step", case_step),
    5: ("decode", case_decode),
    6: ("deepspeed_zero3", case_deepspeed),
}


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "platform": platform.platform()}
    for pkg in ("triton", "transformers", "flash-linear-attention", "fla-core", "liger-kernel", "deepspeed", "numpy"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            v[pkg] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        v["capability"] = list(torch.cuda.get_device_capability(0))
        # what training would say of this stack before its first step (kernels/backend.check_fla_backward)
        try:
            from hylo.kernels.backend import GpuStackError, check_fla_backward

            check_fla_backward(torch.device("cuda", 0), {"gdn", "mamba2"})
            v["training_stack_problem"] = None
        except GpuStackError as exc:
            v["training_stack_problem"] = str(exc)
    return v


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu_check ({'tiny, CPU' if report['tiny'] else report['versions'].get('gpu', 'CPU')}), "
             f"{report['date']}", ""]
    if report.get("fla_hopper_guard_bypassed"):
        lines += ["**fla's Hopper guard bypassed** (Triton 3.4-3.7.0, fla #640): gradients through fla's gated "
                  "backward are from a Triton known to be wrong there; case 2 measures by how much.", ""]
    lines += ["| case | ok | seconds | figures |", "| --- | --- | --- | --- |"]
    for name, res in report["cases"].items():
        figs = summary(name, res)
        lines.append(f"| {name} | {res.get('ok')} | {res.get('case_seconds', 0):.1f} | {figs} |")
    return "\n".join(lines) + "\n"


def summary(name: str, res: dict[str, Any]) -> str:
    """A few headline figures of one case for the table (all figures are in the JSON)."""
    if "error" in res:
        return f"{res['error']['type']}: {res['error']['message'][:120]}"
    if "skipped" in res:
        return res["skipped"][:120]

    def f(x, nd=3):
        return "-" if x is None else f"{x:.{nd}g}"

    if name == "fused_kl":
        h = res["hidden"]
        return (f"hidden: fused {f(h['fused']['seconds'])} s / {f(h['fused']['peak_extra_gib'])} GiB, "
                f"full logits {f(h['reference_full_logits']['seconds'])} s / "
                f"{f(h['reference_full_logits']['peak_extra_gib'])} GiB, "
                f"liger {f(h['liger'].get('seconds'))} s; grad err {f(h['fused']['grad_weight_rel_err'])}")
    if name == "gdn_mamba2":
        return "; ".join(f"{v} ({res[v]['path']}) {f(res[v]['seconds'])} s, max err {f(res[v]['max_rel_err'])}"
                         for v in ("gdn", "mamba2"))
    if name == "mla_packed":
        return "; ".join(f"{k}: grouped {f(v['grouped']['seconds'])} s vs loop {f(v['loop']['seconds'])} s"
                         for k, v in res.items() if k.startswith("docs"))
    if name in ("stage2_step", "deepspeed_zero3"):
        parts = []
        for v in ("8mla8gdn", "4mla12m2"):
            if v in res:
                top = max((k for k in res[v] if k.startswith("T")), key=lambda k: int(k[1:]))
                r = res[v][top]
                if "error" in r:
                    parts.append(f"{v} {top}: {r['error']['type']}")
                    continue
                parts.append(f"{v} {top}: {f(r['seconds'])} s, {f(r['tokens_per_s'], 4)} tok/s, "
                             f"peak {f(r['peak_gib'])} GiB, syncs {res[v]['host_syncs_per_step']['count']}")
        return "; ".join(parts)
    if name == "decode":
        if not any(k.startswith("cache_ratio") for k in res):
            return "no context ran on both models"
        top = max((k for k in res if k.startswith("cache_ratio")), key=lambda k: int(k.split("ctx")[1]))
        c = top.split("ctx")[1]
        return (f"ctx {c}: hylo {f(res['hylo_8mla8gdn'][f'ctx{c}']['decode_tokens_per_s'])} tok/s, llama "
                f"{f(res['llama_3.2_1b'][f'ctx{c}']['decode_tokens_per_s'])} tok/s, cache ratio {f(res[top])}")
    return ""


# what a run writes into --out (and, with --case-seconds, into each --out/case_N with the child's log.txt)
REPORT_FILES = ("gpu_check.json", "gpu_check.md")


def check_outputs(args: argparse.Namespace) -> None:
    """Before any case runs: every file the check will write is one this project wrote or a new one
    (`hylo.files.check_output_file`; `--force` replaces files of the user's), and --out can be written."""
    from hylo.files import check_output_file

    out = Path(args.out)
    paths = [out / name for name in REPORT_FILES]
    if args.case_seconds is not None:
        paths += [out / f"case_{int(c)}" / name for c in args.cases.split(",") if c.strip()
                  for name in (*REPORT_FILES, "log.txt")]
    for p in paths:
        check_output_file(p, "--out", force=args.force)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--force", action="store_true",
                    help="replace files of the report's names in --out that this project did not write")
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (the test of this script)")
    ap.add_argument("--cases", default="1,2,3,4,5,6", help="comma-separated case numbers")
    ap.add_argument("--bypass-fla-hopper-guard", action="store_true",
                    help="measure only: let fla 0.6 run its gated backward (chunk_bwd_dqkwg) on Hopper with "
                         "Triton 3.4-3.7.0, which fla refuses since it is known to give wrong results there "
                         "(fla issue #640); the report says so and case 2 shows how wrong")
    ap.add_argument("--case-seconds", type=float, default=None,
                    help="run each case in a process of its own, stopped after this many seconds (a hang or a "
                         "slow first compilation costs that case, not the loan); the figures are merged as they come")
    ap.add_argument("--deadline", type=float, default=None,
                    help="with --case-seconds: no case runs past this many seconds from the start")
    args = ap.parse_args(argv)
    check_outputs(args)
    if args.case_seconds is not None:
        from hylo.stopping import stopping

        # SIGTERM / Ctrl-C end the running case's process group too (hylo/stopping.py)
        with stopping("gpu-check"):
            return run_isolated(args)
    if args.tiny:
        # case 1 runs the fused KL's Triton kernel through Triton's interpreter (slow: small shapes);
        # fla has no CPU path, so everything else takes the torch path
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # DeepSpeed's CPU ops are built once into the Makefile's cache (make test sets the same folder)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))
    import torch

    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shapes = TINY if args.tiny else FULL
    meter = Meter(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "tiny": args.tiny, "device": str(device), "versions": versions(), "cases": {}}
    if args.bypass_fla_hopper_guard:
        report["fla_hopper_guard_bypassed"] = bypass_fla_hopper_guard()
    t_all = time.perf_counter()
    for number in (int(c) for c in args.cases.split(",") if c.strip()):
        name, fn = CASES[number]
        t0 = time.perf_counter()
        print(f"[gpu_check] case {number} {name} ...", flush=True)
        try:
            with kernels_mode("triton" if args.tiny and number == 1 else os.environ.get("HYLO_KERNELS", "auto")):
                res = fn(shapes, device, meter)
        except Exception as exc:  # recorded; the next case runs
            res = {"ok": False, "error": error_record(exc)}
        res["case_seconds"] = time.perf_counter() - t0
        report["cases"][name] = res
        gc.collect()
        free_memory()
        print(f"[gpu_check] case {number} {name}: ok={res.get('ok')} in {res['case_seconds']:.1f} s", flush=True)
        write(out_dir, report)
    report["total_seconds"] = time.perf_counter() - t_all
    # the estimates beside the measured memory figures that could not be made (pipeline/estimate/)
    report["estimate_errors"] = ESTIMATE_ERRORS
    write(out_dir, report)
    print(markdown(report))
    return 0 if all(r.get("ok") for r in report["cases"].values()) else 1


def run_isolated(args: argparse.Namespace) -> int:
    """Each case in a child process (`--cases N --out OUT/case_N`) under a time limit, merged into OUT after each.

    The parent imports no torch, so the children have the GPU to themselves. A child stopped at its limit is
    recorded as a case that failed with a TimeoutExpired error, with the end of its output."""
    import subprocess

    from hylo.files import atomic_write, record_files
    from hylo.stopping import end_process, make_dir, popen

    out_dir = make_dir(args.out)
    flags = [f for f, on in (("--tiny", args.tiny), ("--bypass-fla-hopper-guard", args.bypass_fla_hopper_guard),
                             ("--force", args.force)) if on]
    t0 = time.perf_counter()
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "tiny": args.tiny, "device": None, "versions": {}, "cases": {},
                              "isolated": {"case_seconds": args.case_seconds, "deadline": args.deadline}}
    for number in (int(c) for c in args.cases.split(",") if c.strip()):
        name = CASES[number][0]
        limit = args.case_seconds
        if args.deadline is not None:
            left = args.deadline - (time.perf_counter() - t0)
            if left < min(limit, 10.0):
                report["cases"][name] = {"ok": False, "skipped": "the deadline passed before this case could start"}
                continue
            limit = min(limit, left)
        child_out = out_dir / f"case_{number}"
        cmd = [sys.executable, str(Path(__file__).resolve()), *flags, "--cases", str(number), "--out", str(child_out)]
        print(f"[gpu_check] case {number} {name}: own process, at most {limit:.0f} s", flush=True)
        t_case = time.perf_counter()
        proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=limit)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            # the case's whole process group (a compile's workers too)
            end_process(proc)
            log, _ = proc.communicate()
            rc = None
        child_out.mkdir(parents=True, exist_ok=True)
        atomic_write(child_out / "log.txt", log)
        record_files(child_out, ["log.txt"])
        print("\n".join(f"    {line}" for line in log.splitlines() if line.startswith("[gpu_check]")), flush=True)
        child = child_out / "gpu_check.json"
        if rc is not None and child.is_file():
            data = json.loads(child.read_text())
            report["cases"].update(data["cases"])
            report["device"], report["versions"] = data["device"], data["versions"]
            if "fla_hopper_guard_bypassed" in data:
                report["fla_hopper_guard_bypassed"] = data["fla_hopper_guard_bypassed"]
        else:
            why = f"stopped after {limit:.0f} s" if rc is None else f"exit status {rc}, no report"
            report["cases"][name] = {"ok": False, "case_seconds": time.perf_counter() - t_case,
                                     "error": {"type": "TimeoutExpired" if rc is None else "ChildFailed",
                                               "message": why, "traceback": log.splitlines()[-12:]}}
        write(out_dir, report)
    report["total_seconds"] = time.perf_counter() - t0
    write(out_dir, report)
    print(markdown(report))
    return 0 if all(r.get("ok") for r in report["cases"].values()) else 1


def bypass_fla_hopper_guard() -> bool:
    """Turn off fla's refusal of its gated backward on Hopper with Triton < 3.7.1 (fla #640), for this
    process only; True if the guard would have applied (the figures then come from a known-bad Triton)."""
    import fla.ops.common.chunk_o as chunk_o

    applies = bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return applies


def write(out_dir: Path, report: dict[str, Any]) -> None:
    from hylo.files import atomic_write, record_files

    atomic_write(out_dir / "gpu_check.json", json.dumps(report, indent=1, default=str, allow_nan=True) + "\n")
    atomic_write(out_dir / "gpu_check.md", markdown(report))
    # recorded as ours: a later run may replace them (check_outputs)
    record_files(out_dir, REPORT_FILES)


if __name__ == "__main__":
    sys.exit(main())
