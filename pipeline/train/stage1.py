"""Stage 1, Enhanced-ILD: every student layer learns to reproduce its base-model layer, in isolation.

Legend: T tokens of a packed row, D hidden size, L layers.

For each row the frozen base model runs once and gives, per layer l, its input x_l, its output y_l and
its attention (mixer) output a_l. Student layer l is fed the base's x_l, not its own previous layer's
output, so layers train independently and errors never compound:

    loss = sum_l  output_weight * mean_t d(layer_l(x_l)_t, y_l,t) + mixer_weight * mean_t d(mixer_l_t, a_l,t)

with d the per-token L2 distance `||u - v||_2` (`ild.squared: false`, the default) or its square
(`ild.squared: true`). Design choices:
* Unsquared by default: the residual stream grows with depth, and a squared loss would let the last
  layers dominate. The Euclidean norm's gradient has unit size per token. `sqrt(. + eps)` keeps it finite.
* Tokens: every token of every real document, not only the loss-mask ones (the trailing padding is out).
* Trained (`ild.trainable`): `all` (the default, as published) = every parameter of every decoder layer;
  `mixers+mlp`; `mixers` = the new mixers only. Embeddings, final norm and LM head never reach the loss.
* The base model runs outside DeepSpeed (frozen, inference only); the loss runs inside
  `ILDStudent.forward` with per-layer activation checkpointing.
* Sequence parallelism: the base runs on this rank's tokens only, its attention seeing the row through the
  group (`seq_parallel.split_attention`; `train.sequence_parallel_teacher: whole`: on the whole row, this rank's
  tokens of each captured tensor kept); the student's layers run on those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hylo.assets import resolve_path_or_asset
from hylo.io import load_hylo
from hylo.kernels.varlen import DocBounds
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.train.config import ILD_TRAINABLE, Stage1Config
from hylo.pipeline.train.deepspeed_cfg import EngineFactory, deepspeed_engine
from hylo.pipeline.train.loop import train_step
from hylo.pipeline.train.worker import RowPart, Stage, WorkerContext
from hylo.seq_parallel import RowShard, split_attention
from hylo.upcycle import load_base_model

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
    def __call__(self, row: PackedRow, shard: RowShard | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, outputs, attention outputs) [1, T, D] of every layer on one packed row (on the base's
        device); with a split row's `shard`, of its tokens [start, end) only, [1, end - start, D]: the base
        runs on those tokens with its group (`seq_parallel.split_attention`), or with `shard.teacher` "whole"
        on the whole row, the shard's tokens kept."""
        if shard is not None and shard.teacher != "whole":
            with split_attention(self.base, shard):
                self.base.model(input_ids=row.input_ids[None, shard.start:shard.end],
                                position_ids=shard.local.positions[None], use_cache=False)
            return list(self._inputs), list(self._outputs), list(self._mixers)
        # No attention mask and no cache: transformers builds the block-diagonal (per-document) mask
        # from the restarting position ids.
        self.token_range = None if shard is None else (shard.start, shard.end)
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
                y_out: list[torch.Tensor], y_mix: list[torch.Tensor], tokens_T: torch.Tensor,
                shard: RowShard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed per-token distances of every layer over the given tokens: the boundaries as the reader
        checked them on the host (no layer reads them back from the device); `shard`: a split row's."""
        out_sum = mix_sum = torch.zeros((), device=tokens_T.device)
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

    def terms(self) -> dict[str, float]:
        return {"ild_output": self.cfg.ild.output_weight, "ild_mixer": self.cfg.ild.mixer_weight}

    def counted(self, part: RowPart) -> int:
        return part.real_tokens

    def inputs(self, parts: list[RowPart], ctx: WorkerContext) -> Iterator[tuple[Any, ...]]:
        for part in parts:
            yield module_inputs(self.base, part, ctx.device)


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
    return load_hylo(ctx.cfg.model.student, dtype=ctx.dtype).to(ctx.device)


def base_model(ctx: WorkerContext) -> nn.Module:
    """The trainer's base: the HF model `model.base` (a directory or an asset) on ctx.device in ctx.dtype."""
    base_dir = resolve_path_or_asset(ctx.cfg.model.base, "model.base", directory=True)
    return load_base_model(base_dir, dtype=ctx.dtype).to(ctx.device)


def module_inputs(base: BaseLayerTargets, part: RowPart, device: torch.device) -> tuple[Any, ...]:
    """ILDStudent's inputs for this rank's part of a row: positions, boundaries, the base's layer targets of
    these tokens (the base split with the row's group), the real-token mask, the shard."""
    x_in, y_out, y_mix = base(part.device_row, part.shard)
    tokens_T = part.of(part.row.real_tokens()).to(device)
    return part.positions[None], part.bounds, x_in, y_out, y_mix, tokens_T, part.shard


STAGE = Stage(1, build, train_step)
