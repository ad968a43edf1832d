"""Argument checks of `fused_linear_kl_div` (the references in `naive.py` take their inputs as given).

Every problem becomes a `ValueError` that names the function and the argument (and, for streamed
teacher logits, the rows), because these inputs arrive from other processes (the teacher pool, the
offline top-k cache) where a silent NaN or an off-by-one vocabulary would poison a whole run.

Shapes, dtypes and devices are checked at once. Checks of the VALUES (NaN / inf, index ranges,
duplicate top-k ids, rows without mass, 0/1 masks) need the values on the host: on CPU tensors that
read is free and they raise at once, with the offending row or range; on an accelerator each one
would stop the host until the device catches up (a synchronisation per check, every micro-batch), so
there they only compute a device flag, and `check_deferred()` reads all pending flags in one go and
raises the first failed check's error (the training step calls it where it reads its loss anyway;
at most `MAX_PENDING` flags wait, then the next check reads them). `deferred_checks()` applies the
accelerator's rule to CPU tensors (tests of the GPU path). The teacher's LM head is the same tensor
every step: its finiteness is checked once per tensor version (`_checked_once`).

Legend: N tokens, H student hidden size, H' teacher hidden size, V vocabulary, k top-k width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator

import torch

from hylo.kernels.fused_kl.topk import TeacherTopK

LogitsFn = Callable[[int, int], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class CheckedTeacher:
    """The teacher arguments of one `fused_linear_kl_div` call, checked: exactly one form, `kind` 'hidden', 'topk'
    or 'logits_fn'."""

    kind: str
    hidden_NH: torch.Tensor | None = None
    weight_VH: torch.Tensor | None = None
    topk: TeacherTopK | None = None
    logits_fn: LogitsFn | None = None


def _fail(where: str, msg: str) -> None:
    raise ValueError(f"{where}: {msg}")


# ------------------------------------------------------------------ value checks: now or deferred
MAX_PENDING = 64
_PENDING: list[tuple[str, torch.Tensor]] = []
_DEFER_ON_CPU = [False]


def reads_are_free(device: torch.device) -> bool:
    """True where reading values back to the host costs no synchronisation (CPU, outside `deferred_checks`)."""
    return device.type == "cpu" and not _DEFER_ON_CPU[0]


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Treat CPU tensors like device tensors: value checks become flags, read by `check_deferred`."""
    before = _DEFER_ON_CPU[0]
    _DEFER_ON_CPU[0] = True
    try:
        yield
    finally:
        _DEFER_ON_CPU[0] = before


def _flag(where: str, msg: str, bad: torch.Tensor) -> None:
    """Record a 0-d bool device tensor that is True when the check failed."""
    _PENDING.append((f"{where}: {msg}", bad.reshape(())))
    if len(_PENDING) >= MAX_PENDING:
        check_deferred()


def check_deferred() -> None:
    """Read every pending value-check flag (one host read) and raise the first failed check's ValueError."""
    if not _PENDING:
        return
    pending = list(_PENDING)
    _PENDING.clear()
    device = pending[0][1].device
    failed = torch.stack([bad.to(device) for _, bad in pending]).tolist()
    for (msg, _), bad in zip(pending, failed):
        if bad:
            # a flagged tensor may be among those remembered as checked: check everything again
            _CHECKED.clear()
            raise ValueError(msg)


# id(tensor) -> (weak reference, tensor version) of LM heads whose values passed (or are flagged) once
_CHECKED: dict[int, tuple[weakref.ref, int]] = {}


def _checked_once(x: torch.Tensor) -> bool:
    """True if `x` passed its value check (or has a pending flag) and was not modified in place since."""
    seen = _CHECKED.get(id(x))
    return seen is not None and seen[0]() is x and seen[1] == x._version


def _remember_checked(x: torch.Tensor) -> None:
    if len(_CHECKED) > 64:
        for key in [k for k, (ref, _) in _CHECKED.items() if ref() is None]:
            del _CHECKED[key]
    _CHECKED[id(x)] = (weakref.ref(x), x._version)


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_no_nan_or_posinf(where: str, name: str, x: torch.Tensor) -> None:
    """NaN and +inf are rejected; -inf is a legitimate log-probability / logit (zero probability)."""
    if not reads_are_free(x.device):
        # one max pass: NaN propagates through amax, +inf is its own maximum
        top = x.amax() if x.numel() else x.new_zeros(())
        _flag(where, f"{name} contains NaN or +inf", torch.isnan(top) | torch.isposinf(top))
        return
    if torch.isnan(x).any():
        _fail(where, f"{name} contains NaN")
    if torch.isposinf(x).any():
        _fail(where, f"{name} contains +inf")


def check_inputs(
    where: str,
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    teacher_topk: TeacherTopK | tuple | None,
    teacher_logits_fn: LogitsFn | None,
    mask: torch.Tensor | None,
    temperature: float,
    reduction: str,
    chunk_size: int | None,
) -> tuple[CheckedTeacher, torch.Tensor | None]:
    """Validate everything; return the teacher spec and the mask as a bool tensor (or None)."""
    device = _check_linear(where, "student", "H", student_hidden, student_weight)
    n_tokens, vocab = student_hidden.shape[0], student_weight.shape[0]
    if vocab == 0:
        _fail(where, "student_weight has an empty vocabulary (V = 0)")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            math.isfinite(temperature) and temperature > 0):
        _fail(where, f"temperature must be a positive finite number, got {temperature!r}")
    if reduction not in ("mean", "sum"):
        _fail(where, f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        _fail(where, f"chunk_size must be a positive int or None, got {chunk_size!r}")

    given = [
        name
        for name, value in (
            ("teacher_hidden/teacher_weight", teacher_hidden if teacher_hidden is not None else teacher_weight),
            ("teacher_topk", teacher_topk),
            ("teacher_logits_fn", teacher_logits_fn),
        )
        if value is not None
    ]
    if len(given) != 1:
        _fail(
            where,
            "exactly one teacher form is required (teacher_hidden + teacher_weight, teacher_topk, or "
            f"teacher_logits_fn); got {', '.join(given) if given else 'none'}",
        )

    if given[0] == "teacher_hidden/teacher_weight":
        teacher = _check_hidden_teacher(where, teacher_hidden, teacher_weight, n_tokens, vocab, device)
    elif given[0] == "teacher_topk":
        teacher = CheckedTeacher("topk", topk=_check_topk(where, teacher_topk, n_tokens, vocab, device))
    else:
        if not callable(teacher_logits_fn):
            _fail(where, f"teacher_logits_fn must be callable(i, j) -> [j - i, V], got {teacher_logits_fn!r}")
        teacher = CheckedTeacher("logits_fn", logits_fn=teacher_logits_fn)

    return teacher, _check_mask(where, mask, n_tokens, device)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {_shape(x)}"
    return type(x).__name__


def _check_linear(where: str, who: str, dim: str, hidden: object, weight: object,
                  device: torch.device | None = None) -> torch.device:
    """`{who}_hidden` [N, dim] and `{who}_weight` [V, dim]: 2-D, floating point, one dtype, one hidden
    size, both on the student's `device` (None: this is the student, its hidden states' device)."""
    h_name, w_name = f"{who}_hidden", f"{who}_weight"
    for name, x, dims in ((h_name, hidden, f"[N, {dim}]"), (w_name, weight, f"[V, {dim}]")):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            _fail(where, f"{name} must be a {dims} tensor, got {_describe(x)}")
    if not hidden.dtype.is_floating_point:
        _fail(where, f"{h_name} must be floating point, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        _fail(where, f"{w_name} dtype {weight.dtype} does not match {h_name} dtype {hidden.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        _fail(where, f"{w_name} has hidden size {weight.shape[1]} (shape {_shape(weight)}) but {h_name} has "
              f"{hidden.shape[1]} (shape {_shape(hidden)})")
    device = hidden.device if device is None else device
    for name, x in ((h_name, hidden), (w_name, weight)):
        if x.device != device:
            _fail(where, f"{name} is on {x.device} but student_hidden is on {device}")
    return device


def _check_hidden_teacher(
    where: str,
    teacher_hidden: torch.Tensor | None,
    teacher_weight: torch.Tensor | None,
    n_tokens: int,
    vocab: int,
    device: torch.device,
) -> CheckedTeacher:
    if teacher_hidden is None or teacher_weight is None:
        missing = "teacher_weight" if teacher_weight is None else "teacher_hidden"
        _fail(where, f"{missing} is required together with the other (hidden-state teacher)")
    _check_linear(where, "teacher", "H'", teacher_hidden, teacher_weight, device)
    if teacher_hidden.shape[0] != n_tokens:
        _fail(where, f"teacher_hidden has {teacher_hidden.shape[0]} rows but student_hidden has {n_tokens}")
    if teacher_weight.shape[0] != vocab:
        _fail(where, f"teacher_weight has vocab size {teacher_weight.shape[0]} but student_weight has {vocab}")
    for name, x in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if not x.numel() or (x is teacher_weight and _checked_once(x)):
            continue
        # One min/max pass (NaN propagates through both) instead of an isfinite temporary.
        bad = ~torch.isfinite(torch.stack(torch.aminmax(x))).all()
        if not reads_are_free(x.device):
            _flag(where, f"{name} contains NaN or inf", bad)
        elif bool(bad):
            _fail(where, f"{name} contains NaN or inf")
        if x is teacher_weight:
            _remember_checked(x)
    return CheckedTeacher("hidden", hidden_NH=teacher_hidden.detach(), weight_VH=teacher_weight.detach())


def _check_topk(
    where: str, topk: TeacherTopK | tuple, n_tokens: int, vocab: int, device: torch.device
) -> TeacherTopK:
    if not isinstance(topk, TeacherTopK):
        if not isinstance(topk, tuple | list) or len(topk) not in (2, 3):
            _fail(
                where,
                "teacher_topk must be a TeacherTopK or a tuple (logprobs [N, k], indices [N, k]"
                f"[, tail_logmass [N]]), got {type(topk).__name__}",
            )
        topk = TeacherTopK(*topk)
    logprobs, indices, tail = topk
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        _fail(where, f"teacher_topk.logprobs must be a [N, k] tensor, got {_describe(logprobs)}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        _fail(where, f"teacher_topk.indices must be a [N, k] tensor, got {_describe(indices)}")
    if not logprobs.dtype.is_floating_point:
        _fail(where, f"teacher_topk.logprobs must be floating point, got {logprobs.dtype}")
    if indices.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        _fail(where, f"teacher_topk.indices must be an integer tensor, got {indices.dtype}")
    if logprobs.shape != indices.shape:
        _fail(
            where,
            f"teacher_topk.logprobs shape {_shape(logprobs)} does not match teacher_topk.indices shape "
            f"{_shape(indices)}",
        )
    if logprobs.shape[0] != n_tokens:
        _fail(where, f"teacher_topk has {logprobs.shape[0]} rows but student_hidden has {n_tokens}")
    k = logprobs.shape[1]
    if not 1 <= k <= vocab:
        _fail(where, f"teacher_topk has k={k}; it must be in 1..V={vocab}")
    for name, x in (("teacher_topk.logprobs", logprobs), ("teacher_topk.indices", indices)):
        if x.device != device:
            _fail(where, f"{name} is on {x.device} but student_hidden is on {device}")
    free = reads_are_free(device)
    if n_tokens and not free:
        lo, hi = torch.aminmax(indices)
        _flag(where, f"teacher_topk.indices out of range: vocab size is {vocab}", (lo < 0) | (hi >= vocab))
        sorted_idx = indices.sort(dim=1).values
        _flag(where, "teacher_topk.indices has duplicate ids in a row",
              (sorted_idx[:, 1:] == sorted_idx[:, :-1]).any())
    elif n_tokens:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= vocab:
            _fail(where, f"teacher_topk.indices out of range: found [{lo}, {hi}], vocab size is {vocab}")
        sorted_idx = indices.sort(dim=1).values
        dup_rows = (sorted_idx[:, 1:] == sorted_idx[:, :-1]).any(dim=1).nonzero()
        if dup_rows.numel():
            _fail(where, f"teacher_topk.indices has duplicate ids in row {int(dup_rows[0])}")
    _check_no_nan_or_posinf(where, "teacher_topk.logprobs", logprobs)
    if tail is not None:
        if not isinstance(tail, torch.Tensor) or tail.shape != (n_tokens,):
            _fail(where, f"teacher_topk.tail_logmass must be a [N={n_tokens}] tensor, got {_describe(tail)}")
        if not tail.dtype.is_floating_point:
            _fail(where, f"teacher_topk.tail_logmass must be floating point, got {tail.dtype}")
        if tail.device != device:
            _fail(where, f"teacher_topk.tail_logmass is on {tail.device} but student_hidden is on {device}")
        _check_no_nan_or_posinf(where, "teacher_topk.tail_logmass", tail)
    mass = torch.logsumexp(logprobs.float(), dim=1)
    if tail is not None and k < vocab:
        mass = torch.logaddexp(mass, tail.float())
    if not free:
        _flag(where, "teacher_topk has a row with no probability mass (all log-probs -inf)",
              torch.isneginf(mass).any())
        # until the flag is read, out-of-range ids must not reach a gather (a device-side fault)
        return TeacherTopK(logprobs, indices.clamp(0, vocab - 1) if n_tokens else indices, tail)
    empty = torch.isneginf(mass).nonzero()
    if empty.numel():
        _fail(where, f"teacher_topk row {int(empty[0])} has no probability mass (all log-probs -inf)")
    return TeacherTopK(logprobs, indices, tail)


def _check_mask(where: str, mask: torch.Tensor | None, n_tokens: int, device: torch.device) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != (n_tokens,):
        _fail(where, f"mask must be a [N={n_tokens}] tensor, got {_describe(mask)}")
    if mask.device != device:
        _fail(where, f"mask is on {mask.device} but student_hidden is on {device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        _fail(where, f"mask must be bool or an integer 0/1 tensor, got {mask.dtype}")
    bad = ((mask != 0) & (mask != 1)).any()
    if not reads_are_free(device):
        _flag(where, "mask must hold only 0 and 1", bad)
    elif bad:
        _fail(where, "mask must hold only 0 and 1")
    return mask != 0


def check_teacher_logits(where: str, logits: object, i: int, j: int, vocab: int) -> torch.Tensor:
    """Check one chunk returned by `teacher_logits_fn(i, j)`."""
    if not isinstance(logits, torch.Tensor) or logits.shape != (j - i, vocab):
        got = _describe(logits)
        _fail(where, f"teacher_logits_fn({i}, {j}) must return a [{j - i}, V={vocab}] tensor, got {got}")
    if not logits.dtype.is_floating_point:
        _fail(where, f"teacher_logits_fn({i}, {j}) returned dtype {logits.dtype}; expected floating point")
    lo, hi = torch.aminmax(logits)
    if not reads_are_free(logits.device):
        where_fn = f"teacher_logits_fn({i}, {j}) output"
        _flag(where, f"{where_fn} contains NaN or +inf", torch.isnan(hi) | torch.isposinf(hi))
        _flag(where, f"{where_fn} has a row that is all -inf", torch.isneginf(logits).all(dim=1).any())
        return logits
    if torch.isnan(hi):
        _fail(where, f"teacher_logits_fn({i}, {j}) output contains NaN")
    if torch.isposinf(hi):
        _fail(where, f"teacher_logits_fn({i}, {j}) output contains +inf")
    if torch.isneginf(lo):
        empty = torch.isneginf(logits).all(dim=1).nonzero()
        if empty.numel():
            _fail(where, f"teacher_logits_fn({i}, {j}) output row {i + int(empty[0])} is all -inf")
    return logits
