"""The one switch between the GPU path (fla / Triton kernels) and the pure-torch CPU path.

Every op in `kernels/` and every layer in `hylo/layers/` asks `use_gpu_kernels(tensor)` instead of
testing devices itself. Set `HYLO_KERNELS=torch` to force the pure-torch path everywhere (debugging,
numerics checks on a GPU) or `HYLO_KERNELS=triton` to force Triton even on CPU tensors (only
meaningful with `TRITON_INTERPRET=1`, which is how the Triton kernels are tested on CPU).
`HYLO_KERNELS=gpu` takes every GPU branch, fla's included, on CPU tensors under `TRITON_INTERPRET=1`
(tests only: fla's kernels then need the interpreter patches of `tests/helpers/fla_interpret.py`).
`forced_mode("torch")` does the same for a block of code (the eval's exact-KL option).
On the CPU path the training workers and CPU teacher replicas also call `keep_freed_host_memory()`
(`HYLO_HOST_MALLOC=system` turns it off).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from packaging.version import InvalidVersion, Version
from torch._subclasses.fake_tensor import FakeTensor

from hylo.kernels.varlen import DocBounds, row_varlen_tensors

_CHOICES = ("auto", "torch", "triton", "gpu")
_FORCED: list[str] = []


@contextlib.contextmanager
def forced_mode(mode: str) -> Iterator[None]:
    """Inside the block `kernel_mode()` is `mode`, whatever HYLO_KERNELS says."""
    if mode not in _CHOICES:
        raise ValueError(f"kernel mode {mode!r} is not valid; allowed: {', '.join(_CHOICES)}")
    _FORCED.append(mode)
    try:
        yield
    finally:
        _FORCED.pop()


def kernel_mode() -> str:
    if _FORCED:
        return _FORCED[-1]
    mode = os.environ.get("HYLO_KERNELS", "auto").lower()
    if mode not in _CHOICES:
        raise ValueError(f"HYLO_KERNELS={mode!r} is not valid; allowed: {', '.join(_CHOICES)}")
    return mode


@functools.cache
def importable(module: str) -> bool:
    """True when `module` (an optional dependency: triton, fla, a benchmark's baseline) imports."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def triton_available() -> bool:
    return importable("triton")


def fla_available() -> bool:
    return importable("fla.ops.gated_delta_rule")


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_gpu_kernels(x: torch.Tensor) -> bool:
    """True when `x` should go through the Triton/fla kernels rather than the torch path."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode in ("triton", "gpu"):
        return triton_available() and (x.is_cuda or triton_interpret())
    return x.is_cuda and triton_available()


def use_fla(x: torch.Tensor) -> bool:
    """True when `x` should go through fla's kernels: GPU tensors, or CPU tensors in mode `gpu` under
    TRITON_INTERPRET=1 (fla's kernels run interpreted only with the test harness's patches)."""
    mode = kernel_mode()
    if mode == "gpu":
        return use_gpu_kernels(x) and fla_available()
    return x.is_cuda and mode != "torch" and fla_available()


# ------------------------------------------------------------------------------------ compiled blocks
# The kernel calls a compiled decoder block leaves out of its graphs (`pipeline/train/compile.py`), by name; and
# their `torch.compiler.disable`d forms once a block is compiled. Made then, not at import: torch.compiler.disable
# imports torch._dynamo, which imports Triton before a process may have set TRITON_INTERPRET.
_KERNEL_CALLS: dict[str, Callable[..., Any]] = {}
_LEFT_OUT: dict[str, Callable[..., Any]] = {}


def kernel_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` (a GDN / SSD scan, MLA's packed attention) as a kernel call that compiled blocks leave out of
    their graphs, as fla's own entry points are (`torch.compiler.disable`), once `leave_kernels_out()` ran."""
    _KERNEL_CALLS[fn.__name__] = fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _LEFT_OUT.get(fn.__name__, fn)(*args, **kwargs)

    return call


def leave_kernels_out() -> tuple[str, ...]:
    """Every `kernel_call` through torch.compiler.disable from now on (what `compile_blocks` calls); their names."""
    for name, fn in _KERNEL_CALLS.items():
        _LEFT_OUT.setdefault(name, torch.compiler.disable(fn))
    return tuple(_KERNEL_CALLS)


_FLA_STAND_IN: list[Any] = []


@contextlib.contextmanager
def fla_stand_in(stand_in: Any) -> Iterator[None]:
    """Inside the block, the GPU path's fla calls on FAKE tensors go to `stand_in`'s methods of the same names
    (`hylo.kernels.fla_shapes.FlaShapes`: fla's allocations and saved tensors without its kernels). Only the
    estimator enters it (pipeline/estimate/fake.py, `fake_tensors(gpu=True)`); a real tensor never takes it."""
    _FLA_STAND_IN.append(stand_in)
    try:
        yield
    finally:
        _FLA_STAND_IN.pop()


def _is_fake(x: torch.Tensor) -> bool:
    return isinstance(x, FakeTensor)


def fla_stand_in_for(x: Any, name: str) -> Callable[..., Any] | None:
    """Inside `fla_stand_in`, for a fake tensor `x`: the stand-in for fla's function `name`
    ("chunk_gated_delta_rule", "chunk_simple_gla"), which the GPU path then calls in fla's place, whatever
    HYLO_KERNELS says (the estimator chose it); else None (the GPU path calls fla where `use_fla(x)`, the torch
    path runs otherwise)."""
    if not _FLA_STAND_IN or not isinstance(x, torch.Tensor) or not _is_fake(x):
        return None
    return getattr(_FLA_STAND_IN[-1], name)


@functools.cache
def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def fla_varlen_kwargs(fn: Callable[..., Any], bounds: DocBounds | None, chunk_size: int = 64) -> dict[str, Any]:
    """The packed-row arguments of fla op `fn`: `cu_seqlens` as int64 on the device and, where `fn` takes them
    (fla >= 0.5), the same boundaries on the host and the chunk indices of chunks of `chunk_size` (fla's own
    form, `prepare_chunk_indices`), so that fla reads nothing back. Made once per row
    (`kernels/varlen.row_varlen_tensors`): every layer of the row gets the same tensors."""
    if bounds is None:
        return {"cu_seqlens": None}
    cu, cu_cpu, chunk_indices = row_varlen_tensors(bounds.host, chunk_size, bounds.cu_seqlens.device)
    kw: dict[str, Any] = {"cu_seqlens": cu}
    if _takes(fn, "cu_seqlens_cpu"):
        kw["cu_seqlens_cpu"] = cu_cpu
    if _takes(fn, "chunk_indices"):
        kw["chunk_indices"] = chunk_indices
    return kw


# ------------------------------------------------------------------------------------ known-bad GPU stacks
# fla's gated chunk backward (`chunk_bwd_dqkwg`: every GDN and Mamba-2 layer's backward) is compiled wrongly
# by Triton 3.4.0 up to, not including, 3.7.1 on NVIDIA Hopper GPUs (compute capability 9.x: H100, H200); fla
# issue #640. fla 0.6 refuses to run it there at the first backward; older fla runs it and returns wrong
# gradients. The route below keeps the miscompiled block width out; without it such a stack is refused. Seen on an H200 with torch 2.11.0 (Triton 3.6.0), fla 0.6.0: docs/gpu-check.md. torch 2.8
# brings Triton 3.4.0, 2.11 brings 3.6.0, 2.12.0 brings 3.7.0, 2.12.1 and 2.13.0 bring 3.7.1.
BAD_TRITON_ON_HOPPER = ("3.4.0", "3.7.1")  # [from, to)


class GpuStackError(RuntimeError):
    """The GPU software stack is one known to compute this model's training step wrongly."""


@functools.cache
def triton_in_bad_range(triton_version: str) -> bool:
    """True for a Triton of `BAD_TRITON_ON_HOPPER` (local builds such as 3.7.0+git... included)."""
    try:
        v = Version(triton_version).release
    except InvalidVersion:
        return False
    low, high = (Version(x).release for x in BAD_TRITON_ON_HOPPER)
    return low <= v < high


def fla_backward_problem(vendor: str, capability: tuple[int, int], triton_version: str,
                         linear_kinds: set[str], tilelang: bool, route: bool = False,
                         route_problem: str | None = None) -> str | None:
    """Why fla cannot train layers of `linear_kinds` ("gdn", "mamba2") on this GPU stack, or None.

    `vendor` is "nvidia" or "amd" (an MI300X also reports capability 9.x, and is not affected); `tilelang`: fla
    then runs GDN's gated backward through TileLang instead of Triton (its TileLang backend refuses Mamba-2's,
    whose states stay fp32); `route`: the block-width route below is installed in fla (`install_fla_route`), or
    else `route_problem` says why not (`fla_route_problem`)."""
    kinds = linear_kinds & {"gdn", "mamba2"}
    if vendor != "nvidia" or capability[0] != 9 or not kinds or not triton_in_bad_range(triton_version):
        return None
    if route or (tilelang and kinds == {"gdn"}):
        return None
    names = {"gdn": "GDN", "mamba2": "Mamba-2"}
    layers = " and ".join(names[k] for k in sorted(kinds))
    low_s, high_s = BAD_TRITON_ON_HOPPER
    return (f"fla's gated backward, which every {layers} layer of this model trains through, is compiled wrongly "
            f"by Triton {low_s} up to (not including) {high_s} on Hopper GPUs (fla issue #640); this worker has "
            f"Triton {triton_version} on a compute capability {capability[0]}.{capability[1]} GPU, and the route "
            f"that keeps the miscompiled block width out is not installed ({route_problem or 'not asked for'}). "
            f"Install Triton >= {high_s} (torch >= 2.12.1 brings it; cluster/Dockerfile.cuda's base image does), "
            "or, for a model "
            "whose linear layers are all GDN, tilelang; HYLO_KERNELS=torch trains on the torch path instead "
            "(correct, much slower)")


def check_fla_backward(device: torch.device, linear_kinds: set[str]) -> None:
    """Install the route around fla #640 (`install_fla_route`) and raise GpuStackError when training layers of
    `linear_kinds` on `device` through fla is still known to be wrong (`fla_backward_problem`); nothing on CPU,
    with HYLO_KERNELS=torch, or without fla. Every training worker calls it once, after building the model,
    before the first step (the route is a registration inside the worker's own fla: no environment variable)."""
    if device.type != "cuda" or kernel_mode() == "torch" or not fla_available():
        return  # the GPU path's fla calls are what `use_fla` picks for a CUDA tensor
    import triton  # optional: triton

    vendor = "amd" if torch.version.hip else "nvidia"
    route = install_fla_route()
    problem = fla_backward_problem(vendor, torch.cuda.get_device_capability(device), triton.__version__,
                                   linear_kinds, importable("tilelang"), route,
                                   None if route else fla_route_problem())
    if problem:
        raise GpuStackError(problem)


# ------------------------------------------------------------------------------------ the route around fla #640
# The miscompile is at one block width: fla's `chunk_bwd_kernel_dqkwg` (fla/ops/common/chunk_o.py) gives a wrong
# dk (and from it dg, dbeta) at BK = 64 and right ones at BK = 32 and BK = 128 (fla #640's sweep on Hopper; the
# autotune configurations, warps and stages, do not matter there). fla's wrapper `chunk_bwd_dqkwg` picks
# BK = min(next_pow2(K), 128) on Hopper, so K of 33-64 (a 64-wide GDN head, Mamba-2's state of 64) gets 64; fla 0.6
# raises for every gated call on such a stack instead. The route is a backend in fla's own backend registry
# (`fla.backends.register`, how fla adds its TileLang backend): on a Hopper GPU with a Triton of
# BAD_TRITON_ON_HOPPER it takes every `chunk_bwd_dqkwg` call (gated, g_gamma and ungated: the wrong
# `tl.dot(tl.trans(b_ds), b_q)` is in all three) and launches fla's own kernel as fla's wrapper does, with
# BK = 32 where fla would pick 64 (fla's choice on GPUs with less shared memory: the K loop is split in two,
# dg summed over the halves by the wrapper). Elsewhere it declines and fla's wrapper runs. fla's files are not
# edited (fla's autotune and pre-tuned configurations, FLA_CONFIG_DIR, carry only warps and stages: BK is the
# wrapper's). It goes before fla's TileLang backend, so that what runs is what `hylo kernels-check` compiles.
# The similar report for `prepare_wy_repr_bwd` at BT = 64 (fla #984) is the ungated delta rule's kernel, which
# no layer here uses; fla 0.6 already keeps it at 2 warps on Hopper (fla #988).
ROUTE_BLOCK_K = {64: 32}  # fla's block width on Hopper -> the route's
# the arguments of fla's kernel and wrapper the route was written against (fla 0.6.0)
_DQKWG_KERNEL_ARGS = ("q", "k", "v", "g", "g_gamma", "h", "do", "dh", "dq", "dk", "dw", "dv", "dg", "cu_seqlens",
                      "chunk_indices", "scale", "B", "T", "H", "HV", "K", "V", "BT", "BK", "BV", "USE_G",
                      "USE_G_GAMMA", "USE_DW", "STATE_V_FIRST", "IS_VARLEN")
_DQKWG_WRAPPER_ARGS = ("q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma", "dv", "scale", "state_v_first",
                       "cu_seqlens", "chunk_size", "chunk_indices")
_route: list[Any] = []


def dqkwg_block_width(K: int, const_tiling: int) -> tuple[int, int]:
    """(fla's BK for key width `K` at its tiling limit, the route's BK)."""
    bk = min(max(1 << (max(K, 1) - 1).bit_length(), 16), const_tiling)
    return bk, ROUTE_BLOCK_K.get(bk, bk)


def fla_route_problem() -> str | None:
    """Why the route cannot be installed in the fla imported here, or None."""
    try:
        import fla.backends as fb  # optional: fla
        from fla.ops.common import chunk_o  # optional: fla
    except Exception as e:
        return f"fla does not import: {type(e).__name__}: {e}"
    if not hasattr(fb, "register") or not hasattr(fb, "BaseBackend"):
        return f"fla {getattr(importlib.import_module('fla'), '__version__', '?')} has no backend registry"
    if getattr(fb, "_DISPATCH_DISABLED", False):
        return "FLA_DISABLE_BACKEND_DISPATCH=1 turns fla's backend registry off"
    kernel_args = tuple(getattr(getattr(chunk_o, "chunk_bwd_kernel_dqkwg", None), "arg_names", ()) or ())
    wrapper = inspect.unwrap(getattr(chunk_o, "chunk_bwd_dqkwg", None) or (lambda: None))
    wrapper_args = tuple(inspect.signature(wrapper).parameters)
    if kernel_args != _DQKWG_KERNEL_ARGS or wrapper_args != _DQKWG_WRAPPER_ARGS:
        return ("fla's chunk_bwd_dqkwg or its kernel has other arguments than the fla 0.6.0 the route was "
                "written against")
    return None


def _route_applies() -> bool:
    """The stack the route is for: fla's own view of the GPU (Hopper, as its guard asks) and the Triton."""
    import triton  # optional: triton
    from fla.utils import IS_NVIDIA_HOPPER  # optional: fla

    return bool(IS_NVIDIA_HOPPER) and triton_in_bad_range(triton.__version__)


def _route_chunk_bwd_dqkwg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, h: torch.Tensor,
                           dh: torch.Tensor, w: torch.Tensor | None = None, g: torch.Tensor | None = None,
                           g_gamma: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                           scale: float | None = None, state_v_first: bool = False,
                           cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                           chunk_indices: torch.Tensor | None = None) -> tuple[Any, Any, Any, Any]:
    """fla 0.6.0's `chunk_bwd_dqkwg` step for step, with the route's block width (`dqkwg_block_width`)."""
    import triton  # optional: triton
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg  # optional: fla
    from fla.ops.utils import prepare_chunk_indices  # optional: fla
    from fla.utils import check_shared_mem  # optional: fla

    B, T, H, K, V, HV = *k.shape, v.shape[-1], v.shape[2]
    BT = chunk_size
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BT)
    NT = triton.cdiv(T, BT) if cu_seqlens is None else len(chunk_indices)
    if check_shared_mem("hopper", k.device.index):
        tiling = 128
    elif check_shared_mem("ampere", k.device.index):
        tiling = 128 if all(x.element_size() == 2 for x in (q, k, v, do, h, dh, w, dv) if x is not None) else 64
    elif check_shared_mem("ada", k.device.index):
        tiling = 64
    else:
        tiling = 32
    _, BK = dqkwg_block_width(K, tiling)
    BV = min(max(triton.next_power_of_2(V), 16), tiling)  # the value width is fla's: the bug is in BK alone
    NK = triton.cdiv(K, BK)
    dq = q.new_empty(B, T, HV, K)
    dk = k.new_empty(B, T, HV, K)
    dg = torch.empty(NK, *g.shape, dtype=torch.float32, device=g.device) if g is not None else None
    dw = torch.empty_like(w) if w is not None else None
    chunk_bwd_kernel_dqkwg[(NK * NT, B * HV)](
        q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, B=B, T=T, H=H, HV=HV, K=K, V=V,
        BT=BT, BK=BK, BV=BV, STATE_V_FIRST=state_v_first)
    if H != HV:
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    if dg is not None:
        dg = dg.sum(0)
    return dq, dk, dw, dg


def install_fla_route() -> bool:
    """Register the route in fla's backend registry for `chunk_bwd_dqkwg` (once per process); False where this fla
    has no way to take it (`fla_route_problem`). It declines every call off the stack it is for (`_route_applies`).
    """
    if _route:
        return True
    if fla_route_problem() is not None:
        return False
    from fla.backends import BaseBackend, register  # optional: fla

    class HopperBlockWidthRoute(BaseBackend):
        """hylo's route around fla #640 (kernels/backend.py)."""

        backend_type = "hylo_hopper_block_width"
        priority = 4  # before fla's TileLang backend (5)

        def chunk_bwd_dqkwg_verifier(self, q: torch.Tensor, k: torch.Tensor, *args: Any,
                                     **kwargs: Any) -> tuple[bool, str | None]:
            del q, k, args, kwargs
            if _route_applies():
                return True, None
            return False, "not a Hopper GPU with a Triton of fla #640"

        def chunk_bwd_dqkwg(self, *args: Any, **kwargs: Any) -> Any:
            return _route_chunk_bwd_dqkwg(*args, **kwargs)

    register("common")(HopperBlockWidthRoute)
    _route.append(HopperBlockWidthRoute)
    return True


# ------------------------------------------------------------------------------------ host memory
_HOST_MALLOC = ("keep", "system")
_host_malloc_done: list[str] = []


def host_malloc_mode() -> str:
    mode = os.environ.get("HYLO_HOST_MALLOC", "keep").lower()
    if mode not in _HOST_MALLOC:
        raise ValueError(f"HYLO_HOST_MALLOC={mode!r} is not valid; allowed: {', '.join(_HOST_MALLOC)}")
    return mode


def keep_freed_host_memory() -> bool:
    """The CPU path's allocator setting: freed host memory stays in the process for the next step.

    glibc's malloc serves every block over its mmap threshold (128 KiB, growing to at most 32 MiB) with a
    fresh mmap and unmaps it on free, so each step's large activations (an MLP's [8192, 1536] fp32 is
    48 MiB) come back as new pages, faulted in and zeroed by the kernel one 4 KiB page at a time: in the
    demo's 8K-token stage-2 step on this CPU that was 2.6 M page faults and 25 s of kernel time out of
    110 s (bench/step_profile.py, bench/estimate_check.py). On the GPU path the CUDA caching allocator
    already keeps freed memory; this does the same for host tensors: the mmap threshold is raised to
    2 GiB and trimming is turned off (glibc's `mallopt`), so the process keeps its peak resident size
    instead of returning memory between steps. Once per process; a no-op where the C library has no
    `mallopt` (not glibc). `HYLO_HOST_MALLOC=system` leaves malloc as it is (what bench/step_memory.py
    needs: it reads the step's memory from what goes back to the system). True when it was applied.
    """
    if host_malloc_mode() == "system":
        return False
    if _host_malloc_done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    ok = mallopt(m_mmap_threshold, 2**31 - 1) == 1 and mallopt(m_trim_threshold, 2**31 - 1) == 1
    mallopt(m_top_pad, 64 << 20)
    if ok:
        _host_malloc_done.append("keep")
    return ok
