"""The MLA widths served on this machine: the platform decides which widths vLLM's MLA backends take.

Kept apart from the model file so that the plugin's config convertor (which sizes the KV cache) and the model
(which sizes its layers) read one answer.
"""

from __future__ import annotations

import os

from hylo.config import HybridConfig
from hylo.serving.widen import ServedMLA, served_mla

# vLLM 0.32: the CPU MLA backend takes 576 only (v1/attention/backends/mla/cpu_mla.py); on a GPU the common MLA
# metadata takes 320, 512 or 576 (model_executor/layers/attention/mla_attention.py) and the Triton MLA backend any
# of them, so the narrowest that holds the latent is served. HYLO_MLA_WIDTH=576 forces a width (e.g. for FlashMLA).
CPU_WIDTHS = (576,)
GPU_WIDTHS = (320, 512, 576)


def accepted_widths() -> tuple[int, ...]:
    forced = os.environ.get("HYLO_MLA_WIDTH")
    if forced:
        return (int(forced),)
    from vllm.platforms import current_platform

    return CPU_WIDTHS if current_platform.is_cpu() else GPU_WIDTHS


def served_widths(cfg: HybridConfig) -> ServedMLA:
    return served_mla(cfg, accepted_widths())
