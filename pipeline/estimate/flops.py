"""The FLOPs of one op of the estimated step and the dtype class they run at on a GPU (`HostOps` counts both).

Classes (`gpus.GPU.rate` times each): "bf16" and "fp16" (tensor cores), "tf32" (fp32 operands where torch
allows TF32: `torch.backends.cuda.matmul.allow_tf32`, for convolutions `torch.backends.cudnn.allow_tf32`),
"fp32" (the vector units). Any other dtype (float64, float8_e4m3fn, ...) is its own class, named after the
dtype: counted and shown, never timed (no GPU here has a rate for it).

An op's class is the narrowest floating dtype among its tensor inputs: a product with `out_dtype`
(bf16 x bf16 -> fp32, `torch.mm(..., out_dtype=torch.float32)`) and an attention backward whose logsumexp
is fp32 both run at the bf16 rate.

Kernel stand-ins (`kernel_standins`): on fake (CPU) tensors the GDN / Mamba-2 layers run our torch scans,
which compute in fp32 where fla's Triton kernels multiply tiles of the input dtype on tensor cores (states
cast to it before each `tl.dot`). Their FLOPs keep the torch scans' count but take the class of the
kernel's inputs, forward and backward: an op runs inside a stand-in's call, or in backward its autograd node
was created inside one (a sequence number in the call's range). fp32 inputs take "tf32", `tl.dot`'s
default precision for fp32 operands.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

# the named classes; any other dtype is named by `str(dtype)` without "torch."
CLASSES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_CONVOLUTIONS = frozenset({"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                           "convolution_overrideable", "_slow_conv2d_forward"})
# (module, function) of the torch paths that stand in for a GPU kernel: their first tensor argument's dtype
# is the kernel's operand dtype
STANDINS = (("hylo.kernels.gdn.chunk", "torch_chunk_gated_delta_rule"),
            ("hylo.kernels.ssd.chunk", "torch_chunk_ssd"))


def dtype_class(dtype: torch.dtype, convolution: bool = False) -> str:
    """The class an op whose operands are `dtype` runs at (module docstring)."""
    if dtype == torch.float32:
        tf32 = torch.backends.cudnn.allow_tf32 if convolution else torch.backends.cuda.matmul.allow_tf32
        return "tf32" if tf32 else "fp32"
    return CLASSES.get(dtype) or str(dtype).removeprefix("torch.")


def operand_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The narrowest floating dtype among the op's tensor inputs (None: none is floating)."""
    dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return min(dtypes, key=lambda d: (d.itemsize, str(d)), default=None)


def op_flops(registry: dict, func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """FLOPs of one op by FlopCounterMode's formula for it (None: no formula). The `out_dtype` overloads
    (`mm.dtype`, `addmm.dtype`, ...) pass their dtype positionally, where some formulas (addmm's) take
    `out_shape`: it is dropped, the product's FLOPs do not depend on it."""
    formula = registry.get(func._overloadpacket)
    if formula is None:
        return None
    if func._overloadname.startswith("dtype"):
        args = tuple(a for a in args if not isinstance(a, torch.dtype))
        kwargs = {k: v for k, v in kwargs.items() if k != "out_dtype"}
    return formula(*args, **kwargs, out_val=out)


def _sequence_nr() -> int:
    """The next autograd node's sequence number (per thread; a node made now takes it)."""
    with torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class OpClasses:
    """The class of each counted op: its operands' (`dtype_class`), or a kernel stand-in's (module docstring)."""

    def __init__(self) -> None:
        # the classes of the stand-ins being called (innermost last)
        self.inside: list[str] = []
        # [first, end) sequence numbers of the autograd nodes each stand-in call made, and its class
        self.ranges: list[tuple[int, int, str]] = []

    def of(self, func: Any, args: tuple, kwargs: dict) -> str:
        if self.inside:
            return self.inside[-1]
        if self.ranges:
            node = torch._C._current_autograd_node()
            if node is not None:
                seq = node._sequence_nr()
                for first, end, cls in reversed(self.ranges):
                    if first <= seq < end:
                        return cls
        dtype = operand_dtype(args, kwargs)
        if dtype is None:
            return "non-floating"
        return dtype_class(dtype, func._overloadpacket.__name__ in _CONVOLUTIONS)

    def standin(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """`original` (a torch path standing in for a GPU kernel) whose ops count at its inputs' class."""

        @functools.wraps(original)
        def run(*args: Any, **kwargs: Any) -> Any:
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            if first is None:
                return original(*args, **kwargs)
            cls = "tf32" if first.dtype == torch.float32 else dtype_class(first.dtype)
            start = _sequence_nr()
            self.inside.append(cls)
            try:
                out = original(*args, **kwargs)
            finally:
                self.inside.pop()
            self.ranges.append((start, _sequence_nr(), cls))
            return out

        return run


@contextlib.contextmanager
def kernel_standins(classes: OpClasses) -> Iterator[None]:
    """Every function of `STANDINS` counted at its kernel's class while the block runs."""
    saved = []
    for module_name, name in STANDINS:
        module = importlib.import_module(module_name)
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, classes.standin(getattr(module, name)))
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
