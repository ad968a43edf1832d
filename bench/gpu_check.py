"""One prepared check of every GPU path of the project, at the released models' shapes.

    python bench/gpu_check.py --out OUT_DIR --isolated   # on one GPU, under the time plan: at most 8 minutes
    python bench/gpu_check.py --out OUT_DIR              # the same in this process, no budgets
    python bench/gpu_check.py --out OUT_DIR --tiny       # the same code at small shapes on CPU (minutes)
    python bench/gpu_check.py --out OUT_DIR --cases 4,5  # a subset, in this order

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
   the 1B recipe's shape, 8MLA8GDN and 4MLA12M2 students (an all-MLA student of the same shape in place of
   one whose linear layers have no correct backward on this stack), an 8B-shaped in-process teacher, fused KL
   over hidden states, activation checkpointing, AdamW: peak memory beside the estimate, step time, tokens/s,
   MFU, the host synchronisations of one step, and a torch.profiler summary of one step;
5. decode: generated tokens/s and cache bytes of the 1B HyLo shape against the Llama-3.2-1B shape;
6. the same step through the project's DeepSpeed engine (ZeRO-3, world size 1), if DeepSpeed imports;
7. served decoding in vLLM (bench/serve_decode.py): the HyLo 1B and 3B recipe shapes against the Llama-3.2-1B and
   3B shapes at 8K-64K, output tokens/s at batch 1 and at the largest batch that fits, KV bytes per token and the
   most concurrent 64K sequences in the same memory; where vLLM does not import (the GPU machines this project is
   lent), one line saying so, and the computed figures;
8. `train.compile: blocks` against the eager step (bench/compile_step.py) on 4 layers of the 1B student, rows of
   1-6 documents: time of each, recompiles after the first row, graph breaks, host synchronisations per step.
   Not in the 8-minute plan (its budgets take 470 of the 480 s): `--cases 8` runs it, budget `EXTRA_BUDGETS`.

Order and time: the cases run in the plan's order (`PLAN`: the most informative first), and so do the sizes
within a case (the 64K step, decode at 64K, first); with --isolated each case runs in a process of its own under
its budget, and every measurement is written to disk as it is made, so that a case stopped at its budget, or a
loan cut short, keeps what it measured (docs/gpu-check.md#plan).
Timing: a first call, timed on its own (compilation, autotuning: `first_call_seconds`), then the steady-state
call with device events (CUDA) or perf_counter (CPU) around a synchronised region. Memory: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus what was
allocated before (so "extra" is what the measured call itself added); None on CPU. Models have random
weights (no weights travel); figures that depend on the weights' values (losses) are only sanity checks.
`--tiny` uses small shapes, the Triton interpreter for the fused KL and the torch path elsewhere, so
that `tests/kernels/test_gpu_check.py` keeps this script running between loans.
Beside every memory figure measured, the step estimate's figure for the same call (`estimated_*`:
pipeline/estimate/, the call on fake tensors; `hylo estimate`), so the first GPU run also checks
the estimator; an estimate that fails is listed in `estimate_errors` and fails no case. The estimates are made
after the measured figures are written (the step's in CPU processes beside the cases when isolated), and the
step's FLOPs give its MFU on this GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.metadata as md
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# torch, and whatever imports it, is imported inside functions ("# lazy: torch"): `main` sets TRITON_INTERPRET and
# TORCH_EXTENSIONS_DIR first, and the --isolated parent imports no torch (its children have the GPU to themselves).

from hylo.outputs import check_output_file, write_output_file  # noqa: E402
from hylo.ownership import record_files  # noqa: E402
from hylo.pipeline.estimate import GPUS  # noqa: E402  (the package's names load on use: no torch here)
from hylo.pipeline.train.config import Stage2Config, load_stage_config  # noqa: E402
from hylo.stopping import end_process, make_dir, popen, stopping  # noqa: E402
from hylo.upcycle.options import hybrid_config_from_base  # noqa: E402

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
    compile: dict[str, int] = dataclasses.field(default_factory=lambda: {"T": 8192, "rows": 6})


FULL = Shapes(
    kl={"N": 16384, "H": 2048, "V": 128256, "HT": 4096, "k": 64},
    linear={"T": 16384, "docs": 8},
    mla={"T": 65536, "docs": (8, 64)},
    # in the order measured: the key figures first (the 64K step of the 1B recipe, decode at 64K)
    step={"tokens": (65536, 8192, 16384, 32768), "doc_tokens": 8192},
    decode={"context": (65536, 32768, 8192), "new_tokens": 32},
    deepspeed_tokens=16384,
    tiny=False,
)
TINY = Shapes(
    kl={"N": 24, "H": 16, "V": 64, "HT": 24, "k": 8},
    linear={"T": 96, "docs": 3},
    mla={"T": 256, "docs": (2, 16)},
    step={"tokens": (64,), "doc_tokens": 32},
    decode={"context": (64, 32), "new_tokens": 4},
    deepspeed_tokens=64,
    tiny=True,
    compile={"T": 64, "rows": 4},
)


# ------------------------------------------------------------------------------------ measuring
class Meter:
    """Time and peak extra memory of a callable on one device (see the module docstring), and the record of
    every measurement: `log` holds each call's first-call seconds (its warm-up: compilation, autotuning,
    allocations) apart from its steady-state seconds, and `on_measure` (the driver's write of the partial
    report) runs after each one, so a case stopped at its budget leaves what it had measured on disk.
    `publish` names the dict a case fills as it goes: the partial report holds it as the case's figures."""

    def __init__(self, device: Any, on_measure: Callable[[bool], None] | None = None) -> None:
        import torch  # lazy: torch

        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.on_measure = on_measure
        self.log: list[dict[str, Any]] = []
        self.partial: dict[str, Any] = {}

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def publish(self, out: dict[str, Any]) -> dict[str, Any]:
        self.partial = out
        return out

    def run(self, fn: Callable[[], Any], warmup: bool = True, label: str | None = None) -> tuple[Any, float, int | None]:
        """(result of the timed call, seconds, peak bytes allocated beyond those live before it).

        With `warmup`, a first call runs before, timed on its own (on CPU too: the first-call figure exists
        on every device)."""
        torch = self.torch
        name = label or call_name(fn)
        if label is None and any(m["call"].split(" #")[0] == name for m in self.log):
            name += f" #{1 + sum(m['call'].split(' #')[0] == name for m in self.log)}"
        # the figures the case recorded since the last measurement, on disk before this one starts
        self.checkpoint(starting=True)
        first = None
        if warmup:
            t_call = time.perf_counter()
            fn()
            self.sync()
            first = time.perf_counter() - t_call
            print(f"[gpu_check]   first call of {name}: {first:.1f} s", flush=True)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.sync()
            seconds, extra = start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated(self.device) - base
        else:
            t0 = time.perf_counter()
            out = fn()
            seconds, extra = time.perf_counter() - t0, None
        self.measured(name, first, seconds, extra)
        return out, seconds, extra

    def measured(self, name: str, first: float | None, seconds: float, extra: int | None) -> None:
        """Record one measurement and write the partial report."""
        self.log.append({"call": name, "first_call_seconds": first, "steady_seconds": seconds,
                         "peak_extra_gib": gib(extra)})
        self.checkpoint()

    def checkpoint(self, starting: bool = False) -> None:
        """Write the partial report now (after a measurement, after figures a case adds, before a measurement
        `starting`)."""
        if self.on_measure is not None:
            self.on_measure(starting)

    def totals(self) -> dict[str, Any]:
        """The case's first-call seconds (every measured call's warm-up) apart from its steady-state seconds."""
        return {"first_call_seconds": sum(m["first_call_seconds"] or 0.0 for m in self.log),
                "steady_seconds": sum(m["steady_seconds"] for m in self.log), "measurements": list(self.log)}


def call_name(fn: Callable[..., Any]) -> str:
    """A measured call's name for the log: its qualified name without the `<locals>` steps."""
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", "a call").replace("<locals>.", "")


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
    from hylo.kernels.backend import forced_mode  # lazy: torch

    return forced_mode(mode.lower())


class Later:
    """An estimate made after the case's measurements: `estimated_gib` returns one, the driver writes the
    measured figures first and then `resolve_estimates()` makes every pending one (in the report, its value;
    null until then). The estimate runs the call on the CPU, on fake tensors, and takes seconds to minutes
    at the released shapes: made inline, it held up the figures a time limit could then lose."""

    pending: list[Later] = []

    def __init__(self, setup: Callable[[], Any], run: Callable[[Any], Any]) -> None:
        self.setup, self.run = setup, run
        self.value: float | None = None
        Later.pending.append(self)

    def resolve(self) -> None:
        from hylo.pipeline.estimate import estimate_call  # lazy: torch

        try:
            self.value = gib(estimate_call(self.setup, self.run))
        except Exception as exc:  # recorded, never fatal for the case
            ESTIMATE_ERRORS.append(f"{type(exc).__name__}: {exc}"[:500])
        self.setup = self.run = None  # type: ignore[assignment]  # the case's tensors go


def resolve_estimates() -> None:
    while Later.pending:
        Later.pending.pop(0).resolve()


def estimated_gib(setup: Callable[[], Any], run: Callable[[Any], Any]) -> Later:
    """The step estimate's figure for a measured call (pipeline/estimate/step.estimate_call: the same call
    on fake CPU tensors, torch kernel paths, the accelerator's rules): its peak beyond its inputs, in GiB,
    recorded beside the measured `peak_extra_gib` so that a GPU run also checks the estimator. Made once the
    case's measurements are written (`Later`); None (with the error in `estimate_errors`) when it fails: the
    measured case still counts."""
    return Later(setup, run)


def json_value(x: Any) -> Any:
    """json.dumps' fallback: an estimate's value (None while pending), str for anything else."""
    return x.value if isinstance(x, Later) else str(x)


ESTIMATE_ERRORS: list[str] = []


def fake_build(factory: Callable[[], Any], dtype: Any):
    """`build(factory, cpu, dtype)` on the estimate's fake tensors (a module cannot be cast there in place)."""
    import torch  # lazy: torch

    from hylo.pipeline.estimate import cast_parameters  # lazy: torch

    with torch.device("cpu"):
        return cast_parameters(factory(), dtype)


def free_memory() -> None:
    # no gc.collect here (about a second per call with transformers loaded): tensors die by refcount
    import torch  # lazy: torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ shapes
def llama_config(kind: str, tiny: bool):
    """Llama-3.2-1B / Llama-3.1-8B shapes (random weights), or small stand-ins for --tiny."""
    from transformers import LlamaConfig  # lazy: torch

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
    as released, `4mla12m2` (4 MLA layers, 12 Mamba-2, the paper's memory comparison), or `all_mla` (every
    layer MLA: the step's stand-in where the stack has no correct GDN / Mamba-2 backward)."""
    convert = load_stage_config(1, CONFIG_1B).model.convert
    if tiny:
        convert = dataclasses.replace(convert, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                      qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16,
                                      max_position_embeddings=4096, yarn_original_max_position_embeddings=128)
    n = 4 if tiny else 16
    if variant == "4mla12m2":
        convert = dataclasses.replace(convert, linear_type="mamba2", mla_layers=[0, n - 1] if tiny else [0, 5, 10, 15])
    elif variant == "all_mla":
        convert = dataclasses.replace(convert, mla_layers=list(range(n)))
    with warnings.catch_warnings():
        # the base's RoPE scaling is replaced by YaRN in the MLA layers (the recipe's choice)
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(llama_config("1b", tiny), convert)


def build(cls_or_fn: Callable[[], Any], device: Any, dtype: Any):
    """A model with random weights, initialised on the device (an 8B model is slow to initialise on CPU)."""
    import torch  # lazy: torch

    with torch.device(device):
        model = cls_or_fn()
    return model.to(dtype)


def packed_row(T: int, docs: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """A packed row of `docs` documents of (nearly) equal length, every label scored but each document's last."""
    rng = np.random.default_rng(seed)
    cu = np.linspace(0, T, docs + 1).round().astype(np.int32)
    pos = np.concatenate([np.arange(e - s) for s, e in zip(cu[:-1], cu[1:])])
    mask = np.ones(T, dtype=bool)
    mask[cu[1:] - 1] = False
    return {"input_ids": rng.integers(0, vocab, T), "cu_seqlens": cu, "position_ids": pos, "loss_mask": mask}


# ------------------------------------------------------------------------------------ case 1
def case_fused_kl(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    """Our fused KL in each precision mode (`fused`: accurate, the op's default; `fused_fast`, stage 2's) against the full-logits
    reference and Liger's fused JSD, for the hidden-state and the top-k teachers, and our fused CE against the
    full-logits CE and cut-cross-entropy's where it imports: time, TFLOP performed and rate, extra memory,
    loss and gradient errors against the fp32 reference (returned in bf16)."""
    import torch  # lazy: torch

    from hylo.kernels.backend import use_gpu_kernels  # lazy: torch
    from hylo.kernels.fused_kl import (  # lazy: torch
        fused_linear_cross_entropy,
        fused_linear_kl_div,
        naive_cross_entropy,
        naive_kl_div,
        topk_from_logits,
    )
    from hylo.kernels.fused_kl.gemm import PRECISIONS  # lazy: torch

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
        from hylo.pipeline.estimate import fake_like  # lazy: torch

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
    import torch  # lazy: torch

    from hylo.kernels.fused_kl import TeacherTopK  # lazy: torch

    parts = [topk_from_logits(th[s:s + chunk].float() @ tw.float().t(), k, dtype=torch.float32)
             for s in range(0, th.shape[0], chunk)]
    return TeacherTopK(*(torch.cat([p[i] for p in parts]) for i in range(3)))


def liger_jsd(h, w, th, tw, meter: Meter, ref_loss, ref_dh, ref_dw) -> dict[str, Any]:
    """Liger-Kernel's chunked fused linear JSD at beta = 0 (forward KL(teacher || student)), mean over tokens."""
    import torch  # lazy: torch

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # optional: liger
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
        from cut_cross_entropy import linear_cross_entropy  # optional: cce
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
    import torch  # lazy: torch

    from hylo.kernels.backend import use_fla  # lazy: torch
    from hylo.kernels.gdn import chunk_gated_delta_rule  # lazy: torch
    from hylo.kernels.ssd import chunk_ssd  # lazy: torch
    from hylo.kernels.varlen import DocBounds  # lazy: torch
    from hylo.modeling import build_mixer  # lazy: torch

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
            from hylo.pipeline.estimate import fake_like  # lazy: torch

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
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch

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
    import torch  # lazy: torch

    from hylo.kernels import packed_sdpa  # lazy: torch
    from hylo.kernels.varlen import DocBounds  # lazy: torch
    from hylo.layers.mla import MLAttention  # lazy: torch

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
            (y, dx), t, m = meter.run(go, label=f"mla {impl} docs{docs}")
            results[impl] = (y, dx)

            def mla_fwd_bwd(state, impl=impl, bounds=DocBounds.from_host(packed_row(T, docs, 8)["cu_seqlens"], T, "cpu")):
                mod, xi = state
                xi = xi.detach().requires_grad_()
                with packed_sdpa.implementation(impl):
                    mod(xi, cu_seqlens=bounds).float().square().mean().backward()

            def fake_mla():
                from hylo.pipeline.estimate import fake_like  # lazy: torch

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
    import torch  # lazy: torch

    from hylo.modeling import HyLoForCausalLM  # lazy: torch
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec  # lazy: torch
    from hylo.pipeline.train import stage2  # lazy: torch
    from hylo.pipeline.train.plain_engine import plain_engine  # lazy: torch

    cfg = stage2_cfg(engine)
    hcfg = hylo_config(variant, sh.tiny)
    torch.manual_seed(0)
    task = stage2.build(solo_context(cfg, device, dtype), lambda step: 1.0,
                        student=lambda: build(lambda: HyLoForCausalLM(hcfg), device, dtype),
                        engine=plain_engine(cfg.optim) if engine == "plain" else None,
                        teacher=lambda vocab: BoundTeacher(teacher_model, TargetSpec(cfg.teacher.k, cfg.teacher.form),
                                                           vocab))
    # ZeRO-3 partitions the parameters: ds_numel is each one's full size
    return task, sum(getattr(p, "ds_numel", p.numel()) for p in task.student.parameters() if p.requires_grad)


def stage2_cfg(engine: str):
    """The measured step's config: one row of one process, checkpointing, fused KL over hidden states."""
    cfg = Stage2Config()
    cfg.deepspeed.zero_stage = 3 if engine == "deepspeed" else 0
    cfg.train.global_batch_sequences = 1
    cfg.ray.num_workers = 1  # one process: the micro-batches per step are global_batch_sequences / num_workers
    cfg.model.activation_checkpointing = True
    cfg.teacher.k = 0
    cfg.kd.chunk_size = None
    return cfg


def teacher_8b(sh: Shapes, device: Any, dtype: Any):
    from transformers import LlamaForCausalLM  # lazy: torch

    from hylo.pipeline.teacher.model import TeacherModel  # lazy: torch

    cfg = llama_config("8b", sh.tiny)
    cfg._attn_implementation = "sdpa"
    model = build(lambda: LlamaForCausalLM(cfg), device, dtype)
    max_tokens = max(sh.step["tokens"])
    return TeacherModel(model, dtype=dtype, device=device, isolation="per_doc", max_forward_tokens=max_tokens)


def solo_context(cfg: Any, device: Any, dtype: Any):
    """A WorkerContext of one rank whose all-reduce is the identity (no process group needed)."""
    from hylo.pipeline.train.worker import SoloContext  # lazy: torch

    return SoloContext(cfg=cfg, rank=0, world_size=1, device=device, dtype=dtype, run_dir=Path("."), grad_accum=1)


def count_syncs(fn: Callable[[], Any], device: Any) -> dict[str, Any]:
    """Host synchronisations of one call: CUDA's sync debug mode on a GPU, the host-read log on CPU."""
    from hylo.kernels.fused_kl.inputs import deferred_checks  # lazy: torch
    from hylo.kernels.host_reads import HostReadLog, cuda_sync_log  # lazy: torch

    if device.type == "cuda":
        with cuda_sync_log() as messages:
            fn()
        return {"counter": "torch.cuda.set_sync_debug_mode('warn')", "count": len(messages),
                "first": messages[:8]}
    with deferred_checks(), HostReadLog() as log:
        fn()
    return {"counter": "hylo.kernels.host_reads.HostReadLog (CPU, GPU rule)", "count": len(log.reads),
            "reads": [f"{name} at {where}" for name, where in log.reads][:40]}


# the students the step case measures, in order; a student whose linear layers have no correct fla backward on
# this stack (kernels/backend.check_fla_backward) is replaced by an all-MLA student of the same shape
STEP_VARIANTS = {"8mla8gdn": "gdn", "4mla12m2": "mamba2"}


def step_variants(device: Any, engine: str, bypass: bool) -> tuple[list[str], dict[str, str]]:
    """(the students to time, {student: why it was replaced}). With --bypass-fla-hopper-guard the GDN and
    Mamba-2 students run anyway (measure only)."""
    wanted = list(STEP_VARIANTS) if engine == "plain" else ["8mla8gdn"]
    problems = {} if bypass else {v: p for v in wanted if (p := fla_route_problem(device, {STEP_VARIANTS[v]}))}
    variants = [v for v in wanted if v not in problems]
    if problems:
        variants.insert(0, "all_mla")  # the teacher, loss, optimizer (and ZeRO-3) parts are measured either way
    return variants, problems


def fla_route_problem(device: Any, kinds: set[str]) -> str | None:
    """kernels/backend.check_fla_backward's refusal for layers of `kinds` on `device` (None: a correct route)."""
    from hylo.kernels.backend import GpuStackError, check_fla_backward  # lazy: torch

    try:
        check_fla_backward(device, kinds)
    except GpuStackError as exc:
        return str(exc)
    return None


def case_step(sh: Shapes, device: Any, meter: Meter, engine: str = "plain") -> dict[str, Any]:
    """The stage-2 step, the key figures first: the first student at the key size (the first of
    `sh.step["tokens"]`, 64K), its profile (plain engine), then the other sizes, its host synchronisations (at
    the smallest size), then the next student. Each size: its first call (a new length may compile or tune again) apart from its steady step."""
    import torch  # lazy: torch

    from hylo.pipeline.data.rows import check_row  # lazy: torch
    from hylo.pipeline.train.stage2 import train_step  # lazy: torch

    dtype = torch.float32 if sh.tiny else torch.bfloat16
    variants, replaced = step_variants(device, engine, BYPASS_GUARD[0])
    sizes = sh.step["tokens"] if engine == "plain" else (sh.deepspeed_tokens,)
    out = meter.publish({"teacher": "Llama-3.1-8B shape" if not sh.tiny else "tiny Llama", "dtype": str(dtype)[6:],
                         "activation_checkpointing": True, "kl": "fused over hidden states",
                         "sizes_in_order": list(sizes), "students": variants,
                         "paper_1b_4mla12m2_64k_gib": PAPER_64K_GIB})
    if replaced:
        out["no_correct_linear_route"] = replaced
    teacher = teacher_8b(sh, device, dtype)
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.model.parameters())
    out["teacher_weights_gib"] = gib(teacher_bytes)
    for n, variant in enumerate(variants):
        task, n_params = stage2_task(variant, sh, device, dtype, teacher, engine)
        ctx = solo_context(task.cfg, device, dtype)
        vocab = task.student.config.vocab_size
        res: dict[str, Any] = out.setdefault(variant, {"parameters": n_params})
        rows = {T: check_row(packed_row(T, max(1, T // sh.step["doc_tokens"]), vocab, seed=2)) for T in sizes}
        for i, T in enumerate(sizes):
            free_memory()
            step = functools.partial(train_step, task, [rows[T]], ctx)
            try:  # one size out of memory still leaves the others' figures
                result, seconds, _ = meter.run(step, label=f"{engine} step {variant} T{T}")
            except Exception as exc:
                res[f"T{T}"] = {"finite": False, "error": error_record(exc)}
                meter.checkpoint()
                continue
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            m = meter.log[-1]
            res[f"T{T}"] = {"first_call_seconds": m["first_call_seconds"], "seconds": seconds,
                            "tokens_per_s": T / seconds, "peak_gib": gib(peak),
                            "peak_without_teacher_weights_gib": gib(None if peak is None else peak - teacher_bytes),
                            "kl_sum": result.sums["kl_sum"], "grad_norm": result.grad_norm,
                            "finite": math.isfinite(result.sums["kl_sum"])}
            meter.checkpoint()
            if i == 0 and n == 0 and engine == "plain":
                out["profile"] = {"student": variant, "tokens": T, **profile_summary(step, device)}
                meter.checkpoint()
        res["host_syncs_per_step"] = count_syncs(functools.partial(train_step, task, [rows[min(sizes)]], ctx), device)
        res["host_syncs_per_step"]["tokens"] = min(sizes)
        meter.checkpoint()
        del task
        free_memory()
    if STEP_ESTIMATES_INLINE[0]:
        gpu = gpu_name(device)
        for variant in variants:
            for T in sizes:
                if "seconds" in out[variant].get(f"T{T}", {}):
                    add_step_estimate(out[variant][f"T{T}"], step_estimate(variant, sh, T, dtype), gpu)
    out["ok"] = all(out[v].get(f"T{T}", {}).get("finite", False) for v in variants for T in sizes)
    return out


# set by the driver: --bypass-fla-hopper-guard; the step estimates made by the case itself (False when the
# isolated driver makes them in processes beside the cases)
BYPASS_GUARD = [False]
# the least time case 7 is given to start vLLM's engines (the plan's 40 s is for the machines without vLLM)
SERVE_MIN_SECONDS = 120.0
# the running case's limit in seconds (--isolated: its budget with what earlier cases left), None without one
CASE_LIMIT: list[float | None] = [None]
STEP_ESTIMATES_INLINE = [True]


def profile_summary(fn: Callable[[], Any], device: Any, rows: int = 15) -> dict[str, Any]:
    """`torch.profiler` over one call: the top kernels by device time on a GPU (the top ops by their own CPU
    time on CPU), with their calls and share, and the profiler's own table. A failure is recorded."""
    import torch  # lazy: torch
    from torch.profiler import ProfilerActivity, profile  # lazy: torch

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        avgs = prof.key_averages()
        if cuda:
            from torch.autograd import DeviceType  # lazy: torch

            def own(e):  # microseconds on the device (torch < 2.4 called it cuda time)
                return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

            events = [e for e in avgs if getattr(e, "device_type", None) == DeviceType.CUDA]
            sort_by, what = "self_device_time_total", "kernels by device time"
        else:
            def own(e):
                return e.self_cpu_time_total

            events = list(avgs)
            sort_by, what = "self_cpu_time_total", "ops by their own CPU time"
        total = sum(own(e) for e in events) or 1.0
        top = sorted(events, key=own, reverse=True)[:rows]
        try:
            table = avgs.table(sort_by=sort_by, row_limit=rows, max_name_column_width=70)
        except Exception as exc:  # the figures above stand without the table
            table = f"(no table: {type(exc).__name__}: {exc})"
        summary = {"what": what, "wall_seconds": seconds, "total_ms": total / 1e3,
                   "top": [{"name": e.key[:160], "calls": e.count, "ms": own(e) / 1e3, "share": own(e) / total}
                           for e in top],
                   "table": table}
    except Exception as exc:  # the step's figures count without the profile
        return {"error": error_record(exc)}
    print(f"[gpu_check]   profile of one step ({what}):", flush=True)
    for e in summary["top"][:10]:
        print(f"[gpu_check]     {e['share']:6.1%} {e['ms']:10.2f} ms {e['calls']:6d}x  {e['name'][:90]}", flush=True)
    return summary


def gpu_name(device: Any) -> str | None:
    import torch  # lazy: torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def step_estimate(variant: str, sh: Shapes, T: int, dtype: Any) -> dict[str, Any]:
    """`hylo estimate`'s figures for the measured step (pipeline/estimate/step.estimate_step: the same
    step on fake tensors, world size 1, the accelerator's rules, the same row layout): its peak (to compare
    with `peak_gib`), its peak over its start, its FLOPs and the step's seconds at each GPU's peak rate. The
    DeepSpeed case's step is estimated as this one (ZeRO-3 at world size 1 partitions nothing)."""
    from hylo.pipeline.estimate import Shapes as StepShapes  # lazy: torch
    from hylo.pipeline.estimate import estimate_step  # lazy: torch

    t0 = time.perf_counter()
    try:
        cfg = stage2_cfg("plain")
        m = cfg.teacher.model
        teacher = dataclasses.replace(m, dtype=str(dtype).removeprefix("torch."), isolation="per_doc",
                                      max_forward_tokens=max(sh.step["tokens"]))
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, model=teacher))
        doc = T // max(1, T // sh.step["doc_tokens"])
        est = estimate_step(cfg, T, 1, dtype, gpu=True, doc_tokens=(doc, doc),
                            shapes=StepShapes(hylo_config(variant, sh.tiny), teacher=llama_config("8b", sh.tiny)))
        at_peak, pricing = peak_seconds(est)
    except Exception as exc:  # recorded, never fatal for the case
        return {"estimate_error": f"{type(exc).__name__}: {exc}"[:500]}
    return {"estimated_peak_gib": gib(int(est.peak_bytes)),
            "estimated_extra_over_start_gib": gib(int(est.peak_bytes - est.start_bytes)),
            "estimated_flops": est.total_flops, "estimated_seconds_at_peak": at_peak, "peak_pricing": pricing,
            "estimate_seconds": time.perf_counter() - t0}


def peak_seconds(est: Any) -> tuple[dict[str, float], str]:
    """The estimated step's seconds at each listed GPU's peak rate, and how they were priced: the one call
    into the estimator's rates (pipeline/estimate/gpus.py). Where the estimator prices each dtype's FLOPs at
    that dtype's rate (`Estimate.seconds_at_peak(gpu)`), that; otherwise every FLOP at the dense bf16 peak."""
    priced = getattr(est, "seconds_at_peak", None)
    if callable(priced):
        return {g.name: float(priced(g)) for g in GPUS}, "each dtype's FLOPs at its rate (the estimator's)"
    return {g.name: g.seconds(est.total_flops) for g in GPUS}, "every FLOP at the dense bf16 peak"


def add_step_estimate(entry: dict[str, Any], est: dict[str, Any], gpu: str | None) -> None:
    """The estimate's figures beside one measured step, and its MFU: the estimated step's seconds at this
    GPU's peak over the measured steady-state seconds (None on a GPU the estimator does not list, or on CPU)."""
    entry.update(est)
    at_peak = est.get("estimated_seconds_at_peak") or {}
    name = next((g for g in at_peak if gpu and g in gpu), None)
    entry["mfu"] = at_peak[name] / entry["seconds"] if name and entry.get("seconds") else None
    entry["mfu_gpu"] = name


def case_deepspeed(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:
        return {"ok": True, "skipped": f"deepspeed does not import: {type(exc).__name__}: {exc}"[:300]}

    import torch.distributed as dist  # lazy: torch

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
    import torch  # lazy: torch

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
    """Greedy decoding after a prefill, HyLo against the Llama-3.2-1B shape at each context, the key context
    first (the first of `sh.decode["context"]`, 64K) and both models at a context before the next one; each
    measurement's first call (the prefill's and the single-token steps' compilation) apart from its steady run."""
    import torch  # lazy: torch
    from transformers import DynamicCache, LlamaForCausalLM  # lazy: torch

    from hylo.cache import HyLoCache  # lazy: torch
    from hylo.modeling import HyLoForCausalLM  # lazy: torch

    dtype = torch.float32 if sh.tiny else torch.bfloat16
    new = sh.decode["new_tokens"]
    out = meter.publish({"new_tokens": new, "batch": 1, "dtype": str(dtype)[6:],
                         "contexts_in_order": list(sh.decode["context"])})
    hcfg = hylo_config("8mla8gdn", sh.tiny)
    lcfg = llama_config("1b", sh.tiny)
    lcfg._attn_implementation = "sdpa"
    specs = {"hylo_8mla8gdn": (lambda: HyLoForCausalLM(hcfg), lambda n: HyLoCache(hcfg, max_length=n)),
             "llama_3.2_1b": (lambda: LlamaForCausalLM(lcfg), lambda n: DynamicCache())}
    models = {}
    for name, (make, _) in specs.items():
        torch.manual_seed(0)
        models[name] = build(make, device, dtype).eval()
        out[name] = {}
    for ctx_len in sh.decode["context"]:
        ids = torch.randint(0, lcfg.vocab_size, (1, ctx_len), device=device)
        for name, (make, make_cache) in specs.items():
            model, res = models[name], out[name]

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
                (cache, decode_s), total_s, extra = meter.run(prefill_and_decode, label=f"decode {name} ctx{ctx_len}")
            except Exception as exc:
                res[f"ctx{ctx_len}"] = {"error": error_record(exc), "cache_bytes": 0, "decode_tokens_per_s": math.nan}
                free_memory()
                meter.checkpoint()
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
                from hylo.pipeline.estimate import fake_like  # lazy: torch

                return fake_build(make, dtype).eval(), fake_like(ids)

            res[f"ctx{ctx_len}"] = {"decode_tokens_per_s": new / decode_s, "prefill_plus_decode_seconds": total_s,
                                    "first_call_seconds": meter.log[-1]["first_call_seconds"],
                                    "cache_bytes": cache_bytes(cache), "peak_extra_gib": gib(extra),
                                    "estimated_peak_extra_gib": estimated_gib(fake_model, fake_decode)}
            meter.checkpoint()
            print(f"[gpu_check] decode {name} ctx {ctx_len}: {time.perf_counter() - t_ctx:.1f} s", flush=True)
            del cache
            free_memory()
        a, b = out["hylo_8mla8gdn"][f"ctx{ctx_len}"], out["llama_3.2_1b"][f"ctx{ctx_len}"]
        if a["cache_bytes"] and b["cache_bytes"]:
            out[f"cache_ratio_ctx{ctx_len}"] = a["cache_bytes"] / b["cache_bytes"]
            out[f"speedup_ctx{ctx_len}"] = a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
        meter.checkpoint()
    del models
    free_memory()
    out["ok"] = all(out[m][f"ctx{c}"]["cache_bytes"] > 0 and math.isfinite(out[m][f"ctx{c}"]["decode_tokens_per_s"])
                    for m in specs for c in sh.decode["context"])
    return out


# ------------------------------------------------------------------------------------ case 7
def case_serve_decode(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    """bench/serve_decode.py's run (each model's vLLM engine in a process of its own, HyLo and Llama alternating)
    within this case's limit; its report, as it grows, is this case's figures. Skipped, with the computed
    figures, where vLLM does not import."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_decode", REPO / "bench" / "serve_decode.py")
    serve = sys.modules["serve_decode"] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(serve)  # type: ignore[union-attr]  # (its dataclasses look their module up)
    out = meter.publish({})

    def update(report: dict[str, Any]) -> None:
        out.clear()
        out.update(report)
        meter.checkpoint()

    # the case's own limit, less the time to start and to write (its process is stopped at the limit)
    seconds = CASE_LIMIT[0] - 30.0 if CASE_LIMIT[0] else None
    if seconds is not None and seconds < SERVE_MIN_SECONDS and not serve.vllm_missing():
        return {"ok": True, "skipped": f"vLLM imports here, but this case's limit ({CASE_LIMIT[0]:.0f} s) starts "
                f"no engine: run it alone, make gpu-check GPU_CHECK_FLAGS=\"--cases 7\" GPU_CASE_SECONDS=1800 "
                f"GPU_DEADLINE=1900"}
    report = serve.run(serve.TINY if sh.tiny else serve.FULL, seconds=seconds, on_update=update)
    meter.log.extend(report.get("measurements", []))
    out.update(report)
    return out


# ------------------------------------------------------------------------------------ case 8
def case_compile(sh: Shapes, device: Any, meter: Meter) -> dict[str, Any]:
    """`train.compile: blocks` against the eager step (bench/compile_step.py's `measure`): 4 layers of the 1B
    recipe's student (2 MLA, 2 GDN), rows of 1 to 6 documents; per row each step's time and the loss difference,
    the graphs compiled after the first row (recompiles), the graph breaks by call, the largest gradient
    difference, and the host synchronisations of each step (CUDA's sync debug mode; the host-read log on CPU).
    Backend inductor on a GPU; aot_eager with --tiny (the same graphs and guards, no code generation)."""
    import importlib.util

    import torch  # lazy: torch

    from hylo.config import HybridConfig  # lazy: transformers
    from hylo.modeling import HyLoForCausalLM  # lazy: torch

    spec = importlib.util.spec_from_file_location("compile_step", REPO / "bench" / "compile_step.py")
    bench = sys.modules["compile_step"] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    full = {k: v for k, v in hylo_config("8mla8gdn", sh.tiny).to_dict().items()
            if k not in ("model_type", "transformers_version", "architectures", "num_hidden_layers")}
    cfg = HybridConfig(**{**full, "n_layer": 4, "mla_layers": [0, 2]})
    dtype = torch.float32 if sh.tiny else torch.bfloat16
    T, n_rows = sh.compile["T"], sh.compile["rows"]
    res = bench.measure(lambda: HyLoForCausalLM(cfg).to(dtype), bench.random_rows(T, n_rows), device,
                        "aot_eager" if sh.tiny else "inductor", cfg.vocab_size)
    for path in ("eager", "compiled"):
        meter.measured(f"step {path}", res[f"first_row_{path}_s"], res[f"{path}_s_median"], None)
    res.update(shape={"T": T, "layers": 4, "mixers": [cfg.layer_type(i) for i in range(4)], "dtype": str(dtype)[6:]})
    tol = TOL["layer_fp32"] if sh.tiny else TOL["layer_bf16"]
    res["ok"] = (res["graphs_after_first_row"] == 0 and res["max_grad_rel_diff"] <= tol
                 and set(res["graph_breaks_by_call"]) <= {"chunk_gated_delta_rule", "packed_attention"})
    return res


# ------------------------------------------------------------------------------------ driver
CASES: dict[int, tuple[str, Callable[..., dict[str, Any]]]] = {
    1: ("fused_kl", case_fused_kl),
    2: ("gdn_mamba2", case_linear_layers),
    3: ("mla_packed", case_mla),
    4: ("stage2_step", case_step),
    5: ("decode", case_decode),
    6: ("deepspeed_zero3", case_deepspeed),
    7: ("serve_decode", case_serve_decode),
    8: ("compile", case_compile),
}


def versions() -> dict[str, Any]:
    import torch  # lazy: torch

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
            from hylo.kernels.backend import GpuStackError, check_fla_backward  # lazy: torch

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
    lines += ["| case | ok | seconds | first calls s | steady s | figures |", "| --- | --- | --- | --- | --- | --- |"]
    for name, res in report["cases"].items():
        try:
            figs = summary(name, res)
        except (KeyError, TypeError, ValueError) as exc:  # a case stopped part-way: its figures are in the JSON
            figs = f"partial ({type(exc).__name__} {exc} in the table's figures)"
        if res.get("stopped"):
            figs = f"{res['stopped']}; {len(res.get('measurements', []))} measurements kept; " + figs
        cells = [f"{res[k]:.1f}" if isinstance(res.get(k), int | float) else "-"
                 for k in ("case_seconds", "first_call_seconds", "steady_seconds")]
        lines.append(f"| {name} | {res.get('ok')} | {' | '.join(cells)} | {figs} |")
    if report.get("plan"):
        lines += ["", "Plan: " + ", ".join(f"case {c['case']} {c['name']} {c['budget_s']:.0f} s" for c in report["plan"])
                  + (f"; deadline {report['deadline_s']:.0f} s" if report.get("deadline_s") else "")]
    return "\n".join(lines) + "\n"


def summary(name: str, res: dict[str, Any]) -> str:
    """A few headline figures of one case for the table (all figures are in the JSON)."""
    if "error" in res and not res.get("stopped"):
        return f"{res['error']['type']}: {res['error']['message'][:120]}"
    if "skipped" in res:
        return res["skipped"][:200]

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
        parts = [f"no correct route for {', '.join(res['no_correct_linear_route'])}: all-MLA student"] \
            if res.get("no_correct_linear_route") else []
        for v in res.get("students", ()):
            if v not in res:
                continue
            sizes = [k for k in (f"T{t}" for t in res.get("sizes_in_order", ())) if k in res[v]]
            if not sizes:
                continue
            r = res[v][sizes[0]]
            if "error" in r:
                parts.append(f"{v} {sizes[0]}: {r['error']['type']}")
                continue
            syncs = res[v].get("host_syncs_per_step", {}).get("count", "-")
            parts.append(f"{v} {sizes[0]}: {f(r['seconds'])} s (first {f(r.get('first_call_seconds'))} s), "
                         f"{f(r['tokens_per_s'], 4)} tok/s, MFU {f(r.get('mfu'), 2)}, peak {f(r['peak_gib'])} GiB "
                         f"(est. {f(r.get('estimated_peak_gib'))}), syncs {syncs}")
        return "; ".join(parts)
    if name == "serve_decode":
        parts = []
        for pair, m in res.get("measured", {}).items():
            ratios = [f"{what} {f(m[key]['ratio'])}x" for key, what in (
                ("sequences", "sequences"), ("batch1_decode_tokens_per_s", "batch-1 decode"),
                ("max_batch_output_tokens_per_s", "largest-batch output")) if key in m]
            parts.append(f"HyLo/Llama {pair} at {m['context']}: " + ", ".join(ratios))
        c = res.get("computed", {}).get("1b")
        parts.append(f"1B at 64K, computed, not measured: {f(c['ratio_served'])}x the sequences" if c else "")
        return "; ".join(p for p in parts if p)
    if name == "compile":
        syncs = res.get("host_reads_per_step_eager"), res.get("host_reads_per_step_compiled")
        return (f"compiled / eager {f(res.get('time_ratio_compiled_over_eager'))}x (first row {f(res.get('first_row_compiled_s'))}"
                f" s), graphs after the first row {res.get('graphs_after_first_row')}, breaks "
                f"{res.get('graph_breaks_by_call')}, host syncs per step eager {syncs[0]} compiled {syncs[1]}")
    if name == "decode":
        done = [c for c in res.get("contexts_in_order", ()) if f"cache_ratio_ctx{c}" in res]
        if not done:
            return "no context ran on both models"
        return "; ".join(f"ctx {c}: hylo {f(res['hylo_8mla8gdn'][f'ctx{c}']['decode_tokens_per_s'])} tok/s, llama "
                         f"{f(res['llama_3.2_1b'][f'ctx{c}']['decode_tokens_per_s'])} tok/s, cache ratio "
                         f"{f(res[f'cache_ratio_ctx{c}'])}" for c in done)
    return ""


# The time plan of `make gpu-check`: the cases in the order they run, the most informative first, so that a loan
# cut short still has the key figures, each with its budget in seconds (its process's start-up and imports, about
# 15 s, included). Case 2 first: the gradients the step's figures rest on (and the GDN route the stack has); then
# the stage-2 step, decode, the step through DeepSpeed; the fused KL and MLA last (measured on the first loan).
# A case past its budget is stopped and recorded as such, keeping what it had measured; time a case leaves goes to
# the next ones, the later cases' budgets held back, and none runs past the deadline.
# Case 7 (vLLM) last: the machines lent have no vLLM, so there it only says so; on a node with vLLM it is run on its
# own with a budget of its own (docs/gpu-check.md).
PLAN: tuple[tuple[int, float], ...] = ((2, 60.0), (4, 160.0), (5, 90.0), (6, 50.0), (1, 45.0), (3, 25.0), (7, 40.0))
PLAN_DEADLINE = 480.0  # 8 minutes on one H100 or H200
# cases outside the plan, run with --cases N (`make gpu-check GPU_CHECK_FLAGS="--cases 8"`): their budgets
EXTRA_BUDGETS = {8: 120.0}
TINY_BUDGET = 600.0  # --tiny on a CPU: each case's budget (a busy CI machine)
# the stage-2 step's estimates (`hylo estimate`'s figures and FLOPs, minutes of CPU at 64K) run beside the cases
# in this many CPU processes, the key sizes first, and are merged into the step's figures as they come
ESTIMATE_WORKERS = 4

# what a run writes into --out (and, isolated, into each --out/case_N with the child's log.txt, and the step
# estimates' processes into --out/estimates/)
REPORT_FILES = ("gpu_check.json", "gpu_check.md")


def case_numbers(args: argparse.Namespace) -> list[int]:
    numbers = [int(c) for c in args.cases.split(",") if c.strip()]
    bad = [n for n in numbers if n not in CASES]
    if bad:
        raise SystemExit(f"--cases {args.cases}: no case {bad[0]}; the cases are {', '.join(map(str, CASES))}")
    return numbers


def isolated(args: argparse.Namespace) -> bool:
    return args.isolated or args.case_seconds is not None


def estimate_jobs(args: argparse.Namespace, sh: Shapes, variants: dict[str, list[str]]) -> list[str]:
    """The step estimates the run needs, the key sizes first: "variant:T" for each student of case 4 at each
    size and of case 6 at its size (the same step at world size 1)."""
    numbers = case_numbers(args)
    pairs = []
    if 4 in numbers:
        pairs += [(i, j, v, t) for j, v in enumerate(variants["plain"]) for i, t in enumerate(sh.step["tokens"])]
    if 6 in numbers:
        pairs += [(1, j, v, sh.deepspeed_tokens) for j, v in enumerate(variants["deepspeed"])]
    jobs = []
    for *_, v, t in sorted(pairs, key=lambda p: (p[0], p[1])):
        if f"{v}:{t}" not in jobs:
            jobs.append(f"{v}:{t}")
    return jobs


def check_outputs(args: argparse.Namespace) -> None:
    """Before any case runs: every file the check will write is one this project wrote or a new one
    (`hylo.outputs.check_output_file`; `--force` replaces files of the user's), and --out can be written."""
    out = Path(args.out)
    paths = [out / name for name in REPORT_FILES]
    if isolated(args):
        paths += [out / f"case_{n}" / name for n in case_numbers(args) for name in (*REPORT_FILES, "log.txt")]
        paths += [out / "estimates" / f"part_{i}.json" for i in range(ESTIMATE_WORKERS)]
    for p in paths:
        check_output_file(p, "--out", force=args.force)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--force", action="store_true",
                    help="replace files of the report's names in --out that this project did not write")
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (the test of this script)")
    ap.add_argument("--cases", default=",".join(str(n) for n, _ in PLAN),
                    help="comma-separated case numbers, in the order to run (default: the plan's, most "
                         "informative first)")
    ap.add_argument("--bypass-fla-hopper-guard", action="store_true",
                    help="measure only: let fla 0.6 run its gated backward (chunk_bwd_dqkwg) on Hopper with "
                         "Triton 3.4-3.7.0, which fla refuses since it is known to give wrong results there "
                         "(fla issue #640); the report says so and case 2 shows how wrong")
    ap.add_argument("--isolated", action="store_true",
                    help="each case in a process of its own under the time plan (its budget; printed first): a "
                         "case past its budget is stopped and recorded with what it had measured, and the run "
                         "moves on; the step's estimates run beside the cases (what `make gpu-check` does)")
    ap.add_argument("--case-seconds", type=float, default=None,
                    help="--isolated with this budget for every case instead of the plan's")
    ap.add_argument("--deadline", type=float, default=None,
                    help="isolated: no case runs past this many seconds from the start (default: the plan's "
                         f"{PLAN_DEADLINE:.0f} s; none with --tiny)")
    ap.add_argument("--estimate-worker", default=None, help=argparse.SUPPRESS)  # "I/N": the driver's own use
    ap.add_argument("--case-limit", type=float, default=None, help=argparse.SUPPRESS)  # isolated: the case's limit
    ap.add_argument("--step-estimates-elsewhere", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stop-after-measurements", type=int, default=None,
                    help="testing: the process kills itself (SIGKILL) as the measurement after this many starts, "
                         "as a budget stops a case, to check what a stopped case leaves")
    args = ap.parse_args(argv)
    case_numbers(args)
    if args.estimate_worker is None:
        check_outputs(args)
    if isolated(args):
        # SIGTERM / Ctrl-C end the running case's process group too (hylo/stopping.py)
        with stopping("gpu-check"):
            return run_isolated(args)
    if args.tiny:
        # case 1 runs the fused KL's Triton kernel through Triton's interpreter (slow: small shapes);
        # fla has no CPU path, so everything else takes the torch path
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # DeepSpeed's CPU ops are built once into the Makefile's cache (make test sets the same folder)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))
    import torch  # lazy: torch

    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shapes = TINY if args.tiny else FULL
    BYPASS_GUARD[0] = args.bypass_fla_hopper_guard
    CASE_LIMIT[0] = args.case_limit
    STEP_ESTIMATES_INLINE[0] = not args.step_estimates_elsewhere
    if args.estimate_worker is not None:
        return estimate_worker(args, shapes, device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "tiny": args.tiny, "device": str(device), "versions": versions(), "cases": {}}
    if args.bypass_fla_hopper_guard:
        report["fla_hopper_guard_bypassed"] = bypass_fla_hopper_guard()
    print(f"[gpu_check] plan (in this process, no budgets): cases {args.cases}", flush=True)
    t_all = time.perf_counter()
    for number in case_numbers(args):
        name, fn = CASES[number]
        t0 = time.perf_counter()

        meter = Meter(device)

        def partial(starting: bool = False, name=name, t0=t0, meter=meter) -> None:
            """After every measurement (and before the next): the case's figures so far, on disk."""
            report["cases"][name] = {**meter.partial, "ok": None, "partial": True,
                                     "case_seconds": time.perf_counter() - t0, **meter.totals()}
            write(out_dir, report)
            if starting and args.stop_after_measurements is not None and \
                    len(meter.log) >= args.stop_after_measurements:
                print(f"[gpu_check] stopping after {len(meter.log)} measurements (--stop-after-measurements)",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        meter.on_measure = partial
        print(f"[gpu_check] case {number} {name} ...", flush=True)
        partial()
        try:
            with kernels_mode("triton" if args.tiny and number == 1 else os.environ.get("HYLO_KERNELS", "auto")):
                res = fn(shapes, device, meter)
                res.update(meter.totals(), case_seconds=time.perf_counter() - t0)
                report["cases"][name] = res
                write(out_dir, report)
                # the memory estimates beside the measured figures, once those are on disk
                t_est = time.perf_counter()
                resolve_estimates()
                res["estimate_seconds"] = time.perf_counter() - t_est
        except Exception as exc:  # recorded with what was measured; the next case runs
            res = {**meter.partial, "ok": False, "error": error_record(exc), **meter.totals(),
                   "case_seconds": time.perf_counter() - t0}
        Later.pending.clear()
        report["cases"][name] = res
        gc.collect()
        free_memory()
        print(f"[gpu_check] case {number} {name}: ok={res.get('ok')} in {res['case_seconds']:.1f} s "
              f"(first calls {res['first_call_seconds']:.1f} s, steady {res['steady_seconds']:.1f} s)", flush=True)
        write(out_dir, report)
    report["total_seconds"] = time.perf_counter() - t_all
    # the estimates beside the measured memory figures that could not be made (pipeline/estimate/)
    report["estimate_errors"] = ESTIMATE_ERRORS
    write(out_dir, report)
    print(markdown(report))
    return 0 if all(r.get("ok") for r in report["cases"].values()) else 1


def estimate_worker(args: argparse.Namespace, sh: Shapes, device: Any) -> int:
    """One of the CPU processes beside the cases: the step estimates `--estimate-worker I/N` names (every N-th
    job from the I-th, the key sizes first), each written to OUT/part_I.json as soon as it is made."""
    import torch  # lazy: torch

    torch.set_num_threads(1)
    i, n = (int(x) for x in args.estimate_worker.split("/"))
    variants = {e: step_variants(device, e, args.bypass_fla_hopper_guard)[0] for e in ("plain", "deepspeed")}
    jobs = estimate_jobs(args, sh, variants)[i::n]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, Any] = {}
    dtype = torch.float32 if sh.tiny else torch.bfloat16
    for job in jobs:
        variant, tokens = job.split(":")
        done[job] = step_estimate(variant, sh, int(tokens), dtype)
        print(f"[gpu_check] step estimate {job}: {done[job].get('estimate_seconds', 0):.1f} s", flush=True)
        write_output_file(out_dir / f"part_{i}.json", json.dumps(done, indent=1, allow_nan=True) + "\n")
        record_files(out_dir, [f"part_{i}.json"])
    return 0


def merge_step_estimates(report: dict[str, Any], est_dir: Path) -> None:
    """The estimate processes' figures into the measured steps (and their MFU on this GPU)."""
    est: dict[str, Any] = {}
    for part in sorted(est_dir.glob("part_*.json")):
        with contextlib.suppress(ValueError, OSError):
            est.update(json.loads(part.read_text()))
    gpu = report.get("versions", {}).get("gpu")
    for name in ("stage2_step", "deepspeed_zero3"):
        case = report["cases"].get(name, {})
        for variant in case.get("students", ()):
            for key, entry in case.get(variant, {}).items():
                if key.startswith("T") and "seconds" in entry and f"{variant}:{key[1:]}" in est:
                    add_step_estimate(entry, est[f"{variant}:{key[1:]}"], gpu)


def time_plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    budgets = dict(PLAN)
    return [{"case": n, "name": CASES[n][0],
             "budget_s": args.case_seconds if args.case_seconds is not None
             else TINY_BUDGET if args.tiny else budgets.get(n, EXTRA_BUDGETS.get(n, 60.0))} for n in case_numbers(args)]


def case_limit(plan: list[dict[str, Any]], k: int, left: float | None) -> float | None:
    """The seconds the plan's k-th case may run with `left` seconds to the deadline: its budget, or more where
    earlier cases left time (the later cases' budgets held back), never past the deadline; None: too little
    is left to start it (under 10 s, or under its whole budget if that is smaller)."""
    budget = plan[k]["budget_s"]
    if left is None:
        return budget
    if left < min(budget, 10.0):
        return None
    later = sum(c["budget_s"] for c in plan[k + 1:])
    return min(max(budget, left - later), left)


def run_isolated(args: argparse.Namespace) -> int:
    """Each case in a child process (`--cases N --out OUT/case_N`) under the time plan, merged into OUT after each;
    the step's estimates in CPU processes beside them.

    The parent imports no torch, so the children have the GPU to themselves. A child stopped at its budget (or
    dead) is recorded as a case that failed (TimeoutExpired / ChildFailed, the end of its output) with the
    figures its partial report had on disk."""
    out_dir = make_dir(args.out)
    flags = [f for f, on in (("--tiny", args.tiny), ("--bypass-fla-hopper-guard", args.bypass_fla_hopper_guard),
                             ("--force", args.force)) if on]
    if args.stop_after_measurements is not None:
        flags += ["--stop-after-measurements", str(args.stop_after_measurements)]
    deadline = args.deadline if args.deadline is not None else None if args.tiny else PLAN_DEADLINE
    plan = time_plan(args)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "tiny": args.tiny, "device": None, "versions": {}, "cases": {}, "plan": plan,
                              "deadline_s": deadline,
                              "isolated": {"case_seconds": args.case_seconds, "deadline": deadline}}
    steps = [n for n in case_numbers(args) if n in (4, 6)]
    print("[gpu_check] plan: " + ", ".join(f"case {c['case']} {c['name']} {c['budget_s']:.0f} s" for c in plan)
          + (f"; deadline {deadline:.0f} s" if deadline else "; no deadline")
          + (f"; the step estimates in {ESTIMATE_WORKERS} CPU processes beside them" if steps else ""), flush=True)
    workers = []
    est_dir = out_dir / "estimates"
    if steps:
        # they see the GPU only to ask which students the stack can train (kernels/backend.check_fla_backward)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for i in range(ESTIMATE_WORKERS):
            cmd = [sys.executable, str(Path(__file__).resolve()), *flags, "--cases", args.cases, "--out",
                   str(est_dir), "--estimate-worker", f"{i}/{ESTIMATE_WORKERS}"]
            workers.append(popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
    for k, item in enumerate(plan):
        number, name = item["case"], item["name"]
        limit = case_limit(plan, k, None if deadline is None else deadline - (time.perf_counter() - t0))
        if limit is None:
            report["cases"][name] = {"ok": False, "skipped": "the deadline passed before this case could start"}
            continue
        child_out = out_dir / f"case_{number}"
        cmd = [sys.executable, str(Path(__file__).resolve()), *flags, "--cases", str(number), "--out", str(child_out)]
        if steps:
            cmd.append("--step-estimates-elsewhere")
        cmd += ["--case-limit", f"{limit:.0f}"]
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
        write_output_file(child_out / "log.txt", log)
        record_files(child_out, ["log.txt"])
        print("\n".join(f"    {line}" for line in log.splitlines() if line.startswith("[gpu_check]")), flush=True)
        child = child_out / "gpu_check.json"
        data = None
        with contextlib.suppress(ValueError, OSError):
            data = json.loads(child.read_text()) if child.is_file() else None
        if data is not None:
            report["device"], report["versions"] = data["device"], data["versions"]
            if "fla_hopper_guard_bypassed" in data:
                report["fla_hopper_guard_bypassed"] = data["fla_hopper_guard_bypassed"]
        res = (data or {}).get("cases", {}).get(name)
        if rc != 0 or res is None or res.get("partial"):
            # stopped at its budget or dead: what it had measured, marked as such
            why = f"stopped after {limit:.0f} s (its budget)" if rc is None else f"exit status {rc}"
            res = {**(res or {}), "ok": False, "stopped": why, "case_seconds": time.perf_counter() - t_case,
                   "error": {"type": "TimeoutExpired" if rc is None else "ChildFailed", "message": why,
                             "traceback": log.splitlines()[-12:]}}
        res["limit_s"] = limit  # its budget with what earlier cases left, as run
        report["cases"][name] = res
        merge_step_estimates(report, est_dir)
        write(out_dir, report)
    # the step estimates still running, until the deadline
    for w in workers:
        left = None if deadline is None else max(1.0, deadline - (time.perf_counter() - t0))
        try:
            w.wait(timeout=left)
        except subprocess.TimeoutExpired:
            end_process(w)
            w.wait()
    merge_step_estimates(report, est_dir)
    report["total_seconds"] = time.perf_counter() - t0
    write(out_dir, report)
    print(markdown(report))
    return 0 if all(r.get("ok") for r in report["cases"].values()) else 1


def bypass_fla_hopper_guard() -> bool:
    """Turn off fla's refusal of its gated backward on Hopper with Triton < 3.7.1 (fla #640), for this
    process only; True if the guard would have applied (the figures then come from a known-bad Triton)."""
    import fla.ops.common.chunk_o as chunk_o  # optional: fla

    applies = bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return applies


def write(out_dir: Path, report: dict[str, Any]) -> None:
    write_output_file(out_dir / "gpu_check.json", json.dumps(report, indent=1, default=json_value, allow_nan=True) + "\n")
    write_output_file(out_dir / "gpu_check.md", markdown(report))
    # recorded as ours: a later run may replace them (check_outputs)
    record_files(out_dir, REPORT_FILES)


if __name__ == "__main__":
    sys.exit(main())
