"""Stage 2: end-to-end distillation, loss = kl_weight * KL(teacher || student) + ce_weight * CE.

Legend: T tokens of a packed row, D student hidden, V vocabulary.

Design choices:
* The student never materialises its logits: its final hidden states [T, D] and `lm_head.weight` [V, D]
  go into `fused_linear_kl_div`, which computes loss and gradients chunk by chunk. The CE term (when
  `ce_weight > 0`) is the same op against a one-hot teacher (`fused_linear_cross_entropy`).
* `kd.temperature` goes to the fused KL unchanged (`KDSection` says what it means); `kd.kl_precision` to
  both fused terms.
* The loss runs inside `KDStudent.forward`, so ZeRO-3 gathers `lm_head.weight` around it: the weight is an
  external parameter of the wrapper.
* The teacher is one object (`BoundTeacher`, from `teacher.source` and `teacher.k`). It gives the targets
  of a step's rows in one request, and the step zips rows and targets.
* Sequence parallelism: a rank's part of a row has the teacher's targets of its tokens and the CE labels
  of the unsplit row (its next tokens), cut to the part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hylo.io import load_hylo
from hylo.kernels.fused_kl import fused_linear_cross_entropy, fused_linear_kl_div
from hylo.kernels.varlen import DocBounds
from hylo.pipeline.config import ConfigError
from hylo.pipeline.teacher.protocol import BoundTeacher
from hylo.pipeline.teacher.sources import open_teacher
from hylo.pipeline.train.config import Stage2Config
from hylo.pipeline.train.deepspeed_cfg import EngineFactory, deepspeed_engine
from hylo.pipeline.train.loop import train_step
from hylo.pipeline.train.worker import RowPart, Stage, WorkerContext
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
            import deepspeed  # lazy: deepspeed

            deepspeed.zero.register_external_parameter(self, student.lm_head.weight)

    def forward(self, input_ids_T: torch.Tensor, bounds: DocBounds, loss_mask_T: torch.Tensor,
                teacher: dict[str, Any], positions_T: torch.Tensor | None = None,
                labels_T: torch.Tensor | None = None,
                shard: RowShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL, CE) sums of a packed row's tokens on the device: their host-checked boundaries (the forward
        reads nothing back from the device), loss mask and teacher targets. The label of token t is token
        t + 1 (`labels_T`, default the next given token). `shard`: a split row's (`bounds` its tokens')."""
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


def teacher_targets(teacher: BoundTeacher, parts: list[RowPart], device: torch.device) -> Iterator[dict[str, Any]]:
    """The teacher's targets of each part's tokens (every source takes the parts' shards: their token range, or a
    teacher split with the group); the rows of a step in one request when their parts agree (rows of one length,
    as packing pads them), else row by row."""
    ranges = {p.token_range for p in parts}
    if len(ranges) == 1:
        return teacher.targets([p.row for p in parts], device, shards=_shards(parts))
    return (t for p in parts for t in teacher.targets([p.row], device, shards=_shards([p])))


def _shards(parts: list[RowPart]) -> list[RowShard] | None:
    """The parts' shards (the teacher splits with the group), None for whole rows."""
    return None if parts[0].shard is None else [p.shard for p in parts]


def module_inputs(part: RowPart, teacher: dict[str, Any], ce: bool) -> tuple[Any, ...]:
    """KDStudent's inputs for this rank's part of a row (`teacher`: the targets of its tokens); with `ce`, the
    CE labels: the unsplit row's next tokens, cut to the part."""
    d = part.device_row
    labels = part.of(torch.roll(d.input_ids, -1)) if ce else None
    return part.of(d.input_ids), part.bounds, part.of(d.loss_mask), teacher, part.positions, labels, part.shard


# ------------------------------------------------------------------------------------ build + step
@dataclass
class Stage2Task:
    engine: Any
    student: nn.Module
    teacher: BoundTeacher
    cfg: Stage2Config

    def terms(self) -> dict[str, float]:
        return {"kl": self.cfg.kd.kl_weight, "ce": self.cfg.kd.ce_weight}

    def counted(self, part: RowPart) -> int:
        return part.loss_tokens

    def inputs(self, parts: list[RowPart], ctx: WorkerContext) -> Iterator[tuple[Any, ...]]:
        ce = bool(self.cfg.kd.ce_weight)
        for part, teacher in zip(parts, teacher_targets(self.teacher, parts, ctx.device)):
            yield module_inputs(part, teacher, ce)


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
    cfg: Stage2Config = ctx.cfg
    if not cfg.model.student:
        raise ConfigError("model.student is not set: stage 2 starts from stage 1's HyLo checkpoint (<run>/model)")
    return load_hylo(cfg.model.student, dtype=ctx.dtype).to(ctx.device)


def configured_teacher(cfg: Stage2Config) -> Callable[[int], BoundTeacher]:
    """The trainer's teacher factory: `open_teacher` of the `teacher` section (an offline cache checked against
    the prepared data it was made from)."""
    data = cfg.data.path if cfg.data.source == "parquet" else None
    return lambda vocab: open_teacher(cfg.teacher, vocab, data)


STAGE = Stage(2, build, train_step)
