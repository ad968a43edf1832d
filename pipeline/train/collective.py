"""The collective backend a training worker uses (NCCL/RCCL or gloo), chosen in one place.

It imports torch only. Ray Train's controller calls it through driver.auto_torch_config, and the controller
must not import the training stack.
"""

from __future__ import annotations

import os

import torch


def collective_backend(use_gpu: bool) -> tuple[str, str | None]:
    """The one place the GPU branch is chosen: NCCL (RCCL on ROCm) and a CUDA device when the config asks for
    GPUs (`ray.use_gpu`) and torch sees one, else gloo on CPU; with, when GPUs were asked for but torch sees
    none (a CPU-only torch, a driver that does not load, GPUs that Ray only declares), the line that says so.
    Ray Train's backend (driver.AutoTorchConfig) and `loop.setup_distributed` both follow it."""
    if not use_gpu or torch.cuda.is_available():
        return ("nccl" if use_gpu else "gloo"), None
    visible = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES") if k in os.environ}
    given = ", ".join(f"{k}={v}" for k, v in visible.items()) or "no *_VISIBLE_DEVICES"
    return "gloo", (f"ray.use_gpu is true and the worker was given GPUs ({given}), but torch {torch.__version__} "
                    "sees no CUDA/ROCm device: training on CPU with gloo instead of NCCL")
