"""The fake tensors the estimated step runs on (FakeTensorMode: shapes and dtypes, no data), the step's host
tensors run for real (`HostOps`), the values its reads of device tensors get (`HOST_VALUES`), the models built on
them, and the FLOP formulas counted per op (see the package docstring, "Device reads" and "FLOPs")."""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, sdpa_backward_flop_count, sdpa_flop_count

from hylo.kernels import packed_sdpa
from hylo.kernels.backend import fla_stand_in
from hylo.kernels.fla_shapes import FlaShapes
from hylo.kernels.fused_kl import inputs
from hylo.kernels.varlen import clear_row_caches
from hylo.pipeline.estimate.flops import OpClasses, dtype_class, kernel_standins, op_flops


class EstimateError(RuntimeError):
    """The step cannot run on fake tensors as it is (it reads a device value the estimate has none for)."""


# (file suffix, function) of every read of a device value in a step -> the value it gets, and why
HOST_VALUES: dict[tuple[str, str], tuple[Any, str]] = {
    ("pipeline/train/loop.py", "train_step"): (0.0, "the step's loss sums, read once at its end"),
    ("kernels/fused_kl/inputs.py", "check_deferred"): (False, "the fused KL's deferred input checks: none failed"),
    # the CPU rule (gpu=False): the same checks of the inputs' values, made at once (bool reads only)
    ("kernels/fused_kl/inputs.py", "*"): (False, "the fused KL's input value checks (NaN, ranges): they pass"),
    ("kernels/fused_kl/chunked.py", "backward"): (False, "grad_output == 1? No: the step scales its loss by W / n_global"),
    ("pipeline/train/plain_engine.py", "get_global_grad_norm"): (0.0, "the clipped gradient norm (reporting)"),
    # transformers' check whether a row packs several documents (`_untraced_masks`): where its positions are made on
    # the device (TeacherModel._forward_docs: 0..L-1 for each document), one document, so no mask is built
    ("transformers/masking_utils.py", "find_packed_sequence_indices"): (True, "one document per sequence (0..L-1)"),
}
# the estimator's own frames, skipped when looking for the line that reads a device value
_HERE = "/pipeline/estimate/"
GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm"})


def _call_site() -> traceback.FrameSummary | None:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or _HERE in path:
            continue
        return frame
    return None


class HostOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Under FakeTensorMode: an op whose tensors are all real (host data: the row as read, its boundaries)
    runs for real; a read of a fake (device) value gets its site's `HOST_VALUES` entry or raises."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        # FlopCounterMode's formulas (op -> FLOPs from shapes) while counting, else None
        self.flop_registry: dict | None = None
        self.flops = 0
        # the same FLOPs by the dtype class they run at on a GPU (flops.py), and how each op's class is found
        self.flops_by_dtype: dict[str, int] = {}
        self.classes = OpClasses()
        # (op, operand shapes) -> [calls, FLOPs] of the matrix products counted (the bench replays them)
        self.gemms: dict[tuple[str, tuple], list[int]] = {}
        # bytes of the sum the engine makes in place while the tracker sees it out of place (`_engine_sum`)
        self.credit = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self._host_value(args[0])
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        # the credit of the previous op's in-place sum ends here: the tracker (above this mode) has seen it
        self.credit = self._engine_sum(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise EstimateError(f"{func} at {_where()}: its output's size depends on device values, which the "
                                f"estimate does not have ({type(e).__name__})") from None
        if self.flop_registry is not None:
            n = op_flops(self.flop_registry, func, args, kwargs, out)
            if n is not None:
                self.flops += n
                cls = self.classes.of(func, args, kwargs)
                self.flops_by_dtype[cls] = self.flops_by_dtype.get(cls, 0) + n
                name = func._overloadpacket.__name__
                if name in GEMM_OPS:
                    key = (name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
                    entry = self.gemms.setdefault(key, [0, 0])
                    entry[0] += 1
                    entry[1] += n
        return out

    def count_kernel(self, flops: int, dtype: torch.dtype) -> None:
        """FLOPs of a kernel the estimate prices without running its arithmetic (fla's chunk scans:
        `hylo.kernels.fla_shapes`), whose operands are of `dtype`."""
        if self.flop_registry is not None:
            self.flops += flops
            cls = dtype_class(dtype)
            self.flops_by_dtype[cls] = self.flops_by_dtype.get(cls, 0) + flops

    @staticmethod
    def _engine_sum(func, args, kwargs) -> int:
        """Bytes of a sum autograd's engine makes in place but the tracker sees out of place, else 0.

        The engine sums the gradients a tensor receives from several uses (a residual stream, a tied
        weight) into its input buffer IN PLACE, unless a tensor is "subclass-like", which every tensor is
        while a Python dispatch mode is active (torch/csrc/autograd/input_buffer.cpp): under the tracker
        each such sum allocates a copy the step does not make. Such a sum is an `add` of two same-shaped
        tensors called from the engine itself (no Python frame between `_engine_run_backward` and the op);
        while it runs, its output's bytes are credited."""
        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
            return 0
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return 0
        # the innermost frame outside torch's dispatch plumbing (and the tracker), or the engine's own
        frame = sys._getframe(2)
        while frame is not None and "/torch/" in frame.f_code.co_filename.replace("\\", "/") \
                and frame.f_code.co_name != "_engine_run_backward":
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != "_engine_run_backward":
            return 0
        return a.numel() * a.element_size()

    def _host_value(self, t: torch.Tensor) -> Any:
        site = _call_site()
        path = site.filename.replace("\\", "/") if site else "?"
        for (suffix, function), (value, _why) in HOST_VALUES.items():
            if site is None or not path.endswith(suffix) or function not in (site.name, "*"):
                continue
            if function == "*" and t.dtype != torch.bool:
                continue
            if True:
                self.reads.append(f"{suffix}:{site.lineno} ({function})")
                if t.dtype == torch.bool:
                    return bool(value)
                return float(value) if t.dtype.is_floating_point else int(value)
        raise EstimateError(f"the step reads a device value ({t.dtype}) at {_where()}: the estimate has no "
                            "value for it; give the code the host value it needs, or list the site in "
                            "pipeline/estimate/fake.HOST_VALUES with the value it reads")


def _where() -> str:
    site = _call_site()
    return "?" if site is None else f"{site.filename}:{site.lineno} ({site.name})"


@contextlib.contextmanager
def _noop_conversions() -> Iterator[None]:
    """`module.to(device, dtype)` that changes nothing returns the module: under FakeTensorMode torch swaps
    every parameter even then, and fails on the fake mode's own weak references."""
    original = nn.Module._apply

    def _apply(self, fn, recurse=True):
        with torch.no_grad():
            if all(fn(t) is t for t in itertools.chain(self.parameters(), self.buffers())):
                return self
        return original(self, fn, recurse)

    nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _untraced_masks() -> Iterator[None]:
    """transformers' attention masks as a GPU run builds them. Its `is_tracing(tensor)` takes a fake tensor for a
    graph being traced, and then builds a [T, T] mask where a real run checks the positions and builds none (a
    causal SDPA): 16 GiB at 128K tokens. Here a fake tensor is a device tensor like any other; what the checks
    read of it is a `HOST_VALUES` entry."""
    import transformers.masking_utils as masking  # lazy: transformers

    original = masking.is_tracing
    masking.is_tracing = lambda tensor=None: original(None)
    try:
        yield
    finally:
        masking.is_tracing = original


@contextlib.contextmanager
def fake_tensors(gpu: bool = False) -> Iterator[HostOps]:
    """The fake mode the estimate runs in. `gpu`: the GDN / Mamba-2 scans as a GPU runs them, through fla's
    kernels, priced by their allocations and saved tensors (`hylo.kernels.fla_shapes`); else our torch scans,
    as a CPU step runs them. The one place the estimator chooses between the two."""
    host = HostOps()
    scans = fla_stand_in(FlaShapes(host.count_kernel)) if gpu else contextlib.nullcontext()
    # process-wide caches must not hand fake tensors to a real step later (nor real ones in): the grouped
    # attention's index tensors, the fused KL's deferred check flags (read here, as the step's end does)
    packed_sdpa._indices.cache_clear()
    clear_row_caches()
    standins = kernel_standins(host.classes)
    with FakeTensorMode(allow_non_fake_inputs=True), _noop_conversions(), _untraced_masks(), standins, host, scans:
        try:
            yield host
        finally:
            inputs.check_deferred()
            packed_sdpa._indices.cache_clear()
            clear_row_caches()


def build_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """A model of `config` in `dtype` (HyLo or any transformers causal LM), built on the current mode."""
    from hylo.config import HybridConfig  # lazy: transformers

    if isinstance(config, HybridConfig):
        from hylo.modeling import HyLoForCausalLM  # lazy: transformers

        model = HyLoForCausalLM._from_config(config, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM  # lazy: transformers

        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return cast_parameters(model, dtype)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter in `dtype`, as a checkpoint loaded in it (`load_hylo(path, dtype)`) has them,
    also those a layer creates in fp32 (GDN's A_log, dt_bias); rebound, not converted (fake parameters
    cannot be swapped in place, which `module.to(dtype)` does)."""
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                mod._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    return model


def fake_like(tree: Any) -> Any:
    """Fake CPU tensors of the shapes, dtypes and requires_grad of the real tensors in `tree` (under
    `fake_tensors()`): a measured call's inputs for its estimate."""
    def like(x):
        if not isinstance(x, torch.Tensor):
            return x
        return torch.empty(x.shape, dtype=x.dtype).requires_grad_(x.requires_grad)

    return tree_map(like, tree)



def causal_pairs(q_len: int, k_len: int) -> int:
    """(query, key) pairs a causal mask leaves visible, aligned at the lower right (query i sees keys up to
    i + k_len - q_len: a square's triangle, a split row's last queries over every earlier key)."""
    if q_len <= k_len:
        return q_len * (k_len - q_len) + q_len * (q_len + 1) // 2
    return k_len * (k_len + 1) // 2


def visible_share(query: Any, key: Any, is_causal: bool = False, attn_mask: Any = None) -> float:
    """The share of an SDPA call's [q_len, k_len] block a kernel that skips what is masked computes: the causal
    pairs (`causal_pairs`), or the entries of a real mask that let a key through (a boolean True, a float above
    -inf); 1 for no mask, and for a fake mask (no values to read: counted whole)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if is_causal:
        return causal_pairs(q_len, k_len) / (q_len * k_len)
    if attn_mask is None or isinstance(attn_mask, FakeTensor) or attn_mask.numel() == 0:
        return 1.0
    with unset_fake_temporarily():
        open_ = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        return float(open_.sum()) / open_.numel()


def flop_registry() -> dict:
    """torch.utils.flop_counter.FlopCounterMode's formulas (op -> FLOPs from its shapes), with those of the
    ops our CPU step runs that it lacks or counts otherwise: SDPA's CPU flash kernel, forward and backward (the
    [q, k] block of each call as torch counts a fused kernel, times `visible_share`: a causal call counts its
    causal pairs, as a kernel that skips the masked blocks runs it, where torch counts the whole block), the
    fused loss's in-place `addmm_`, GDN's triangular solve.

    Counted in `HostOps` rather than under FlopCounterMode itself: its module tracker keeps every module's
    outputs alive, which more than doubled the step's activation memory measured beside it."""
    aten = torch.ops.aten

    def cpu_flash(query, key, value, dropout_p=0.0, is_causal=False, *args, attn_mask=None, out_val=None,
                  **kwargs):
        dense = sdpa_flop_count(query.shape, key.shape, value.shape)
        return round(dense * visible_share(query, key, is_causal, attn_mask))

    def cpu_flash_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                           attn_mask=None, out_val=None, **kwargs):
        dense = sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
        return round(dense * visible_share(query, key, is_causal, attn_mask))

    # the raw tensors, not their shapes: a real mask's open entries are counted (`visible_share`)
    cpu_flash._get_raw = cpu_flash_backward._get_raw = True  # type: ignore[attr-defined]

    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
        return addmm_flop(self_shape, a_shape, b_shape)

    def solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs):
        # forward substitution: n^2 multiply-adds per right-hand side
        *batch, n, _ = a_shape
        return math.prod(batch) * n * n * b_shape[-1]

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_backward,
        aten.addmm_: addmm_inplace,
        aten.linalg_solve_triangular: solve_triangular,
    }).flop_registry


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the FLOPs it runs on real tensors), by torch's counter with `flop_registry`'s formulas (SDPA's CPU
    kernel included: each call's visible pairs, causal or let through by its mask). The lower-right causal bias of
    a split row's first document (hylo/seq_parallel.py) cannot be built under the counter's dispatch mode: it is
    an explicit boolean mask there (the same attention, its open entries counted)."""
    import torch.nn.attention.bias as masks  # lazy: imports torch._dynamo

    def explicit(q_len: int, k_len: int) -> torch.Tensor:
        return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)

    counter = FlopCounterMode(display=False)
    counter.flop_registry = flop_registry()
    bias = masks.causal_lower_right
    masks.causal_lower_right = explicit
    try:
        with counter:
            out = fn()
    finally:
        masks.causal_lower_right = bias
    return out, int(counter.get_total_flops())
