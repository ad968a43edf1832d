"""The proxy that needs no training: per-layer error of each converted mixer at initialisation against the
base attention output it replaces, in the three forms the search reports (`PROXIES`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from hylo.pipeline.data.rows import PackedRow

# The proxy's names (`hylo place-layers --proxy`): this module imports torch only when it scores, so the
# command line's help does not.
PROXIES = ("linear_error", "linear_error_rel", "error_gap")


def proxy_scores(base: nn.Module, linear: nn.Module, mla: nn.Module, rows: list[PackedRow]) -> dict[str, list[float]]:
    """Per-layer errors of the converted (untrained) mixers against the base attention outputs."""
    import torch  # lazy: torch

    with torch.no_grad():
        return _proxy_scores(base, linear, mla, rows)


def _proxy_scores(base: nn.Module, linear: nn.Module, mla: nn.Module, rows: list[PackedRow]) -> dict[str, list[float]]:
    import numpy as np  # lazy: numpy

    from hylo.pipeline.train.stage1 import BaseLayerTargets  # lazy: torch

    targets = BaseLayerTargets(base)
    n = len(linear.model.layers)
    err_lin, err_mla, attn = np.zeros(n), np.zeros(n), np.zeros(n)
    count = 0.0
    for r in rows:
        x_in, _, y_mix = targets(r)
        keep = r.real_tokens()
        count += float(keep.sum())
        for i in range(n):
            for model, acc in ((linear, err_lin), (mla, err_mla)):
                layer = model.model.layers[i]
                out = layer.run_mixer(layer.input_layernorm(x_in[i]), r.position_ids[None], r.cu_seqlens)[0]
                acc[i] += float(((out - y_mix[i][0]).pow(2).sum(-1).sqrt() * keep).sum())
            attn[i] += float((y_mix[i][0].pow(2).sum(-1).sqrt() * keep).sum())
    err_lin, err_mla, attn = err_lin / count, err_mla / count, attn / count
    return {"linear_error": err_lin.tolist(), "linear_error_rel": (err_lin / attn).tolist(),
            "error_gap": (err_lin - err_mla).tolist(), "mla_error": err_mla.tolist(), "attention_norm": attn.tolist()}
