"""What the per-worker loop (loop.py) and the stages (stage1.py, stage2.py) share. The loop imports no stage.

Legend: T tokens of a packed row, N ranks of a sequence-parallel group.

    stage = Stage(number, build, loop.train_step)   # each stage module defines one: STAGE
    task = stage.build(ctx, lr_lambda)              # the engine, the student, and what the step asks of a stage
    result = stage.train_step(task, rows, ctx)      # the step over this rank's rows -> StepResult

Hooks: the loop registers callables on the context (fault injection, for the recovery tests). They run at
named points: "mid_step" (after the backward of a step's first micro-batch, before its `engine.step()`) and
"after_checkpoint" (once a step's checkpoint is reported).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hylo.kernels.varlen import DocBounds
from hylo.pipeline.data.rows import PAD_DOC_ID, PackedRow
from hylo.pipeline.train.config import StageConfig
from hylo.pipeline.train.storage import Loc
from hylo.seq_parallel import RowShard

Hook = Callable[[str, "WorkerContext"], None]


@dataclass
class WorkerContext:
    cfg: StageConfig
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    run_dir: Path
    grad_accum: int
    step: int = 0
    # where the run lives (local directory or URI); run_dir is its local directory or local mirror
    run_loc: Loc | None = None
    hooks: list[Hook] = field(default_factory=list)
    # sequence parallelism: ranks [g*N, (g+1)*N) hold the same rows, split by tokens (N = sequence_parallel);
    # sp_group is their process group (None at N = 1: no group, no collective), sp_rank this rank's place in it
    sp_group: Any = None
    sp_rank: int = 0
    sequence_parallel: int = 1
    # the trainer's start-up clock (train/startup.py): the engine factory counts DeepSpeed's set-up in it
    startup: Any = None

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def hook(self, point: str) -> None:
        """Run the registered hooks at the named point of the loop or the step."""
        for h in self.hooks:
            h(point, self)


class SoloContext(WorkerContext):
    """A context whose all-reduces are the identity: one process standing for every rank of its group (no
    process group needed), for the step run outside the trainer (the estimator, the GPU check, the benches)."""

    def all_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def all_max(self, values: list[float]) -> list[float]:
        return list(values)


@dataclass
class StepResult:
    """One optimiser step on one rank: `sums` holds `loss_sum`, the stage's other `*_sum` terms,
    `loss_tokens` and `tokens` (this rank's, not yet reduced); `lr` is the learning rate of the step,
    `grad_norm` the global gradient norm DeepSpeed clipped with (0.0 where it computes none)."""

    sums: dict[str, float]
    lr: float
    grad_norm: float


@dataclass(frozen=True)
class RowPart:
    """This rank's tokens [start, end) of one packed row: the whole row, or its shard of a split row.

    The loop's step makes it once per row (`loop.row_part`); a stage reads its inputs from it."""

    # the row as the reader checked it (host tensors), and the same row on the step's device
    row: PackedRow
    device_row: PackedRow
    start: int
    end: int
    # the boundaries of these tokens: the row's own, or the shard's (`RowShard.local`)
    bounds: DocBounds
    # the split row's shard (hylo/seq_parallel.py); None for the whole row
    shard: RowShard | None = None

    @property
    def token_range(self) -> tuple[int, int] | None:
        """(start, end) of a split row, None for the whole row: what the teacher and the base model take."""
        return None if self.shard is None else (self.start, self.end)

    @property
    def positions(self) -> torch.Tensor:
        """[end - start] in-document positions of these tokens in the unsplit row."""
        return self.bounds.positions

    def of(self, x_T: torch.Tensor) -> torch.Tensor:
        """This part's tokens of a per-token tensor [T] of the row."""
        return x_T[self.start:self.end]

    @property
    def real_tokens(self) -> int:
        """Tokens of real documents in this part (not the packer's padding document): host ints only."""
        pad = sum(max(0, min(e, self.end) - max(s, self.start))
                  for doc, (s, e) in zip(self.row.doc_ids or (), self.row.documents()) if doc == PAD_DOC_ID)
        return self.end - self.start - pad

    @property
    def loss_tokens(self) -> int:
        """Tokens of this part whose label is scored (a host count: the row's own for the whole row)."""
        if self.shard is None:
            return self.row.loss_tokens
        return int(self.row.loss_mask[self.start:self.end].sum())


class Task(Protocol):
    """What a stage's `build` gives the loop: the engine it steps and checkpoints, the student it consolidates,
    and the parts of the step that differ by stage (`loop.train_step` runs the rest)."""

    engine: Any
    student: torch.nn.Module

    def terms(self) -> dict[str, float]:
        """The module's loss terms in the order it returns them, by name, with their weights in the loss."""

    def counted(self, part: RowPart) -> int:
        """The tokens of `part` the step's loss is a mean over (a host count)."""

    def inputs(self, parts: list[RowPart], ctx: WorkerContext) -> Iterator[tuple[Any, ...]]:
        """The module's inputs for each part in turn (made as the step reaches it)."""


@dataclass(frozen=True)
class Stage:
    number: int
    build: Callable[[WorkerContext, Callable[[int], float]], Task]
    train_step: Callable[[Any, list[PackedRow], WorkerContext], StepResult]


def sequence_parallel_group(rank: int, world_size: int, sequence_parallel: int) -> tuple[Any, int]:
    """(this rank's sequence-parallel process group, its rank in it): ranks [g*N, (g+1)*N) form group g.

    Collective: every rank creates every group, in the same order (`dist.new_group`'s rule). At N = 1 no
    group is made (None: a step at N = 1 runs no collective of its own). N divides the workers (config.py)."""
    if sequence_parallel == 1:
        return None, 0
    N = sequence_parallel
    groups = [dist.new_group(list(range(g * N, (g + 1) * N))) for g in range(world_size // N)]
    return groups[rank // N], rank % N


def row_to_device(row: PackedRow, device: torch.device) -> PackedRow:
    """A checked packed row (as the reader yields it) on `device`, for a step's forward (`PackedRow.to`).

    Its host boundaries come along: `row.bounds()` gives the model the `DocBounds` the reader checked, so
    the forward neither checks them again nor reads them back from the device."""
    if row.loss_mask is None:
        raise ValueError(f"row {row.key or row.row_id}: a training row needs a loss_mask")
    return row.to(device)
