"""Stage 2: end-to-end distillation, loss = kl_weight * KL(teacher || student) + ce_weight * CE.

Legend: T tokens of a packed row, N loss tokens of the row (loss_mask), D student hidden, D' teacher
hidden, V vocabulary, k top-k width, G micro-batches (rows) per optimiser step on this rank.

Design choices:
* The student never materialises its logits: its final hidden states [T, D] and `lm_head.weight`
  [V, D] go into `fused_linear_kl_div`, which computes loss and gradients chunk by chunk. The CE term
  (when `ce_weight > 0`) is the same op against a one-hot teacher (`fused_linear_cross_entropy`).
* `kd.temperature` goes to the fused KL unchanged (what it means: `KDSection`, pipeline/train/config.py);
  `kd.kl_precision` to both fused terms (how a bf16 student's gradient products round).
* The loss runs inside `KDStudent.forward` so that ZeRO-3 gathers `lm_head.weight` around it: the weight
  is registered as an external parameter of the wrapper (it is used outside `lm_head.forward`).
* The teacher is one object (`hylo.pipeline.teacher.protocol.BoundTeacher`, from `teacher.source`: inprocess,
  serve or offline, and `teacher.k`: 0 = exact): it yields each row's targets of the fused KL, and the
  step zips rows and targets. The pool's requests for a step's rows are in flight together.
* Sequence parallelism (`train.sequence_parallel` > 1; pipeline/train/README.md): each rank runs the
  student on its slice [s, e) of the row with the unsplit row's boundaries (`worker.row_slice`), the fused KL
  on the slice's hidden states, loss mask and the teacher targets of those tokens (`teacher_targets`), CE
  against the unsplit row's next tokens cut to the slice (`step_inputs`); it counts its slice's loss tokens,
  so the normalisation below is unchanged.
* Loss normalisation: the step's loss is the mean over all loss tokens of the GLOBAL batch (every
  rank's rows): each micro-batch backpropagates `loss_sum * W / n_global` with DeepSpeed's 1/G
  scaling off (`scale_wrt_gas=False`), and DeepSpeed averages the gradients over the W ranks. So a
  row weighs by its loss tokens, whatever G, W and the rows' lengths. The returned sums are this
  rank's; loop.py reduces them and divides by the global number of loss tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hylo.kernels.fused_kl import fused_linear_cross_entropy, fused_linear_kl_div
from hylo.kernels.fused_kl.inputs import check_deferred
from hylo.kernels.varlen import DocBounds
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.teacher.protocol import BoundTeacher
from hylo.pipeline.teacher.sources import open_teacher
from hylo.pipeline.train.config import Stage2Config
from hylo.pipeline.train.deepspeed_cfg import EngineFactory, current_lr, deepspeed_engine
from hylo.pipeline.train.worker import Stage, StepResult, WorkerContext, row_slice, row_to_device, token_range
from hylo.seq_parallel import RowShard


# ------------------------------------------------------------------------------------ student side
class KDStudent(nn.Module):
    """The student plus its loss, so ZeRO-3 gathers the LM head for the fused KL."""

    def __init__(self, student: nn.Module, cfg: Stage2Config, zero3: bool | None = None) -> None:
        """`zero3`: register the LM head for ZeRO-3's gathering (default: `deepspeed.zero_stage` is 3; False for
        an engine that does not partition, `PlainEngine`)."""
        super().__init__()
        self.student = student
        self.kd = cfg.kd
        if zero3 is None:
            zero3 = cfg.deepspeed.zero_stage == 3
        if zero3:
            import deepspeed

            deepspeed.zero.register_external_parameter(self, student.lm_head.weight)

    def forward(self, input_ids_T: torch.Tensor, bounds: DocBounds | Any, loss_mask_T: torch.Tensor,
                teacher: dict[str, Any], positions_T: torch.Tensor | None = None,
                labels_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed row on the device: its tokens, its host-checked boundaries (the forward reads nothing
        back from the device) and its loss mask; the label of token t is token t + 1 (where the mask is set,
        inside its document). At sequence parallelism: this rank's slice of the row, `bounds` the `RowShard`
        of the unsplit row's boundaries, `positions_T` the slice's in-document positions and `labels_T` the
        unsplit row's labels of the slice, with the teacher's targets of these tokens."""
        shard = bounds if isinstance(bounds, RowShard) else None  # to go: the step hands the shard apart
        bounds = shard.local if shard is not None else bounds
        if positions_T is None:
            positions_T = bounds.positions
        h_TD = self.student.model(input_ids=input_ids_T[None], position_ids=positions_T[None],
                                  cu_seqlens=bounds, shard=shard).last_hidden_state[0]
        w_VD = self.student.lm_head.weight
        # the kd settings both fused terms share
        fused = {"mask": loss_mask_T, "reduction": "sum", "chunk_size": self.kd.chunk_size,
                 "precision": self.kd.kl_precision}
        kl = fused_linear_kl_div(h_TD, w_VD, **teacher, temperature=self.kd.temperature, **fused)
        ce = h_TD.new_zeros((), dtype=torch.float32)
        if self.kd.ce_weight:
            labels_T = torch.roll(input_ids_T, -1) if labels_T is None else labels_T
            ce = fused_linear_cross_entropy(h_TD, w_VD, labels_T, **fused)
        return kl, ce


def teacher_targets(teacher: BoundTeacher, rows: list[PackedRow], ctx: WorkerContext) -> Iterator[dict[str, Any]]:
    """The teacher's targets of each row, of this rank's tokens of it at train.sequence_parallel > 1 (every
    source gives a token range: `BoundTeacher.targets(..., token_range=)`); the rows of a step in one request
    when they split alike (rows of one length, as packing pads them), else row by row."""
    if ctx.sp_size == 1:
        return teacher.targets(rows, ctx.device)
    ranges = [token_range(r, ctx) for r in rows]
    if len(set(ranges)) == 1:
        return teacher.targets(rows, ctx.device, token_range=ranges[0])
    return (t for r, rng in zip(rows, ranges) for t in teacher.targets([r], ctx.device, token_range=rng))


def step_inputs(row: PackedRow, teacher: dict[str, Any], ctx: WorkerContext, ce: bool) -> tuple[Any, ...]:
    """KDStudent's inputs for this rank's tokens of `row` (`teacher`: their targets, `teacher_targets`): the
    whole row, or at train.sequence_parallel > 1 this rank's slice [s, e) with the unsplit row's boundaries
    (`row_slice`) and the CE labels of the unsplit row (its next tokens) cut to it."""
    d = row_to_device(row, ctx.device)
    if ctx.sp_size == 1:
        return d.input_ids, d.bounds(), d.loss_mask, teacher
    sl = row_slice(d, ctx)
    s, e = sl.start, sl.end
    labels = torch.roll(d.input_ids, -1)[s:e] if ce else None
    return d.input_ids[s:e], sl.cu, d.loss_mask[s:e], teacher, sl.positions, labels


def loss_tokens(row: PackedRow, ctx: WorkerContext) -> int:
    """The loss tokens of this rank's tokens of `row` (a host count)."""
    if ctx.sp_size == 1:
        return row.loss_tokens
    s, e = token_range(row, ctx)
    return int(row.loss_mask[s:e].sum())


# ------------------------------------------------------------------------------------ build + step
@dataclass
class Stage2Task:
    engine: Any
    student: nn.Module
    teacher: BoundTeacher
    cfg: Stage2Config


def build(ctx: WorkerContext, lr_lambda: Callable[[int], float] | None = None, *,
          student: Callable[[], nn.Module] | None = None, engine: EngineFactory | None = None,
          teacher: Callable[[int], BoundTeacher] | None = None) -> Stage2Task:
    """Stage 2's task, however it is run: the trainer (`STAGE`, every part by default), the estimator (a model of
    the config's shapes on fake tensors, `PlainEngine`, the teacher at its shape), the GPU check and the benches
    (random weights, `PlainEngine` or DeepSpeed). The parts that differ are factories:
    * `student()`: the student on the step's device in its dtype (default: stage 1's checkpoint `model.student`);
    * `engine(module, trainable parameters)`: the engine the step calls (default: DeepSpeed's, `init_engine`
      over ctx.world_size with the schedule `lr_lambda`; only it gets ZeRO-3's registration of the LM head);
    * `teacher(student vocabulary)`: the bound teacher (default: `open_teacher` of the `teacher` section).
    What the step needs of them is made here, once: activation checkpointing as configured, training mode, the
    loss inside `KDStudent`."""
    cfg: Stage2Config = ctx.cfg
    # ZeRO-3's registration of the LM head is DeepSpeed's: the default engine's only
    zero3 = None if engine is None else False
    student = student or (lambda: checkpoint_student(ctx))
    engine = engine or deepspeed_engine(ctx, lr_lambda)
    teacher = teacher or configured_teacher(cfg)
    model = student()
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    module = KDStudent(model, cfg, zero3)
    eng = engine(module, [p for p in module.parameters() if p.requires_grad])
    return Stage2Task(eng, model, teacher(model.config.vocab_size), cfg)


def checkpoint_student(ctx: WorkerContext) -> nn.Module:
    """The trainer's student: stage 1's HyLo checkpoint (`model.student`) on ctx.device in ctx.dtype."""
    from hylo.io import load_hylo

    cfg: Stage2Config = ctx.cfg
    if not cfg.model.student:
        raise ConfigError("model.student is not set: stage 2 starts from stage 1's HyLo checkpoint (<run>/model)")
    return load_hylo(cfg.model.student, dtype=ctx.dtype).to(ctx.device)


def configured_teacher(cfg: Stage2Config) -> Callable[[int], BoundTeacher]:
    """The trainer's teacher factory: `open_teacher` of the `teacher` section (an offline cache checked against
    the prepared data it was made from)."""
    data = cfg.data.path if cfg.data.source == "parquet" else None
    return lambda vocab: open_teacher(cfg.teacher, vocab, data)


def train_step(task: Stage2Task, rows: list[PackedRow], ctx: WorkerContext) -> StepResult:
    """One optimiser step: teacher -> student -> fused KL (+ CE) -> backward, over this rank's rows."""
    kd, engine = task.cfg.kd, task.engine
    # at sequence parallelism each rank counts (and scores) the loss tokens of its own slice: summed over all
    # ranks, every row counts once
    mine = [loss_tokens(r, ctx) for r in rows]
    n_global = ctx.all_sum([float(sum(mine))])[0]
    scale = ctx.world_size / max(n_global, 1.0)
    lr = current_lr(engine)
    out = {"loss_sum": 0.0, "kl_sum": 0.0, "ce_sum": 0.0, "loss_tokens": 0.0, "tokens": 0.0}
    # the loss terms stay on the device until the step's end: one host read per step, not three per row
    sums = []
    # the reader's rows are checked PackedRows already (pipeline/data/reader.py): no check here
    targets = teacher_targets(task.teacher, rows, ctx)
    for i, (row, teacher) in enumerate(zip(rows, targets)):
        inputs = step_inputs(row, teacher, ctx, bool(kd.ce_weight))
        kl, ce = engine(*inputs)
        loss = kd.kl_weight * kl + kd.ce_weight * ce
        engine.backward(loss * scale, scale_wrt_gas=False)
        if i == 0:
            ctx.hook("mid_step")
        engine.step()
        sums.append(torch.stack([loss.detach(), kl.detach(), ce.detach()]).double())
        out["loss_tokens"] += float(mine[i])
        out["tokens"] += float(inputs[0].shape[0])
    # the fused KL's input checks left device flags (kernels/fused_kl/inputs.py): read them with the sums
    check_deferred()
    out["loss_sum"], out["kl_sum"], out["ce_sum"] = torch.stack(sums).sum(0).tolist()
    return StepResult(out, lr, float(engine.get_global_grad_norm() or 0.0))


STAGE = Stage(2, build, train_step)
