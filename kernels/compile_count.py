"""Count what a run would compile and autotune, per Triton kernel: the cold-start ledger.

    with count_compilations() as log:
        ...                      # prefill + decode steps, or packed rows
        log.next_phase()         # e.g. after the prefill, after the first row
    log.compiles()               # {kernel: number of distinct specialisations}
    log.tunes()                  # {kernel: number of autotune runs from a cold start}
    log.compiles(since=1)        # {kernel: specialisations first needed after the first phase}

Triton compiles a kernel once per key of its JIT cache (`JITFunction.run`): the specialisation of every
argument (a tensor's dtype and whether its address is 16-byte aligned, an int's width and whether it is
divisible by 16 or equal to 1, unless the kernel says `do_not_specialize`), every constexpr's value, and the
launch options (num_warps, num_stages...). An autotuner (`Autotuner.run`) benchmarks every configuration once
per value of its key (the arguments it names, plus every tensor's dtype). A kernel compiled again for a new
length, or re-tuned for new document boundaries, shows here as a second key.

Where the keys come from:
* compiled (a GPU): the key `JITFunction.run` looks its kernel cache up with, built by Triton's own binder;
* `TRITON_INTERPRET=1` (CPU, nothing is compiled): for each launch of an interpreted kernel the key the JIT
  would build, by Triton's own binder (`create_function_from_signature` with the generic backend's
  specialisation rules; NVIDIA's are the same, AMD's add buffer-op flags on tensors);
* autotune keys: `Autotuner.run`'s key (tuners with one configuration never tune).

Keys are counted from a cold start whatever the process compiled or tuned before the block: a distinct key is
one compilation (one autotune run) for a fresh process with an empty cache. A warm `TRITON_CACHE_DIR` turns
compilations into disk loads and, with `FLA_CACHE_RESULTS=1`, autotune runs into loads of earlier choices.

An autotune run compiles every configuration it benchmarks: on a GPU that is configurations x autotune runs
compilations on top of one per specialisation counted here (the interpreter harness keeps one configuration).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass
class CompileLog:
    """Distinct JIT keys and autotune keys per kernel (`module.qualname`), each with the phase it was first seen in.

    A caller marks phases (`next_phase()`: the prefill, the first decode step, the later steps; or row 1, rows
    2-10); a key first seen after the first phase of a repeated workload is a recompile or a re-tune."""

    jit_keys: dict[str, dict[str, int]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    tune_keys: dict[str, dict[tuple[Any, ...], int]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    launches: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    phase: int = 0

    def next_phase(self) -> int:
        self.phase += 1
        return self.phase

    def compiles(self, since: int = 0) -> dict[str, int]:
        """Distinct JIT keys per kernel first seen in phase `since` or later."""
        return {k: sum(p >= since for p in v.values()) for k, v in self.jit_keys.items()}

    def tunes(self, since: int = 0) -> dict[str, int]:
        """Distinct autotune keys (autotune runs from a cold start) per kernel first seen in phase `since` or later."""
        return {k: sum(p >= since for p in v.values()) for k, v in self.tune_keys.items()}

    def kernels(self) -> list[str]:
        return sorted(set(self.jit_keys) | set(self.tune_keys))

    def table(self, later: int = 1) -> list[dict[str, Any]]:
        """One row per kernel: launches, compilations (distinct JIT keys) and autotune runs, in all and first seen
        in phase `later` or after."""
        rows = []
        for k in self.kernels():
            jit, tune = self.jit_keys.get(k, {}), self.tune_keys.get(k, {})
            rows.append({"kernel": k, "launches": self.launches.get(k, 0), "compiles": len(jit),
                         "tunes": len(tune), "compiles_later": sum(p >= later for p in jit.values()),
                         "tunes_later": sum(p >= later for p in tune.values())})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {"jit_keys": {k: [[key, p] for key, p in v.items()] for k, v in self.jit_keys.items()},
                "tune_keys": {k: [[repr(key), p] for key, p in v.items()] for k, v in self.tune_keys.items()}}

    def _jit(self, name: str, key: str) -> None:
        self.launches[name] += 1
        self.jit_keys[name].setdefault(key, self.phase)

    def _tune(self, name: str, key: tuple[Any, ...]) -> None:
        self.tune_keys[name].setdefault(key, self.phase)


def kernel_name(fn: Any) -> str:
    """`module.qualname` of a jitted / interpreted / autotuned / heuristics-wrapped kernel."""
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def autotune_key(tuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The key `triton.runtime.autotuner.Autotuner.run` looks its cache up with."""
    all_args = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {k: v for k, v in all_args.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


class _Binders:
    """Triton's own argument binder per interpreted kernel, built as `JITFunction.create_binder` builds it."""

    def __init__(self) -> None:
        self._cache: dict[Any, Any] = {}

    def key(self, interpreted: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        from triton.backends.compiler import BaseBackend  # optional: triton
        from triton.runtime.jit import KernelParam, create_function_from_signature  # optional: triton

        fn = interpreted.fn
        binder = self._cache.get(fn)
        if binder is None:
            opts = interpreted.kwargs
            dns = opts.get("do_not_specialize") or []
            dna = opts.get("do_not_specialize_on_alignment") or []
            sig = inspect.signature(fn)
            params = [KernelParam(i, p, i in dns or p.name in dns, i in dna or p.name in dna)
                      for i, p in enumerate(sig.parameters.values())]
            binder = self._cache[fn] = create_function_from_signature(sig, params, BaseBackend)
        _, specialization, options = binder(*args, **kwargs)
        return str(specialization) + str(options)


@contextlib.contextmanager
def count_compilations() -> Iterator[CompileLog]:
    """Record every kernel launch's JIT key and every autotune run inside the block (see the module doc)."""
    from triton import knobs  # optional: triton
    from triton.runtime import autotuner  # optional: triton
    from triton.runtime.jit import JITFunction  # optional: triton

    log = CompileLog()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, new: Any) -> None:
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, new)

    tune_run = autotuner.Autotuner.run

    def counting_tune(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(self.configs) > 1:
            log._tune(kernel_name(self), autotune_key(self, args, kwargs))
        return tune_run(self, *args, **kwargs)

    patch(autotuner.Autotuner, "run", counting_tune)
    if knobs.runtime.interpret:
        from triton.runtime.interpreter import InterpretedFunction  # optional: triton

        binders = _Binders()
        interp_run = InterpretedFunction.run

        def counting_interp(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            log._jit(kernel_name(self), binders.key(self, args, kwargs))
            return interp_run(self, *args, grid=grid, warmup=warmup, **kwargs)

        patch(InterpretedFunction, "run", counting_interp)
    else:
        from triton.runtime import driver  # optional: triton
        from triton.runtime.jit import compute_cache_key  # optional: triton

        jit_run = JITFunction.run

        def counting_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            # the key JITFunction.run looks its kernel cache up with (it adds these two options first)
            opts = {**kwargs, "debug": kwargs.get("debug", self.debug) or knobs.runtime.debug,
                    "instrumentation_mode": knobs.compilation.instrumentation_mode}
            _, key_cache, _, _, binder = self.device_caches[driver.active.get_current_device()]
            _, specialization, options = binder(*args, **opts)
            log._jit(kernel_name(self), compute_cache_key(key_cache, specialization, options))
            return jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)

        patch(JITFunction, "run", counting_run)
    try:
        yield log
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


# ------------------------------------------------------------------------------------ torch.compile's graphs
@dataclasses.dataclass
class DynamoLog:
    """What torch.compile (dynamo) did inside `count_dynamo`'s block, per phase (as `CompileLog`).

    `graphs[p]`: graphs compiled in phase p (dynamo's `unique_graphs`: a first compile or a recompile);
    `breaks[p]`: graph breaks met while compiling in phase p, as {reason: count}; `recompiles`: (phase,
    message) of each recompile dynamo logged (the guard that failed). A graph first compiled after the first
    phase of a repeated workload is a recompile."""

    graphs: list[int] = dataclasses.field(default_factory=lambda: [0])
    breaks: list[dict[str, int]] = dataclasses.field(default_factory=lambda: [{}])
    recompiles: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    _mark: tuple[int, dict[str, int]] = (0, {})

    @property
    def phase(self) -> int:
        return len(self.graphs) - 1

    def _take(self) -> None:
        from torch._dynamo.utils import counters  # lazy: torch

        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        old_graphs, old_breaks = self._mark
        self.graphs[-1] += graphs - old_graphs
        for reason, n in breaks.items():
            if n > old_breaks.get(reason, 0):
                self.breaks[-1][reason] = self.breaks[-1].get(reason, 0) + n - old_breaks.get(reason, 0)
        self._mark = (graphs, breaks)

    def next_phase(self) -> int:
        self._take()
        self.graphs.append(0)
        self.breaks.append({})
        return self.phase

    def graphs_since(self, phase: int = 1) -> int:
        self._take()
        return sum(self.graphs[phase:])

    def break_calls(self, since: int = 0) -> dict[str, int]:
        """Graph breaks by the function they stopped at (`torch.compiler.disable`d calls by name; any other
        break by its reason's first line)."""
        self._take()
        out: dict[str, int] = {}
        for phase in self.breaks[since:]:
            for reason, n in phase.items():
                m = _SKIPPED.search(reason)
                key = m.group(1) if m else reason.splitlines()[0]
                out[key] = out.get(key, 0) + n
        return out


_SKIPPED = re.compile(r"Skip calling function `<function (\w+)")


@contextlib.contextmanager
def count_dynamo() -> Iterator[DynamoLog]:
    """Record the graphs, graph breaks and recompiles torch.compile makes inside the block (see `DynamoLog`).
    Reads dynamo's own counters (`torch._dynamo.utils.counters`) and its `recompiles` log."""
    from torch._dynamo.utils import counters  # lazy: torch

    log = DynamoLog()
    log._mark = (counters["stats"]["unique_graphs"], dict(counters["graph_break"]))

    class _Recompiles(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.recompiles.append((log.phase, record.getMessage()))

    logger = logging.getLogger("torch.__recompiles")
    handler = _Recompiles(logging.DEBUG)
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield log
    finally:
        log._take()
        logger.removeHandler(handler)
        logger.setLevel(before)
