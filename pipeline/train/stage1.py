"""Stage 1, Enhanced-ILD: every student layer learns to reproduce its base-model layer, in isolation.

Legend: T tokens of a packed row, D hidden size, L layers, G micro-batches (rows) per optimiser step.

For each row the frozen base model runs once and gives, per layer l, its input x_l, its output y_l and
its attention (mixer) output a_l. Student layer l is fed the base's x_l (not its own previous layer's
output), so layers train independently and errors never compound:

    loss = sum_l  output_weight * mean_t d(layer_l(x_l)_t, y_l,t) + mixer_weight * mean_t d(mixer_l_t, a_l,t)

with d the per-token L2 distance `||u - v||_2` (`ild.squared: false`, the default) or its square
(`ild.squared: true`). Design choices:
* Unsquared by default: the residual stream's scale grows with depth, and a squared loss would let the
  last layers' errors dominate the sum; the Euclidean norm's gradient has unit size per token, so every
  layer gets comparable signal. `sqrt(. + eps)` keeps the gradient finite at zero distance.
* Tokens: every token of every real document (the trailing padding segment, doc id "", is excluded);
  not only the loss-mask tokens, since user turns shape the layer inputs as much as replies do.
* Trained (`ild.trainable`): `all` (the default, Enhanced-ILD as published) = every parameter of every
  decoder layer: mixer, MLP, input and post-attention RMSNorms; `mixers+mlp`; `mixers` = the new
  mixers (MLA / GDN) only. Embeddings, final norm and LM head never reach the loss (layers are fed the
  base's layer inputs and compared at their own outputs): they stay the base model's in stage 1.
* The base model runs outside DeepSpeed (frozen, inference only); the loss runs inside
  `ILDStudent.forward` with per-layer activation checkpointing.
* Sequence parallelism (`train.sequence_parallel` > 1): the base runs on the whole row on every rank (a plain
  transformers model), `BaseLayerTargets` keeps the rank's tokens [s, e) of each captured tensor (T/N per
  layer), and the student's layers run on that slice with the unsplit row's boundaries (`step_inputs`).
* The means are over the real tokens of the GLOBAL batch (every rank's rows), weighted as in stage 2:
  each micro-batch backpropagates its sum times `W / n_global`, DeepSpeed's 1/G scaling off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hylo.kernels.varlen import DocBounds
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.train.config import ILD_TRAINABLE, Stage1Config
from hylo.pipeline.train.deepspeed_cfg import EngineFactory, current_lr, deepspeed_engine
from hylo.pipeline.train.worker import Stage, StepResult, WorkerContext, row_slice, row_to_device, token_range
from hylo.seq_parallel import RowShard

EPS = 1e-6


# ------------------------------------------------------------------------------------ base model side
class BaseLayerTargets:
    """Runs the frozen HF base model and captures each decoder layer's input, output and attention output."""

    def __init__(self, base: nn.Module) -> None:
        self.base = base
        self.layers = base.model.layers
        # the tokens [start, end) of the row kept of each captured tensor (None: all; sequence parallelism)
        self.token_range: tuple[int, int] | None = None
        self._inputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._outputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._mixers: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._grab_input(i), with_kwargs=True)
            layer.register_forward_hook(self._grab(self._outputs, i))
            layer.self_attn.register_forward_hook(self._grab(self._mixers, i))

    def _keep(self, x_1TD: torch.Tensor) -> torch.Tensor:
        if self.token_range is None:
            return x_1TD
        # a copy, so that the whole row's tensor is freed: T / N tokens per layer kept
        s, e = self.token_range
        return x_1TD[:, s:e].clone()

    def _grab_input(self, i: int):
        def hook(mod, args, kwargs):
            self._inputs[i] = self._keep(args[0] if args else kwargs["hidden_states"])
        return hook

    def _grab(self, store: list, i: int):
        def hook(mod, args, out):
            store[i] = self._keep(out[0] if isinstance(out, tuple) else out)
        return hook

    @torch.no_grad()
    def __call__(self, row: PackedRow, token_range: tuple[int, int] | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, outputs, attention outputs) [1, T, D] of every layer on one packed row (on the base's
        device); with `token_range` (s, e) only those tokens of each, [1, e - s, D]. The base (a plain
        transformers model) always runs on the whole row."""
        # No attention mask and no cache: transformers builds the block-diagonal (per-document) mask
        # from the restarting position ids.
        self.token_range = token_range
        try:
            self.base.model(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False)
        finally:
            self.token_range = None
        return list(self._inputs), list(self._outputs), list(self._mixers)


# ------------------------------------------------------------------------------------ student side
def token_distance(x_BTD: torch.Tensor, y_BTD: torch.Tensor, squared: bool) -> torch.Tensor:
    """Per-token L2 distance [T] in fp32 (fp64 for fp64 inputs: the exactness tests)."""
    dt = torch.promote_types(x_BTD.dtype, torch.float32)
    d2_T = (x_BTD.to(dt) - y_BTD.to(dt)).pow(2).sum(-1)[0]
    return d2_T if squared else torch.sqrt(d2_T + EPS)


class ILDStudent(nn.Module):
    """Student layers fed the base model's layer inputs; returns the summed per-token distances."""

    def __init__(self, student: nn.Module, cfg: Stage1Config) -> None:
        super().__init__()
        self.student = student
        self.ild = cfg.ild
        self.checkpointing = cfg.model.activation_checkpointing

    def forward(self, position_ids_1T: torch.Tensor, bounds: DocBounds, x_in: list[torch.Tensor],
                y_out: list[torch.Tensor], y_mix: list[torch.Tensor],
                tokens_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_sum = mix_sum = torch.zeros((), device=tokens_T.device)
        shard = bounds if isinstance(bounds, RowShard) else None  # to go: the step hands the shard apart
        bounds = shard.local if shard is not None else bounds
        # the row's boundaries as the reader checked them on the host (`row_to_device`'s `bounds`): no layer
        # checks them again or reads them back from the device
        for i, layer in enumerate(self.student.model.layers):
            x = x_in[i].to(layer.input_layernorm.weight.dtype)
            if self.checkpointing and self.training:
                out, mix = checkpoint(layer, x, position_ids_1T, bounds, None, None, shard, use_reentrant=False)
            else:
                out, mix = layer(x, position_ids_1T, bounds, None, None, shard)
            out_sum = out_sum + (token_distance(out, y_out[i], self.ild.squared) * tokens_T).sum()
            mix_sum = mix_sum + (token_distance(mix, y_mix[i], self.ild.squared) * tokens_T).sum()
        return out_sum, mix_sum


def trainable_parameters(student: nn.Module, trainable: str) -> list[nn.Parameter]:
    """Switch on the gradients of what `ild.trainable` names (see ILDSection) and return those parameters."""
    if trainable not in ILD_TRAINABLE:
        raise ConfigError(f"ild.trainable: {trainable!r} is not one of {', '.join(ILD_TRAINABLE)}", "ild.trainable")
    student.requires_grad_(False)
    for layer in student.model.layers:
        if trainable == "all":
            layer.requires_grad_(True)
            continue
        layer.mixer.requires_grad_(True)
        if trainable == "mixers+mlp":
            layer.mlp.requires_grad_(True)
    return [p for p in student.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------ build + step
@dataclass
class Stage1Task:
    engine: Any
    student: nn.Module
    base: BaseLayerTargets
    cfg: Stage1Config


def build(ctx: WorkerContext, lr_lambda: Callable[[int], float] | None = None, *,
          student: Callable[[], nn.Module] | None = None, base: Callable[[], nn.Module] | None = None,
          engine: EngineFactory | None = None) -> Stage1Task:
    """Stage 1's task, however it is run: the trainer (`STAGE`, every part by default), the estimator (models of
    the config's shapes on fake tensors, `PlainEngine`), the benches. The parts that differ are factories:
    * `student()`, `base()`: the student and the HF base model on the step's device in its dtype (default: the
      checkpoints `model.student` and `model.base`);
    * `engine(module, trainable parameters)`: the engine the step calls (default: DeepSpeed's, `init_engine` over
      ctx.world_size with the schedule `lr_lambda`).
    What the step needs of them is made here, once: the base frozen, the layers `ild.trainable` names trained, the
    student in training mode inside `ILDStudent`."""
    cfg: Stage1Config = ctx.cfg
    if student is None or base is None:
        check_checkpoints(cfg)
    student = student or (lambda: checkpoint_student(ctx))
    base = base or (lambda: base_model(ctx))
    engine = engine or deepspeed_engine(ctx, lr_lambda)
    model = student()
    frozen = base().eval()
    frozen.requires_grad_(False)
    if len(frozen.model.layers) != len(model.model.layers):
        raise ConfigError(f"model.base has {len(frozen.model.layers)} layers, model.student "
                          f"{len(model.model.layers)}: the student must be converted from this base")
    params = trainable_parameters(model, cfg.ild.trainable)
    model.train()
    module = ILDStudent(model, cfg)
    return Stage1Task(engine(module, params), model, BaseLayerTargets(frozen), cfg)


def check_checkpoints(cfg: Stage1Config) -> None:
    if not cfg.model.student or not cfg.model.base:
        raise ConfigError("stage 1 needs model.base (the HF base model) and model.student (its HyLo conversion)")


def checkpoint_student(ctx: WorkerContext) -> nn.Module:
    """The trainer's student: the HyLo conversion `model.student` on ctx.device in ctx.dtype."""
    from hylo.io import load_hylo

    return load_hylo(ctx.cfg.model.student, dtype=ctx.dtype).to(ctx.device)


def base_model(ctx: WorkerContext) -> nn.Module:
    """The trainer's base: the HF model `model.base` (a directory or an asset) on ctx.device in ctx.dtype."""
    from hylo.assets import resolve_path_or_asset
    from hylo.upcycle import load_base_model

    base_dir = resolve_path_or_asset(ctx.cfg.model.base, "model.base", directory=True)
    return load_base_model(base_dir, dtype=ctx.dtype).to(ctx.device)


def step_inputs(base: BaseLayerTargets, row: PackedRow, ctx: WorkerContext) -> tuple[Any, ...]:
    """ILDStudent's inputs for this rank's tokens of `row`: the base's layer targets, positions, boundaries and
    real-token mask of the whole row, or at train.sequence_parallel > 1 of this rank's slice [s, e) (the base
    runs on the whole row; the unsplit row's boundaries and positions, `row_slice`)."""
    d = row_to_device(row, ctx.device)
    sl = row_slice(d, ctx)
    x_in, y_out, y_mix = base(d, None if sl.whole else (sl.start, sl.end))
    tokens_T = _mine(row.real_tokens(), row, ctx).to(ctx.device)
    return sl.positions[None], sl.cu, x_in, y_out, y_mix, tokens_T


def train_step(task: Stage1Task, rows: list[PackedRow], ctx: WorkerContext) -> StepResult:
    """One optimiser step: base layer targets -> student layers on base inputs -> L2 losses -> backward."""
    ild, engine = task.cfg.ild, task.engine
    # each rank's real tokens of its own slice of each row (the whole row at sp_size 1): over all ranks, every
    # row counts once
    mine = [r.real_token_count() if ctx.sp_size == 1 else int(_mine(r.real_tokens(), r, ctx).sum()) for r in rows]
    n_global = ctx.all_sum([float(sum(mine))])[0]
    scale = ctx.world_size / max(n_global, 1.0)
    lr = current_lr(engine)
    out = {"loss_sum": 0.0, "ild_output_sum": 0.0, "ild_mixer_sum": 0.0, "loss_tokens": 0.0, "tokens": 0.0}
    # the loss terms stay on the device until the step's end: one host read per step, not three per row
    sums = []
    for i, row in enumerate(rows):
        inputs = step_inputs(task.base, row, ctx)
        d_out, d_mix = engine(*inputs)
        loss = ild.output_weight * d_out + ild.mixer_weight * d_mix
        engine.backward(loss * scale, scale_wrt_gas=False)
        if i == 0:
            ctx.hook("mid_step")
        engine.step()
        sums.append(torch.stack([loss.detach(), d_out.detach(), d_mix.detach()]).double())
        out["loss_tokens"] += float(mine[i])
        out["tokens"] += float(inputs[-1].shape[0])
    out["loss_sum"], out["ild_output_sum"], out["ild_mixer_sum"] = torch.stack(sums).sum(0).tolist()
    return StepResult(out, lr, float(engine.get_global_grad_norm() or 0.0))


def _mine(x_T: torch.Tensor, row: PackedRow, ctx: WorkerContext) -> torch.Tensor:
    """This rank's tokens of a per-token host tensor of `row`."""
    if ctx.sp_size == 1:
        return x_T
    s, e = token_range(row, ctx)
    return x_T[s:e]


STAGE = Stage(1, build, train_step)
