"""The measured score of every layer, one Ray task per layer; each worker process loads the two students once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.eval.kl import scored_tokens
from hylo.pipeline.placement.rows import PlacementError
from hylo.pipeline.placement.swap import layer_inputs, swapped_kl, teacher_hidden

_MODELS: dict[str, nn.Module] = {}


def _model(path: str) -> nn.Module:
    """Each worker process loads a student once and keeps it for the layers it scores."""
    if path not in _MODELS:
        from hylo.io import load_hylo  # lazy: transformers

        _MODELS[path] = load_hylo(path, dtype=torch.float32).eval()
    return _MODELS[path]


def _score_layer(i: int, linear_dir: str, mla_dir: str, inputs: list[torch.Tensor], rows: list[PackedRow],
                 teacher: tuple[list[torch.Tensor], torch.Tensor], threads: int) -> tuple[int, float]:
    torch.set_num_threads(threads)
    return i, swapped_kl(_model(linear_dir), _model(mla_dir), i, inputs, rows, *teacher)


@torch.no_grad()
def score_layers(linear_dir: str | Path, mla_dir: str | Path, base: nn.Module, rows: list[PackedRow],
                 threads_per_task: int = 1, progress: bool = True) -> dict[str, Any]:
    """Measured KL drop of every layer, scored in parallel with Ray tasks (ray must be initialised)."""
    import ray  # lazy: ray

    linear = _model(str(linear_dir))
    mla = _model(str(mla_dir))
    n = len(linear.model.layers)
    if len(mla.model.layers) != n:
        raise PlacementError(f"{linear_dir} has {n} layers, {mla_dir} {len(mla.model.layers)}: convert both "
                             "from the same base")
    if len(linear.config.mla_layers) != 0 or len(mla.config.mla_layers) != n:
        raise PlacementError(f"{linear_dir} must be all-linear (mla_layers: none) and {mla_dir} all-MLA "
                             f"(mla_layers: all); they have {len(linear.config.mla_layers)} and "
                             f"{len(mla.config.mla_layers)} MLA layers")
    teacher = (teacher_hidden(base, rows), base.get_output_embeddings().weight.detach().float())
    per_row = [layer_inputs(linear, r) for r in rows]  # [row][layer] -> [T, D]
    kl_linear = swapped_kl(linear, mla, None, [p[0] for p in per_row], rows, *teacher)
    kl_mla = swapped_kl(mla, mla, None, [mla.model.embed_tokens(r.input_ids) for r in rows], rows, *teacher)
    rows_ref, teacher_ref = ray.put(rows), ray.put(teacher)
    task = ray.remote(num_cpus=threads_per_task)(_score_layer)
    pending = [task.remote(i, str(linear_dir), str(mla_dir), ray.put([p[i] for p in per_row]), rows_ref,
                           teacher_ref, threads_per_task) for i in range(n)]
    del per_row
    kl_swap: dict[int, float] = {}
    bar = None
    if progress:
        bar = tqdm(total=n, desc="scoring layers", unit="layer")
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        i, kl = ray.get(done[0])
        kl_swap[i] = kl
        if bar is not None:
            bar.update(1)
            bar.set_postfix(layer=i, drop=f"{kl_linear - kl:.4f}")
    if bar is not None:
        bar.close()
    return {"kl_all_linear": kl_linear, "kl_all_mla": kl_mla,
            "kl_swap": [kl_swap[i] for i in range(n)],
            "drop": [kl_linear - kl_swap[i] for i in range(n)],
            "tokens": int(sum(scored_tokens(r).numel() for r in rows)), "rows": len(rows)}
