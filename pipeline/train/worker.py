"""What the per-worker loop (loop.py) and the stages (stage1.py, stage2.py) share, so neither imports the other.

Legend: T tokens of a packed row, G micro-batches (rows) per optimiser step on this rank.

    stage = Stage(number, build, train_step)      # each stage module defines one: STAGE
    task = stage.build(ctx, lr_lambda)            # the DeepSpeed engine and the student it trains
    result = stage.train_step(task, rows, ctx)    # THE step over this rank's G rows -> StepResult

Design choices:
* The driver picks the stage and hands it to `loop.train_worker`; a stage knows nothing of the loop
  (sessions, resume, checkpoints, metrics files) and the loop nothing of a stage's loss.
* A step returns this rank's sums (the loop reduces them over ranks and divides by the global number
  of loss tokens) plus the learning rate it trained with and the gradient norm DeepSpeed computed.
* Hooks: the loop registers callables on the context (fault injection, for the recovery tests); the
  loop and the step call `ctx.hook(point)` at named points: "mid_step" (after the backward of a step's
  first micro-batch, before its `engine.step()`) and "after_checkpoint" (once a step's checkpoint is
  reported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.train.config import StageConfig
from hylo.pipeline.train.storage import Loc

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
    # sequence parallelism (train.sequence_parallel = sp_size): ranks [g*sp_size, (g+1)*sp_size) hold the same
    # rows, split by tokens; sp_group is their process group (None at sp_size 1: no group, no collective),
    # sp_rank this rank's place in it; dp_rank / dp_size: the group's index / the number of groups (the
    # data-parallel ranks the reader strides over). Defaults: no sequence parallelism.
    sp_group: Any = None
    sp_rank: int = 0
    sp_size: int = 1
    dp_rank: int = -1
    dp_size: int = -1
    # the trainer's start-up clock (train/startup.py): the engine factory counts DeepSpeed's set-up in it
    startup: Any = None

    def __post_init__(self) -> None:
        if self.dp_rank < 0:
            self.dp_rank = self.rank // self.sp_size
        if self.dp_size < 0:
            self.dp_size = self.world_size // self.sp_size

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


class Task(Protocol):
    """What a stage's `build` gives the loop: the engine it checkpoints, the student it consolidates."""

    engine: Any
    student: torch.nn.Module


@dataclass(frozen=True)
class Stage:
    number: int
    build: Callable[[WorkerContext, Callable[[int], float]], Task]
    train_step: Callable[[Any, list[PackedRow], WorkerContext], StepResult]


def sequence_parallel_group(rank: int, world_size: int, size: int) -> tuple[Any, int]:
    """(this rank's sequence-parallel process group, its rank in it): ranks [g*size, (g+1)*size) form group g.

    Collective: every rank creates every group, in the same order (`dist.new_group`'s rule). At size 1 no
    group is made (None: a step at size 1 runs no collective of its own)."""
    if world_size % size:
        raise ValueError(f"train.sequence_parallel={size} does not divide the {world_size} workers")
    if size == 1:
        return None, 0
    mine = None
    for g in range(world_size // size):
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            mine = group
    return mine, rank % size


class RowSlice(NamedTuple):
    """This rank's tokens [start, end) of a packed row of `total` tokens, and what its forward takes: `cu`
    goes where `cu_seqlens` goes (the row's `DocBounds`, or at sequence parallelism a `RowShard` of the
    unsplit row's boundaries), `positions` [end - start] the in-document positions of these tokens."""

    start: int
    end: int
    total: int
    cu: Any
    positions: torch.Tensor

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.total


def row_slice(row: PackedRow, ctx: WorkerContext) -> RowSlice:
    """This rank's part of a packed row on the device (`row_to_device`): the whole row at sp_size 1, else the
    sp_rank-th of sp_size equal contiguous slices, documents crossing the split keeping the unsplit row's
    bounds and positions (`hylo.seq_parallel.shard_row`)."""
    bounds, T = row.bounds(), row.num_tokens
    if ctx.sp_size == 1:
        return RowSlice(0, T, T, bounds, bounds.positions)
    from hylo.seq_parallel import shard_row

    s, e = token_range(row, ctx)
    shard = shard_row(bounds, ctx.sp_rank, ctx.sp_size, ctx.sp_group)
    return RowSlice(s, e, T, shard, shard.local.positions)


def token_range(row: PackedRow, ctx: WorkerContext) -> tuple[int, int]:
    """[start, end) of this rank's tokens of `row` (host ints; the whole row at sp_size 1)."""
    T = row.num_tokens
    if ctx.sp_size == 1:
        return 0, T
    from hylo.seq_parallel import shard_range

    if T % ctx.sp_size:
        raise ValueError(f"row {row.key or row.row_id}: its {T} tokens do not split into "
                         f"train.sequence_parallel={ctx.sp_size} equal slices")
    return shard_range(T, ctx.sp_rank, ctx.sp_size)


def row_to_device(row: PackedRow, device: torch.device) -> PackedRow:
    """A checked packed row (as the reader yields it) on `device`, for a step's forward (`PackedRow.to`).

    Its host boundaries come along: `row.bounds()` gives the model the `DocBounds` the reader checked, so
    the forward neither checks them again nor reads them back from the device. A stage's module takes the
    row's tensors and its `DocBounds` (a NamedTuple), which ZeRO-3's hooks on a module's inputs can walk;
    nothing here checks or converts the row's fields again."""
    if row.loss_mask is None:
        raise ValueError(f"row {row.key or row.row_id}: a training row needs a loss_mask")
    return row.to(device)
