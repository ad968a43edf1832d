"""Stage 2: end-to-end distillation, loss = kl_weight * KL(teacher || student) + ce_weight * CE.

Legend: T tokens of a packed row, N loss tokens of the row (loss_mask), D student hidden, D' teacher
hidden, V vocabulary, k top-k width, G micro-batches (rows) per optimiser step on this rank.

Design choices:
* The student never materialises its logits: its final hidden states [T, D] and `lm_head.weight`
  [V, D] go into `fused_linear_kl_div`, which computes loss and gradients chunk by chunk. The CE term
  (when `ce_weight > 0`) is chunked too, each chunk recomputed in backward (`torch.utils.checkpoint`).
* The loss runs inside `KDStudent.forward` so that ZeRO-3 gathers `lm_head.weight` around it: the weight
  is registered as an external parameter of the wrapper (it is used outside `lm_head.forward`).
* Teacher forms (`teacher.source`): `inprocess` (exact: teacher hidden states + teacher lm_head, or its
  top-k), `serve` (the Ray Serve pool: top-k records, or streamed full-logit chunks), `offline` (the
  top-k cache). All of a step's rows are requested from the pool at once, so they are in flight together.
* Loss normalisation: the step's loss is the mean over all loss tokens of the GLOBAL batch (every
  rank's rows): each micro-batch backpropagates `loss_sum * W / n_global` with DeepSpeed's 1/G
  scaling off (`scale_wrt_gas=False`), and DeepSpeed averages the gradients over the W ranks. So a
  row weighs by its loss tokens, whatever G, W and the rows' lengths. The returned sums are this
  rank's; loop.py reduces them and divides by the global number of loss tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hylo.kernels.fused_kl import TeacherTopK, fused_linear_kl_div
from hylo.kernels.fused_kl.inputs import check_deferred
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.train.config import Stage2Config, TeacherSection
from hylo.pipeline.train.deepspeed_cfg import current_lr, init_engine
from hylo.pipeline.train.worker import Stage, StepResult, WorkerContext, row_to_device
from torch import nn
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------------------------------------------ student side
def chunked_ce_sum(h_NH: torch.Tensor, w_VH: torch.Tensor, labels_N: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of token cross-entropies without a live [N, V] tensor (each chunk recomputed in backward)."""

    def ce(h, y):
        return F.cross_entropy((h.float() @ w_VH.float().t()), y, reduction="sum")

    total = h_NH.new_zeros((), dtype=torch.float32)
    for s in range(0, h_NH.shape[0], chunk):
        total = total + checkpoint(ce, h_NH[s:s + chunk], labels_N[s:s + chunk], use_reentrant=False)
    return total


class KDStudent(nn.Module):
    """The student plus its loss, so ZeRO-3 gathers the LM head for the fused KL."""

    def __init__(self, student: nn.Module, cfg: Stage2Config) -> None:
        super().__init__()
        self.student = student
        self.kd = cfg.kd
        if cfg.deepspeed.zero_stage == 3:
            import deepspeed

            deepspeed.zero.register_external_parameter(self, student.lm_head.weight)

    def forward(self, b: dict[str, torch.Tensor], teacher: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        # the host-checked boundaries (row_to_device): the forward reads nothing back from the device
        h_TD = self.student.model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                                  cu_seqlens=b.get("bounds", b["cu_seqlens"])).last_hidden_state[0]
        w_VD = self.student.lm_head.weight
        kl = fused_linear_kl_div(h_TD, w_VD, **teacher, mask=b["loss_mask"], temperature=self.kd.temperature,
                                 reduction="sum", chunk_size=self.kd.chunk_size)
        ce = h_TD.new_zeros((), dtype=torch.float32)
        if self.kd.ce_weight:
            m = b["loss_mask"]
            ce = chunked_ce_sum(h_TD[m], w_VD, b["labels"][m], self.kd.chunk_size or 1024)
        return kl, ce


# ------------------------------------------------------------------------------------ teacher side
class StreamedLogits:
    """`teacher_logits_fn(i, j)` over a generator of [C, V] chunks (calls come in increasing order)."""

    def __init__(self, chunks: Iterator[torch.Tensor], device: torch.device) -> None:
        self.chunks, self.device = chunks, device
        self.buf, self.start = None, 0

    def __call__(self, i: int, j: int) -> torch.Tensor:
        while self.buf is None or self.start + self.buf.shape[0] < j:
            nxt = next(self.chunks).to(self.device)
            if self.buf is None:
                self.buf = nxt
            else:
                keep = self.buf[max(0, i - self.start):]
                self.start += self.buf.shape[0] - keep.shape[0]
                self.buf = torch.cat([keep, nxt])
        return self.buf[i - self.start: j - self.start]


class Teacher:
    """Gives, for each packed row, the teacher keyword arguments of `fused_linear_kl_div`.

    Exactly one of `model` (in-process `TeacherModel`), `client` (`TeacherClient` of the Serve pool) or
    `cache` (`TopKCacheReader`) is set; `build` makes the one `teacher.source` asks for.
    """

    def __init__(self, cfg: TeacherSection, device: torch.device, student_vocab: int, *, model: Any = None,
                 client: Any = None, cache: Any = None) -> None:
        if sum(x is not None for x in (model, client, cache)) != 1:
            raise ValueError("Teacher needs exactly one of model, client, cache")
        self.cfg, self.device, self.model, self.client, self.cache = cfg, device, model, client, cache
        vocab = (model.vocab_size if model is not None else
                 int(cache.manifest["vocab_size"]) if cache is not None else None)
        if vocab is not None and vocab != student_vocab:
            raise ConfigError(f"teacher vocabulary {vocab} != student vocabulary {student_vocab}: "
                              f"teacher and student must share a tokenizer")

    @classmethod
    def build(cls, cfg: Stage2Config, ctx: WorkerContext, student_vocab: int) -> Teacher:
        t = cfg.teacher
        if t.source == "inprocess":
            from hylo.pipeline.teacher.model import TeacherModel

            return cls(t, ctx.device, student_vocab, model=TeacherModel.from_config(t.model))
        if t.source == "serve":
            from hylo.pipeline.teacher.client import TeacherClient

            return cls(t, ctx.device, student_vocab, client=TeacherClient.from_config(t.pool.app_name, t.client))
        from hylo.pipeline.teacher.cache import TopKCacheReader

        expect = cfg.data.path if cfg.data.source == "parquet" else None
        return cls(t, ctx.device, student_vocab, cache=TopKCacheReader(t.cache_path, expect_data=expect))

    def _topk(self, rec: TeacherTopK) -> dict[str, Any]:
        return {"teacher_topk": TeacherTopK(*(x.to(self.device) if x is not None else None for x in rec))}

    def for_rows(self, rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        t = self.cfg
        if self.model is not None:
            for row in rows:
                if t.top_k:
                    yield self._topk(self.model.topk(row, t.top_k))
                else:
                    h = self.model.hidden(row).to(self.device)
                    yield {"teacher_hidden": h, "teacher_weight": self.model.lm_head_weight.to(self.device)}
        elif self.client is not None and t.mode == "topk":
            for rec in self.client.topk(rows):
                yield self._topk(rec)
        elif self.client is not None:
            for row in rows:
                yield {"teacher_logits_fn": StreamedLogits(self.client.stream(row), self.device)}
        else:
            for row in rows:
                yield self._topk(self.cache.get_for_row(row))


# ------------------------------------------------------------------------------------ build + step
@dataclass
class Stage2Task:
    engine: Any
    student: nn.Module
    teacher: Teacher
    cfg: Stage2Config


def build(ctx: WorkerContext, lr_lambda) -> Stage2Task:
    from hylo.io import load_hylo

    cfg: Stage2Config = ctx.cfg
    if not cfg.model.student:
        raise ConfigError("model.student is not set: stage 2 starts from stage 1's HyLo checkpoint (<run>/model)")
    student = load_hylo(cfg.model.student, dtype=ctx.dtype).to(ctx.device)
    if cfg.model.activation_checkpointing:
        student.gradient_checkpointing_enable()
    student.train()
    module = KDStudent(student, cfg)
    engine = init_engine(module, [p for p in module.parameters() if p.requires_grad], cfg, ctx.world_size,
                         ctx.dtype, lr_lambda)
    return Stage2Task(engine, student, Teacher.build(cfg, ctx, student.config.vocab_size), cfg)


def train_step(task: Stage2Task, rows: list[PackedRow], ctx: WorkerContext) -> StepResult:
    """One optimiser step: teacher -> student -> fused KL (+ CE) -> backward, over this rank's rows."""
    kd, engine = task.cfg.kd, task.engine
    n_global = ctx.all_sum([float(sum(r.loss_tokens for r in rows))])[0]
    scale = ctx.world_size / max(n_global, 1.0)
    lr = current_lr(engine)
    out = {"loss_sum": 0.0, "kl_sum": 0.0, "ce_sum": 0.0, "loss_tokens": 0.0, "tokens": 0.0}
    # the loss terms stay on the device until the step's end: one host read per step, not three per row
    sums = []
    for i, (row, teacher) in enumerate(zip(rows, task.teacher.for_rows(rows))):
        b = row_to_device(row, ctx.device)
        kl, ce = engine(b, teacher)
        loss = kd.kl_weight * kl + kd.ce_weight * ce
        engine.backward(loss * scale, scale_wrt_gas=False)
        if i == 0:
            ctx.hook("mid_step")
        engine.step()
        sums.append(torch.stack([loss.detach(), kl.detach(), ce.detach()]).double())
        out["loss_tokens"] += float(row.loss_tokens)
        out["tokens"] += float(row.num_tokens)
    # the fused KL's input checks left device flags (kernels/fused_kl/inputs.py): read them with the sums
    check_deferred()
    out["loss_sum"], out["kl_sum"], out["ce_sum"] = torch.stack(sums).sum(0).tolist()
    return StepResult(out, lr, float(engine.get_global_grad_norm() or 0.0))


STAGE = Stage(2, build, train_step)
