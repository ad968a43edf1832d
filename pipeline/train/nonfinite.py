"""A step whose loss or gradient norm is NaN or inf stops the run before anything is saved from it.

    guard = NonFiniteGuard(cfg.train.nonfinite_patience, stage=cfg.stage)
    verdict = guard.observe(record)      # after loop.reduce_record: "ok" | "tolerate" | "stop"
    weights_finite(engine, ctx)          # collective, before a checkpoint is written

Design choices:
* It checks only what each step already brings to the host: the reduced loss and the gradient norm. So a
  finite run trains exactly as before. Every rank sees the same verdict and stops at the same step.
* `train.nonfinite_patience` such steps in a row are tolerated. A non-finite last step always stops.
* No checkpoint is written after a non-finite step, so the newest checkpoint comes from a finite state.
* The weights are checked before each checkpoint: one can overflow while the loss stays finite.
* The stop is an input error (`NonFiniteError`): one line, exit status 2, never retried by Ray. The step's
  record says why (`stopped`, `stopped_value`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

# the step quantities checked, in the order a message names them
CHECKED = ("loss", "grad_norm")
WORDS = {"loss": "the loss", "grad_norm": "the gradient norm", "weights": "the weights"}


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weights; the message names the step."""


def nonfinite_keys(loss: float, grad_norm: float) -> list[str]:
    """Which of this rank's step numbers (host floats) are not finite."""
    return [k for k, v in zip(CHECKED, (loss, grad_norm)) if not math.isfinite(v)]


class NonFiniteGuard:
    """Counts non-finite steps in a row and decides, from a reduced step record, whether the run goes on."""

    def __init__(self, patience: int = 0) -> None:
        self.patience = patience
        self.streak = 0

    def observe(self, record: dict[str, Any], last: bool = False) -> str:
        """"ok" (a finite step), "tolerate" (non-finite, within `patience`; no checkpoint from it) or "stop".
        A non-finite record gets `nonfinite` (which numbers) and `nonfinite_streak`; a stopping one also
        `stopped` and `stopped_value`."""
        bad = list(record.get("nonfinite") or ())
        if not bad:
            self.streak = 0
            return "ok"
        self.streak += 1
        record["nonfinite_streak"] = self.streak
        if self.streak <= self.patience and not last:
            return "tolerate"
        record["stopped"] = f"nonfinite_{bad[0]}"
        record["stopped_value"] = record.get(bad[0])
        return "stop"

    def describe(self, record: dict[str, Any]) -> str:
        """`step N: the loss is nan and the gradient norm is inf` for a non-finite record."""
        parts = [f"{WORDS[k]} is {record.get(k)}" for k in record.get("nonfinite") or ()]
        return f"step {record['step']}: " + " and ".join(parts)

    def stop_message(self, record: dict[str, Any], newest: str | None) -> str:
        streak = "" if self.streak <= 1 else f" ({self.streak} non-finite steps in a row)"
        return (f"{self.describe(record)}{streak}: training stopped (train.nonfinite_patience={self.patience}); "
                f"no checkpoint or model was written from this state; "
                + saved_hint(newest))


def saved_hint(newest: str | None) -> str:
    kept = (f"the newest checkpoint, {newest}, was written after a finite step" if newest
            else "no checkpoint was written yet")
    return f"{kept}. Lower optim.lr or check the data"


def own_elements(p: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This rank's elements of parameter `p`, flat: under ZeRO-3 its partition `ds_tensor` without the padding
    that makes every rank's partition the same size. DeepSpeed pads the partitions of the last ranks of a
    parameter whose size the ranks do not divide and leaves the padding uninitialised (`torch.empty`): whatever
    the allocator hands back, NaN bit patterns included. `rank`: this rank in the parameter's partition group
    (default: asked of torch.distributed). Without ZeRO-3, the whole parameter."""
    if not hasattr(p, "ds_tensor"):
        return p.data.view(-1)
    part = p.ds_tensor
    if rank is None:
        rank = dist.get_rank(group=getattr(p, "ds_process_group", None)) if dist.is_initialized() else 0
    valid = max(0, min(part.numel(), int(p.ds_numel) - part.numel() * rank))
    return part.view(-1).narrow(0, 0, valid)


@torch.no_grad()
def local_weights_finite(module: torch.nn.Module) -> bool:
    """Whether this rank's part of every parameter is finite (ZeRO-3: its partition, padding left out:
    `own_elements`); one host read per device the parameters live on."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for p in module.parameters():
        t = own_elements(p)
        if t.numel():
            flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(f).all()) for f in flags.values())


def weights_finite(module: torch.nn.Module, ctx) -> bool:
    """Collective: every rank's part of the weights is finite."""
    return ctx.all_max([0.0 if local_weights_finite(module) else 1.0])[0] == 0.0
