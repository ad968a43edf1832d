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
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hylo.kernels.varlen import DocBounds

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
    from torch._subclasses.fake_tensor import FakeTensor

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
def _takes_cu_seqlens_cpu(fn: Callable[..., Any]) -> bool:
    try:
        return "cu_seqlens_cpu" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def fla_varlen_kwargs(fn: Callable[..., Any], bounds: DocBounds | None) -> dict[str, Any]:
    """The packed-row arguments of fla op `fn`: `cu_seqlens` as int64 on the device and, where `fn`
    takes it (fla >= 0.5), the same boundaries on the host, so that fla does not copy them back."""
    if bounds is None:
        return {"cu_seqlens": None}
    kw: dict[str, Any] = {"cu_seqlens": bounds.cu_seqlens.to(torch.long)}
    if _takes_cu_seqlens_cpu(fn):
        kw["cu_seqlens_cpu"] = torch.tensor(bounds.host, dtype=torch.long)
    return kw


# ------------------------------------------------------------------------------------ known-bad GPU stacks
# fla's gated chunk backward (`chunk_bwd_dqkwg`: every GDN and Mamba-2 layer's backward) is compiled wrongly
# by Triton 3.4.0 up to, not including, 3.7.1 on NVIDIA Hopper GPUs (compute capability 9.x: H100, H200); fla
# issue #640. fla 0.6 refuses to run it there at the first backward; older fla runs it and returns wrong
# gradients. Seen on an H200 with torch 2.11.0 (Triton 3.6.0), fla 0.6.0: docs/gpu-check.md. torch 2.8
# brings Triton 3.4.0, 2.11 brings 3.6.0, 2.12.0 brings 3.7.0, 2.12.1 and 2.13.0 bring 3.7.1.
BAD_TRITON_ON_HOPPER = ("3.4.0", "3.7.1")  # [from, to)


class GpuStackError(RuntimeError):
    """The GPU software stack is one known to compute this model's training step wrongly."""


def fla_backward_problem(vendor: str, capability: tuple[int, int], triton_version: str,
                         linear_kinds: set[str], tilelang: bool) -> str | None:
    """Why fla cannot train layers of `linear_kinds` ("gdn", "mamba2") on this GPU stack, or None.

    `vendor` is "nvidia" or "amd" (an MI300X also reports capability 9.x, and is not affected); `tilelang`: fla
    then runs GDN's gated backward through TileLang instead of Triton (its TileLang backend refuses Mamba-2's,
    whose states stay fp32)."""
    from packaging.version import InvalidVersion, Version

    kinds = linear_kinds & {"gdn", "mamba2"}
    if vendor != "nvidia" or capability[0] != 9 or not kinds:
        return None
    try:
        v = Version(triton_version).release
    except InvalidVersion:
        return None
    low, high = (Version(x).release for x in BAD_TRITON_ON_HOPPER)
    if not (low <= v < high):
        return None
    if tilelang and kinds == {"gdn"}:
        return None
    names = {"gdn": "GDN", "mamba2": "Mamba-2"}
    layers = " and ".join(names[k] for k in sorted(kinds))
    low_s, high_s = BAD_TRITON_ON_HOPPER
    return (f"fla's gated backward, which every {layers} layer of this model trains through, is compiled wrongly "
            f"by Triton {low_s} up to (not including) {high_s} on Hopper GPUs (fla issue #640), and this worker has "
            f"Triton {triton_version} on a compute capability {capability[0]}.{capability[1]} GPU. Install Triton "
            f">= {high_s} (torch >= 2.12.1 brings it; cluster/Dockerfile.cuda's base image does), or, for a model "
            "whose linear layers are all GDN, tilelang; HYLO_KERNELS=torch trains on the torch path instead "
            "(correct, much slower)")


def check_fla_backward(device: torch.device, linear_kinds: set[str]) -> None:
    """Raise GpuStackError when training layers of `linear_kinds` on `device` through fla is known to be wrong
    (`fla_backward_problem`); nothing on CPU, with HYLO_KERNELS=torch, or without fla. Training calls it once,
    after building the model, before the first step."""
    if device.type != "cuda" or kernel_mode() == "torch" or not fla_available():
        return  # the GPU path's fla calls are what `use_fla` picks for a CUDA tensor
    import triton

    vendor = "amd" if torch.version.hip else "nvidia"
    problem = fla_backward_problem(vendor, torch.cuda.get_device_capability(device), triton.__version__,
                                   linear_kinds, importable("tilelang"))
    if problem:
        raise GpuStackError(problem)


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
    import ctypes
    import ctypes.util

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
