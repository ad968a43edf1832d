"""Counting host reads of tensor values: the synchronisations a training step pays on a GPU.

On a GPU, every copy of a device tensor's values to the host (`.item()`, `.tolist()`, `bool(t)`,
`int(t)`, `.cpu()`, a data-dependent output size such as `nonzero` or boolean indexing) waits until the
device has finished all queued work, so the host stops running ahead of the device. Two counters:

* `HostReadLog` (any device, CPU included): logs every such call made from Python on any tensor while
  it is active (forward and backward), with the first caller frame outside torch. On CPU the reads
  cost nothing, but the same Python code makes the same calls on a GPU, so a CPU test of the count is
  a test of the GPU code path (calls inside C++ kernels are not seen: `cuda_sync_log` covers those).
* `cuda_sync_log` (CUDA only): `torch.cuda.set_sync_debug_mode("warn")` around the region; every
  synchronising CUDA call, from Python or C++, warns, and the warnings are collected.

Both are diagnostics for tests and `bench/gpu_check.py`; nothing in the training path uses them.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator

import torch

# Tensor methods that copy values to the host.
HOST_READ_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})
# Ops whose output size depends on the values (the host must read them to allocate the output).
SIZED_BY_VALUES = frozenset({"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"})


def _is_host_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in HOST_READ_METHODS or name in SIZED_BY_VALUES:
        return True
    if name == "to":
        # a copy to the host; on CPU tensors `.to("cpu")` is a no-op, not counted
        on_host = isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
        return not on_host and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and len(args) > 1 and isinstance(args[1], torch.Tensor)
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _caller() -> str:
    """The innermost frame outside torch and this file: where the read was written."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("kernels/host_reads.py"):
            continue
        return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


class HostReadLog:
    """`with HostReadLog() as log: ...` then `log.reads` lists (op name, caller) of every host read.

    The tensor methods (and the `torch.*` functions of the same names) are wrapped on the class for the
    duration of the block, not through a `TorchFunctionMode`: a mode is not active inside autograd's
    backward, where a custom Function's host read would go unseen. One log at a time (not re-entrant)."""

    _active: HostReadLog | None = None

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self._saved: list[tuple[object, str, object, bool]] = []

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        log = self.reads

        def wrapper(*args, **kwargs):
            if _is_host_read(name, args, kwargs):
                log.append((name, _caller()))
            return original(*args, **kwargs)

        own = name in vars(owner)
        self._saved.append((owner, name, original, own))
        setattr(owner, name, wrapper)

    def __enter__(self) -> HostReadLog:
        if HostReadLog._active is not None:
            raise RuntimeError("HostReadLog is not re-entrant")
        HostReadLog._active = self
        for name in (*HOST_READ_METHODS, *SIZED_BY_VALUES, "to", "repeat_interleave", "__getitem__"):
            self._wrap(torch.Tensor, name)
        for name in (*SIZED_BY_VALUES, "repeat_interleave"):
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()
        HostReadLog._active = None

    def __len__(self) -> int:
        return len(self.reads)


@contextlib.contextmanager
def cuda_sync_log() -> Iterator[list[str]]:
    """Collect the messages of every synchronising CUDA call in the block (CUDA's sync debug mode)."""
    messages: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield messages
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    messages.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())
