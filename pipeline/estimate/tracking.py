"""Memory and FLOPs over the estimated step: MemTracker with the per-GPU figure of ZeRO-3 at every op
(`StepMemory`), the step's phases (`Phases`, marked by `TrackedEngine`, `loss_marked`, `MarkedSource`) and the
progress lines of a long estimate (`Progress`); see the package docstring, "Memory"."""

from __future__ import annotations

import contextlib
import functools
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from hylo.kernels.fused_kl import chunked
from hylo.logs import get_logger
from hylo.pipeline.estimate.fake import HostOps
from hylo.pipeline.train.plain_engine import PlainEngine

logger = get_logger(__name__)

# Seconds between two progress lines inside one phase of the measured step (per layer); phase changes always print.
PROGRESS_EVERY_S = 10.0


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _grad_reftype():
    return _MemRefType.GRAD

# torch's ModTracker (under MemTracker) warns, and swaps the process's `warnings.formatwarning` for its own, when a
# module is entered again before it has left (a module that calls itself, a forward cut short by an exception): a
# note to torch's developers about its per-module statistics, which the estimate does not use
TRACKER_WARNING = "The module hierarchy tracking maybe be messed up"


@contextlib.contextmanager
def quiet_tracker() -> Iterator[None]:
    """Keep `TRACKER_WARNING` out of the user's terminal, and the process's warning format as it was."""
    fmt = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(TRACKER_WARNING), category=UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = fmt


class StepMemory:
    """MemTracker over the measured step, with the per-GPU figure of ZeRO-3 over W workers at every op."""

    def __init__(self, world_size: int, host: HostOps | None = None) -> None:
        outer = self
        self.host = host

        class Tracker(MemTracker):
            def __enter__(self):  # noqa: N805
                self._quiet = quiet_tracker()
                self._quiet.__enter__()
                return super().__enter__()

            def __exit__(self, *args):  # noqa: N805
                try:
                    return super().__exit__(*args)
                finally:
                    self._quiet.__exit__(None, None, None)

            def _update_peak_stats(self, peak_state):  # noqa: N805 - MemTracker's hook, after every op
                # in place of MemTracker's per-module peaks (a walk over every module at every op, which
                # the estimate does not use): the per-GPU figure
                outer._observe(self._curr_mem_snap)

            def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: N805
                # MemTracker hooks every parameter's gradient and fails on frozen ones (the teacher, the
                # base, stage 1's untrained layers): they never get one, so they get no hook
                # a hook on the parameter tensor itself also makes autograd accumulate a second gradient
                # (a tied weight's) out of place, a copy the step does not make: only the hook after
                # accumulation is installed
                for p in module.parameters():
                    if not install_grad_hooks or self._param_to_grad_hook_handles.get(p) is not None:
                        continue
                    post = _NO_HOOK
                    if p.requires_grad:
                        post = p.register_post_accumulate_grad_hook(self._mark_grad)
                    self._param_to_grad_hook_handles[p] = (_NO_HOOK, post)
                return super()._track_module_params_and_buffers(module, install_grad_hooks)

            def _mark_grad(self, param):  # noqa: N805
                self._update_and_maybe_create_winfos(param.grad, _grad_reftype())

            def _pre_fw_hook(self, module, inputs):  # noqa: N805
                # a root module called again in the same step (the teacher's per-length forwards, one
                # row per micro-batch) is tracked afresh: MemTracker refuses it, its per-module stats
                # (which the estimate does not use) would mix the calls
                if module in self.memory_tracking and not self._mod_tracker.is_bw:
                    parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                    if parents == {"Global"}:
                        del self.memory_tracking[module]
                return super()._pre_fw_hook(module, inputs)

        self.tracker = Tracker()
        self.world = world_size
        self.sharded_static = 0  # student parameters + fp32 masters + AdamW moments (bytes)
        self.phase = "before"
        self.step_floor: float | None = None
        self.peak = 0.0
        # the per-GPU peak at other world sizes of the same step (tables): W -> bytes, before ZeRO-3's extras
        self.other_worlds: tuple[int, ...] = ()
        self.other_peaks: dict[int, float] = {}
        self.phase_peaks: dict[str, float] = {}
        # a part of a phase marked apart (`mark`: the teacher's forward, `MarkedSource`) -> its peak; "unmarked": the
        # peak of the rest of the step
        self.mark: str | None = None
        self.mark_peaks: dict[str, float] = {}
        self.at_peak: dict[str, Any] = {}
        self.windows: list[list[float]] = []
        self.active = False

    @staticmethod
    def _snap(snap: dict) -> dict[str, int]:
        dev = next(iter(snap.values()), None)
        return {str(k.value if hasattr(k, "value") else k): v for k, v in (dev or {}).items()}

    def total(self) -> int:
        return self._snap(self.tracker._curr_mem_snap).get("Total", 0)

    def _observe(self, snap: dict) -> None:
        if not self.active:
            return
        s = self._snap(snap)
        total, grads = s.get("Total", 0) - (self.host.credit if self.host is not None else 0), s.get("Gradient", 0)
        W = self.world
        if self.phase == "optimizer":
            floor = self.step_floor or 0.0
            per_gpu = floor + (total - floor) / W
        else:
            state = self.sharded_static + grads
            per_gpu = total - state + state / W
        for w in self.windows:
            w[1] = max(w[1], total)
        for other in self.other_worlds:
            if self.phase == "optimizer":
                floor = self.step_floor or 0.0
                x = floor + (total - floor) / other
            else:
                x = total - (self.sharded_static + grads) * (1 - 1 / other)
            self.other_peaks[other] = max(self.other_peaks.get(other, 0.0), x)
        if per_gpu > self.phase_peaks.get(self.phase, 0.0):
            self.phase_peaks[self.phase] = per_gpu
        mark = self.mark or "unmarked"
        if per_gpu > self.mark_peaks.get(mark, 0.0):
            self.mark_peaks[mark] = per_gpu
        if per_gpu > self.peak:
            self.peak = per_gpu
            # inside the fused loss (`window`): the bytes it holds at the peak, above what was live as it began
            in_loss = max(total - self.windows[0][0], 0.0) if self.windows else None
            self.at_peak = {"phase": self.phase, "total": total, "gradients": grads, "loss_share": in_loss, **s}

    @contextlib.contextmanager
    def window(self) -> Iterator[list[float]]:
        """[total at entry, highest total inside] of a block (the fused loss)."""
        w = [float(self.total()), float(self.total())]
        self.windows.append(w)
        try:
            yield w
        finally:
            self.windows.remove(w)


class Phases:
    """FLOPs per phase of the step (deltas of the count), also by dtype class, and the memory phase markers."""

    def __init__(self, counter: HostOps, memory: StepMemory, progress: Progress | None = None) -> None:
        self.counter, self.memory, self.progress = counter, memory, progress
        self.flops: dict[str, int] = {}
        # phase -> dtype class (flops.py) -> FLOPs
        self.by_dtype: dict[str, dict[str, int]] = {}
        self.stack: list[str] = ["other"]
        self.last = 0
        self.last_by_dtype: dict[str, int] = {}
        self.loss_peaks: list[float] = []

    def _account(self) -> None:
        now = self.counter.flops
        self.flops[self.stack[-1]] = self.flops.get(self.stack[-1], 0) + now - self.last
        self.last = now
        phase = self.by_dtype.setdefault(self.stack[-1], {})
        for cls, n in self.counter.flops_by_dtype.items():
            if n != self.last_by_dtype.get(cls, 0):
                phase[cls] = phase.get(cls, 0) + n - self.last_by_dtype.get(cls, 0)
        self.last_by_dtype = dict(self.counter.flops_by_dtype)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._account()
        if self.progress is not None and name not in self.stack:
            self.progress.phase(name)
        self.stack.append(name)
        try:
            yield
        finally:
            self._account()
            self.stack.pop()


class TrackedEngine(PlainEngine):
    """PlainEngine, marking the step's phases (forward, backward, optimizer) for the counters."""

    phases: Phases | None = None

    def _phase(self, name: str):
        return self.phases.phase(name) if self.phases is not None else contextlib.nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._phase("student forward"):
            return super().__call__(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        with self._phase("backward (with recompute)"):
            super().backward(loss, scale_wrt_gas)

    def step(self) -> None:
        mem = self.phases.memory if self.phases is not None else None
        if mem is not None and mem.active:
            s = mem._snap(mem.tracker._curr_mem_snap)
            credit = mem.host.credit if mem.host is not None else 0
            mem.step_floor = s.get("Total", 0) - credit - mem.sharded_static - s.get("Gradient", 0)
            mem.phase = "optimizer"
        with self._phase("optimizer"):
            super().step()
        if mem is not None:
            mem.phase = "forward/backward"


@contextlib.contextmanager
def loss_marked(phases: Phases) -> Iterator[None]:
    """The fused loss's chunk loop (`_forward_backward`, which fused_linear_kl_div and the fused CE call)
    counted as its own phase, with its memory window."""
    original = chunked._forward_backward

    @functools.wraps(original)
    def marked(*args, **kwargs):
        with phases.phase("fused loss"), phases.memory.window() as w:
            out = original(*args, **kwargs)
        phases.loss_peaks.append(w[1] - w[0])
        return out

    chunked._forward_backward = marked
    try:
        yield
    finally:
        chunked._forward_backward = original


# the memory mark of the frozen model's forward (stage 2's teacher, stage 1's base): `StepMemory.mark_peaks`
FROZEN_FORWARD = "frozen model forward"


class MarkedSource:
    """A teacher source whose computation counts as the 'teacher forward' phase of the FLOPs, and is marked apart
    in the memory (`StepMemory.mark`: the step's peak outside it, for sp_teacher.py). Its `targets` takes what the source's
    takes (a token range, a group's shards), so that `BoundTeacher` calls it as it calls the source."""

    def __init__(self, source: Any, phases: Phases) -> None:
        self.source, self.phases = source, phases

        @functools.wraps(source.targets)
        def targets(rows, spec, **kwargs):
            it = iter(self.source.targets(rows, spec, **kwargs))
            memory = self.phases.memory
            while True:
                memory.mark = FROZEN_FORWARD
                try:
                    with self.phases.phase("teacher forward"):
                        item = next(it)
                except StopIteration:
                    return
                finally:
                    memory.mark = None
                yield item

        # `inspect.signature` follows `__wrapped__`: the source's own parameters
        self.targets = targets


class MarkedCall:
    """A callable (stage 1's `BaseLayerTargets`) whose calls count as the 'base forward' phase of the FLOPs, marked
    apart in the memory as `MarkedSource` marks the teacher's; every other attribute is the callable's own."""

    def __init__(self, target: Any, phases: Phases, name: str = "base forward") -> None:
        self._target, self._phases, self._name = target, phases, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        memory = self._phases.memory
        memory.mark = FROZEN_FORWARD
        try:
            with self._phases.phase(self._name):
                return self._target(*args, **kwargs)
        finally:
            memory.mark = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class Progress:
    """Progress lines of a long estimate on stderr: each phase of the measured step as it starts, and the
    layer it is in at most every `PROGRESS_EVERY_S` seconds (a 128K row of a 3B model takes minutes).
    `say(text)` prints `prefix: text`; `watch(model, what)` hooks the model's decoder layers."""

    def __init__(self, prefix: str, every_s: float = PROGRESS_EVERY_S, what: str = "measured step") -> None:
        self.prefix, self.every_s, self._clock, self.what = prefix, every_s, time.monotonic, what
        self._last = self._clock()
        self.phases: Phases | None = None
        # passes through each watched model's layers so far (a teacher runs one forward per document)
        self.passes: dict[str, int] = {}

    def say(self, text: str) -> None:
        logger.info(f"{self.prefix}: {text}")
        self._last = self._clock()

    def phase(self, name: str) -> None:
        self.say(f"{self.what}, {name}" if self.what else name)

    def watch(self, model: nn.Module | None, what: str) -> list[Any]:
        """Forward pre-hooks on every decoder layer of `model` (its `layers` lists); returns their handles."""
        if model is None:
            return []
        lists = [m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)]
        handles = []
        for layers in lists[:1]:
            n = len(layers)
            for i, layer in enumerate(layers):
                handles.append(layer.register_forward_pre_hook(functools.partial(self._layer, what, i, n)))
        return handles

    def _layer(self, what: str, i: int, n: int, *_: Any) -> None:
        if i == 0:
            self.passes[what] = self.passes.get(what, 0) + 1
        if self.phases is not None and self._clock() - self._last >= self.every_s:
            where = f"{self.what}, {self.phases.stack[-1]}" if self.what else self.phases.stack[-1]
            self.say(f"{where}: {what} layer {i + 1}/{n} (pass {self.passes.get(what, 1)})")
