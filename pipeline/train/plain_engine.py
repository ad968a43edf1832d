"""What a stage's `train_step` asks of DeepSpeed's engine, in plain torch, for ONE process.

For measuring and checking the step where DeepSpeed is not installed (a lent GPU machine; see
`bench/gpu_check.py`): the same `train_step` function runs with this in place of the engine that
`deepspeed_cfg.init_engine` builds. What it mirrors of DeepSpeed's bf16 mode at world size 1, ZeRO 0:
* parameters (and their gradients) in the model's dtype; bf16 parameters get fp32 master copies, and
  AdamW and clipping run on those (DeepSpeed's `bf16` optimizer), then the masters are copied back;
* `step()` is called after every micro-batch and steps the optimiser at the accumulation boundary
  (every `grad_accum` calls), like the engine; `backward(loss, scale_wrt_gas=False)` is plain backward;
* `get_global_grad_norm()` returns the norm the last step clipped with (one host read, as DeepSpeed).
Not mirrored: ZeRO partitioning, communication, loss scaling, DeepSpeed's LR scheduler hook (the
learning rate is the optimiser's, `current_lr` reads it the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class PlainEngine:
    def __init__(self, module: nn.Module, *, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, grad_clip: float = 1.0, grad_accum: int = 1) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("PlainEngine: the module has no trainable parameters")
        # fp32 master weights for low-precision parameters; fp32 parameters are their own masters
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
                        for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.grad_clip = grad_clip
        self.grad_accum = grad_accum
        self._micro = 0
        self._norm: torch.Tensor | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        if scale_wrt_gas:
            loss = loss / self.grad_accum
        loss.backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.grad_accum:
            return
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        # the norm stays on the device (no read): gradients are scaled by min(1, clip / norm), as DeepSpeed
        grads = [m.grad for m in self.masters if m.grad is not None]
        self._norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if self.grad_clip:
            torch._foreach_mul_(grads, (self.grad_clip / (self._norm + 1e-6)).clamp(max=1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def get_global_grad_norm(self) -> float | None:
        return None if self._norm is None else float(self._norm)


def plain_engine(optim: Any, cls: type[PlainEngine] = PlainEngine, foreach: bool = False
                 ) -> Callable[[nn.Module, list[nn.Parameter]], PlainEngine]:
    """An engine factory for stage1.build / stage2.build: `cls` (PlainEngine or a subclass) with the `optim`
    section's AdamW and clipping. `foreach`: AdamW's multi-tensor form, torch's default for GPU tensors (on CPU
    ones it loops per tensor), whose temporaries span every tensor at once (the estimator's GPU rule)."""

    def make(module: nn.Module, params: list[nn.Parameter]) -> PlainEngine:
        # the engine trains what requires a gradient: the parameters the stage's build switched on
        engine = cls(module, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay,
                     grad_clip=optim.grad_clip)
        if foreach:
            engine.optimizer = torch.optim.AdamW(engine.masters, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                                 weight_decay=optim.weight_decay, foreach=True)
        return engine

    return make
