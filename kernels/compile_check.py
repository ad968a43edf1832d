"""Compile every Triton kernel a launch would run, for a GPU this machine does not have, and launch none.

Used by `hylo kernels-check` (pipeline/kernels_check.py), one process per target:

    install(TARGETS["gfx942"])      # before triton's driver or fla is first used
    with compile_only() as log:
        ...                         # call the launch sites on CPU tensors
    log.records                     # one per kernel x specialisation x autotune configuration

How:
* A stand-in Triton driver (`StandInDriver`) reports the target (backend, arch, warp size) and its device
  properties (shared memory per block, multiprocessor count); Triton's compiler needs no GPU and no driver
  to produce a cubin (ptxas ships in the wheel) or an hsaco (LLVM's AMDGPU backend is built in).
* fla reads the device at import (`fla.utils.hardware`: the platform from Triton's driver, Hopper /
  Blackwell from `torch.cuda.get_device_name` / `get_device_capability`, shared memory from
  `torch.cuda.get_device_properties` through `check_shared_mem`, the multiprocessor count from the
  driver): `install` replaces those `torch.cuda` functions with the target's answers, so fla chooses its
  block sizes and configuration lists as on that GPU. Install before fla is imported. fla's launch wrappers
  ask for the shared memory at the tensor's device index (None on CPU): `fla_view` answers that as device 0.
* `compile_only` holds `JITFunction.run` at `warmup=True` (compile, return, never launch) and replaces
  `Autotuner.run`: every configuration the autotuner would benchmark (after its own pruning) is compiled,
  whatever a disk cache of earlier choices says; none is timed. A compile error is recorded, not raised,
  so the caller goes on to the next launch site. Outputs of kernels that never ran are uninitialised
  memory: callers must not read them. Each record has the compile's wall and CPU seconds and whether
  Triton found the binary in its cache (`knobs.compilation.listener`).
* What a target accepts is checked as its driver does before a launch (`CompiledKernel._init_handles`):
  the kernel's shared memory against the target's per-block limit, and on Blackwell its tensor memory.
  Registers and spills come from the binary: `cuobjdump --dump-resource-usage` (shipped with Triton) for a
  cubin, the AMDGPU metadata in the assembly for an hsaco.

Target facts (`TARGETS`): per-block shared memory is what a kernel may request (NVIDIA's opt-in maximum,
`cudaDevAttrMaxSharedMemoryPerBlockOptin`; AMD's LDS per workgroup), multiprocessors as shipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU as Triton's compiler and fla see it."""

    name: str
    gpu: str
    backend: str
    arch: int | str
    warp_size: int
    shared_limit: int
    multiprocessors: int
    capability: tuple[int, int]
    max_num_regs: int = 65536


TARGETS: dict[str, Target] = {
    # H100 / H200: 228 KiB shared memory per SM, 227 KiB opt-in per block
    "sm_90": Target("sm_90", "NVIDIA H100 80GB HBM3", "cuda", 90, 32, 232448, 132, (9, 0)),
    # B200: the same per-block limit
    "sm_100": Target("sm_100", "NVIDIA B200", "cuda", 100, 32, 232448, 148, (10, 0)),
    # MI300X (CDNA3): 64 KiB LDS per CU
    "gfx942": Target("gfx942", "AMD Instinct MI300X", "hip", "gfx942", 64, 65536, 304, (9, 4)),
    # MI355X (CDNA4): 160 KiB LDS per CU
    "gfx950": Target("gfx950", "AMD Instinct MI355X", "hip", "gfx950", 64, 163840, 256, (9, 5)),
}


def device_properties(t: Target) -> dict[str, Any]:
    """What Triton's `driver.active.utils.get_device_properties` returns on the target."""
    return {"max_shared_mem": t.shared_limit, "multiprocessor_count": t.multiprocessors,
            "max_num_regs": t.max_num_regs, "warpSize": t.warp_size, "sm_clock_rate": 0,
            "mem_clock_rate": 0, "mem_bus_width": 0, "arch": str(t.arch)}


def _stand_in_driver(t: Target):
    from triton.backends.compiler import GPUTarget  # optional: triton
    from triton.backends.driver import DriverBase  # optional: triton

    def refuse(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"kernels-check: nothing is launched on the stand-in {t.name} driver")

    class StandInDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def __init__(self) -> None:
            super().__init__()
            self.utils = SimpleNamespace(get_device_properties=lambda device=0: device_properties(t),
                                         load_binary=refuse)
            self.launcher_cls = refuse

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self):
            return GPUTarget(t.backend, t.arch, t.warp_size)

        def get_active_torch_device(self):
            import torch  # lazy: torch

            return torch.device("cpu")

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device: int) -> None:
            del device

        def get_current_stream(self, device: int | None = None) -> int:
            del device
            return 0

        def get_benchmarker(self):
            return refuse

        def get_device_interface(self):
            raise RuntimeError(f"kernels-check: the stand-in {t.name} driver has no device interface")

        def get_empty_cache_for_benchmark(self):
            return refuse()

        def clear_cache(self, cache: Any) -> None:
            del cache

    return StandInDriver()


def _torch_cuda_stand_ins(t: Target) -> None:
    """`torch.cuda`'s answers about device 0 as the target gives them (what fla asks at import)."""
    import torch  # lazy: torch

    props = SimpleNamespace(name=t.gpu, major=t.capability[0], minor=t.capability[1],
                            multi_processor_count=t.multiprocessors, shared_memory_per_block=min(t.shared_limit, 49152),
                            shared_memory_per_block_optin=t.shared_limit, warp_size=t.warp_size,
                            total_memory=192 << 30, gcnArchName=str(t.arch) if t.backend == "hip" else "")
    cuda = torch.cuda
    cuda.get_device_name = lambda device=None: t.gpu
    cuda.get_device_capability = lambda device=None: t.capability
    cuda.get_device_properties = lambda device=None: props
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.is_available = lambda: True


def install(t: Target) -> None:
    """The target's stand-in driver and `torch.cuda` answers, for the rest of this process."""
    if "fla" in sys.modules:
        raise RuntimeError("kernels-check: install the target before fla is imported (fla reads the device then)")
    from triton.runtime import driver  # optional: triton

    _torch_cuda_stand_ins(t)
    d = _stand_in_driver(t)
    driver._default = d
    driver.set_active(d)
    os.environ["FLA_USE_TMA"] = "0"


class _AnyDeviceIndex(list):
    """fla's per-device shared-memory list, read at a CPU tensor's device index (None) as device 0's."""

    def __getitem__(self, i: Any) -> Any:
        return super().__getitem__(0 if i is None else i)


def fla_stand_ins() -> None:
    """fla's launch wrappers ask `check_shared_mem(tier, x.device.index)`; a CPU tensor's index is None, which
    fla answers False for every tier (its lowest block sizes, not the target's). Here the index None is the
    target's device 0 (after `install`; once per process)."""
    from fla.utils import hardware  # optional: fla

    orig = hardware.get_all_max_shared_mem
    if getattr(orig, "_kernels_check", False):
        return

    def all_max_shared_mem() -> list[int]:
        return _AnyDeviceIndex(orig())

    all_max_shared_mem._kernels_check = True  # type: ignore[attr-defined]
    hardware.get_all_max_shared_mem = all_max_shared_mem


def fla_view() -> dict[str, Any]:
    """What fla concluded about the device at import (after `install`): its platform flags, which of its
    shared-memory tiers the device reaches (at device 0 and at a CPU tensor's index), its multiprocessor count."""
    from fla import utils  # optional: fla

    fla_stand_ins()

    return {"device_platform": utils.device_platform, "is_amd": utils.IS_AMD, "is_nvidia": utils.IS_NVIDIA,
            "is_nvidia_hopper": utils.IS_NVIDIA_HOPPER, "is_nvidia_blackwell": utils.IS_NVIDIA_BLACKWELL,
            "is_tma_supported": utils.IS_TMA_SUPPORTED,
            "shared_mem_tiers": {tier: utils.check_shared_mem(tier) for tier in ("hopper", "ampere", "ada")},
            "shared_mem_tiers_cpu_tensor": {tier: utils.check_shared_mem(tier, None)
                                            for tier in ("hopper", "ampere", "ada")},
            "multiprocessor_count": utils.get_multiprocessor_count(0)}


# -------------------------------------------------------------------------------------- the records
@dataclasses.dataclass
class Record:
    """One compile: a kernel at one specialisation and one autotune configuration, for one target."""

    kernel: str
    target: str
    site: str
    num_warps: int | None
    num_stages: int | None
    constexprs: dict[str, Any]
    autotuned: bool
    compiled: bool
    shared_bytes: int | None
    shared_limit: int
    fits: bool
    error: str | None
    registers: int | None = None
    spills: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # wall seconds of Triton's compile call (its cache lookup included; the resource read-out not), and the CPU
    # seconds of this process and its finished children (ptxas) in it: on a shared machine the wall time waits
    seconds: float | None = None
    cpu_seconds: float | None = None
    # Triton found the binary in TRITON_CACHE_DIR and compiled nothing (its compilation listener's cache_hit)
    cache_hit: bool | None = None


def _resource_usage(kernel: Any, t: Target) -> tuple[int | None, int | None, dict[str, Any]]:
    """Registers, spilled registers and other resource figures the binary states."""
    extra: dict[str, Any] = {}
    asm = getattr(kernel, "asm", {}) or {}
    if t.backend == "hip":
        text = asm.get("amdgcn", "")
        if isinstance(text, bytes):
            text = text.decode(errors="replace")

        def num(key: str) -> int | None:
            m = re.search(rf"^\s*\.{key}:\s+(\d+)", text, re.M)
            return int(m.group(1)) if m else None

        vgpr, sgpr = num("vgpr_count"), num("sgpr_count")
        agpr = num("agpr_count")
        vs, ss = num("vgpr_spill_count"), num("sgpr_spill_count")
        extra.update(vgpr=vgpr, sgpr=sgpr, agpr=agpr, vgpr_spills=vs, sgpr_spills=ss)
        spills = None if vs is None and ss is None else (vs or 0) + (ss or 0)
        return vgpr, spills, extra
    cubin = asm.get("cubin")
    if not cubin:
        return None, None, extra
    from triton import knobs  # optional: triton

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                 timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None, extra
    m = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    extra.update(local_bytes=int(local.group(1)) if local else None, stack_bytes=int(stack.group(1)) if stack else None)
    # ptxas puts spilled registers in local memory; LOCAL counts them (and any local arrays)
    return (int(m.group(1)) if m else None), (int(local.group(1)) if local else None), extra


def _scalar(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    return str(v)


@dataclasses.dataclass
class CompileLog:
    target: Target
    records: list[Record] = dataclasses.field(default_factory=list)
    site: str = ""
    # called after each new record (the job saves its progress with it)
    on_add: Any = None
    _seen: set = dataclasses.field(default_factory=set)

    def add(self, rec: Record, key: Any) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        self.records.append(rec)
        if self.on_add is not None:
            self.on_add(self.records)


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@contextlib.contextmanager
def compile_only(t: Target) -> Iterator[CompileLog]:
    """Inside the block every Triton launch compiles for `t` and returns without running (see module doc)."""
    from triton import knobs  # optional: triton
    from triton.runtime.autotuner import Autotuner  # optional: triton
    from triton.runtime.jit import JITFunction  # optional: triton

    log = CompileLog(t)
    # what Triton's compilation listener heard during the current launch: cache hits, compiles
    heard: list[bool] = []
    # the configuration keys of the autotuner whose configurations are being compiled (innermost last)
    autotuning: list[set[str]] = []
    orig_run, orig_tune = JITFunction.run, Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        del warmup
        name = self.fn.__name__
        consts = {p.name: _scalar(v) for p, v in zip(self.params, args) if p.is_constexpr}
        consts.update({k: _scalar(v) for k, v in kwargs.items()
                       if k not in ("num_warps", "num_stages", "num_ctas", "maxnreg", "debug", "instrumentation_mode",
                                    "fpsan_homomorphic_casts")
                       and any(p.name == k and p.is_constexpr for p in self.params)})
        nw, ns = kwargs.get("num_warps"), kwargs.get("num_stages")
        key = (log.site, name, tuple(sorted(consts.items())), nw, ns)
        tuned = autotuning[-1] if autotuning else set()
        spec = json.dumps({k: v for k, v in sorted(consts.items()) if k not in tuned})
        heard.clear()
        t0, c0 = time.perf_counter(), _cpu_now()
        try:
            kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # the compiler's message is the record
            msg = " ".join(str(e).split())[:2000] or type(e).__name__
            log.add(Record(name, t.name, log.site, nw, ns, consts, bool(autotuning), False, None,
                           t.shared_limit, False, f"{type(e).__name__}: {msg}", extra={"specialisation": spec},
                           seconds=round(time.perf_counter() - t0, 3), cpu_seconds=round(_cpu_now() - c0, 3)), key)
            return None
        seconds, cpu_seconds = round(time.perf_counter() - t0, 3), round(_cpu_now() - c0, 3)
        # no listener call: the binary was in this process's in-memory cache (an earlier launch compiled it)
        cache_hit = all(heard) if heard else None
        md = kernel.metadata
        shared = int(md.shared)
        fits = shared <= t.shared_limit
        extra: dict[str, Any] = {"specialisation": spec}
        tmem = getattr(md, "tmem_size", None)
        if tmem is not None:
            extra["tmem_columns"] = int(tmem)
            fits = fits and int(tmem) <= 512
        regs, spills, more = _resource_usage(kernel, t)
        extra.update(more)
        log.add(Record(name, t.name, log.site, int(md.num_warps), int(md.num_stages), consts, bool(autotuning),
                       True, shared, t.shared_limit, fits, None, regs, spills, extra, seconds, cpu_seconds,
                       cache_hit), key)
        return kernel

    def tune(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else list(self.configs)
        autotuning.append({k for c in configs for k in c.kwargs})
        try:
            for config in configs:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            autotuning.pop()
            self.nargs = None
        self.best_config = configs[0]
        return None

    def listener(*, cache_hit: bool, **_: Any) -> None:
        heard.append(bool(cache_hit))

    orig_listener = knobs.compilation.listener
    JITFunction.run, Autotuner.run = run, tune
    knobs.compilation.listener = listener
    try:
        yield log
    finally:
        JITFunction.run, Autotuner.run = orig_run, orig_tune
        knobs.compilation.listener = orig_listener
