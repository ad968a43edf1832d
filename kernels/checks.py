"""Argument checks shared by the linear-recurrence ops (`hylo.kernels.gdn`, `hylo.kernels.ssd`): tensor types
and devices, packed-row boundaries `cu_seqlens` (the rule itself lives in `hylo.kernels.varlen`), the
`initial_state` shape.

Each op raises its own error class with its own function name: the checks here take the op's
`bad(message)` callback, which prefixes the name and raises, and the letters the op's docstring
uses (N or S sequences, the state's dims), so each message speaks the op's own terms.

An op family's signature is written once, as a dataclass of its arguments (`SSDArgs`, `GDNArgs`): `takes`
gives each of the family's functions that signature, and its body gets the arguments bound as one object.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from hylo.kernels.varlen import Bad, DocBounds, doc_bounds

P = ParamSpec("P")
A = TypeVar("A")
R = TypeVar("R")


def takes(args: Callable[P, A]) -> Callable[[Callable[[A], R]], Callable[P, R]]:
    """`@takes(SSDArgs) def op(a: SSDArgs)` makes `op(x, dt, ...)`: called with `SSDArgs`'s fields (in order,
    with their defaults, positionally or by name), its body gets them as one `SSDArgs` (which it never changes).
    A plain, not frozen, dataclass: a frozen one's construction doubles the wrapper's cost, about 1.5 us a
    call of a decode step's op."""

    def wrap(body: Callable[[A], R]) -> Callable[P, R]:
        def op(*a: P.args, **kw: P.kwargs) -> R:
            return body(args(*a, **kw))

        op.__name__, op.__qualname__, op.__module__, op.__doc__ = (body.__name__, body.__qualname__,
                                                                    body.__module__, body.__doc__)
        op.__signature__ = inspect.signature(args).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(body).return_annotation)
        return op

    return wrap


def shape_str(x: torch.Tensor) -> str:
    """A tensor's shape as `[2, 3, 4]`, for error messages."""
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (tests), else float32 (fp16/bf16 inputs are upcast)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def check_float_tensors(bad: Bad, named: dict[str, torch.Tensor], ref_name: str) -> None:
    """Each of `named` (in order) is a floating-point tensor on the device of `named[ref_name]`,
    which should come first so that it is checked before its device is read."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            bad(f"{name} must be a floating-point tensor, got {t.dtype}")
        ref = named[ref_name]
        if t.device != ref.device:
            bad(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_packed(bad: Bad, cu_seqlens: torch.Tensor | DocBounds, batch: int, T: int) -> DocBounds:
    """Packed-row boundaries for a [batch, T, ...] input, checked under the one rule of
    `hylo.kernels.varlen` (given `DocBounds` are only matched against T)."""
    if batch != 1:
        bad(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
    return doc_bounds(cu_seqlens, T, bad)


def check_sequences(bad: Bad, cu_seqlens: torch.Tensor | DocBounds | None, batch: int, T: int,
                    initial_state: torch.Tensor | None, dims: tuple[str, ...], per_sequence: tuple[int, ...],
                    ref_name: str, ref_device: torch.device) -> tuple[DocBounds | None, int]:
    """The packed row's boundaries (None unpacked) and the sequence count (documents when packed, else the
    batch), with `initial_state` checked against [sequences, *per_sequence] (named `dims`)."""
    bounds = None if cu_seqlens is None else check_packed(bad, cu_seqlens, batch, T)
    n = batch if bounds is None else bounds.num_docs
    if initial_state is not None:
        check_initial_state(bad, initial_state, dims, (n, *per_sequence), bounds is not None, ref_name, ref_device)
    return bounds, n


def check_initial_state(
    bad: Bad,
    initial_state: torch.Tensor,
    dims: tuple[str, ...],
    expected: tuple[int, ...],
    packed: bool,
    ref_name: str,
    ref_device: torch.device,
) -> None:
    """Validate `initial_state` against the shape `expected`, named `dims` (the first one counts
    sequences: from cu_seqlens when `packed`, else the batch), and its device against the input
    `ref_name`'s."""
    if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != expected:
        got = shape_str(initial_state) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
        bad(f"initial_state must be [{', '.join(dims)}] = [{', '.join(str(n) for n in expected)}] "
            f"({dims[0]} = {'number of sequences in cu_seqlens' if packed else 'batch size'}), "
            f"got {got}")
    if initial_state.device != ref_device:
        bad(f"initial_state is on {initial_state.device} but {ref_name} is on {ref_device}")
