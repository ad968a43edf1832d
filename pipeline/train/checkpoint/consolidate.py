"""Consolidation: the trained model, gathered from the ZeRO partitions, as an HF-format HyLo checkpoint.

Design choices:
* Consolidation gathers, parameter group by parameter group, the fp32 MASTER weights from the
  optimiser (ZeRO keeps them partitioned there; with bf16 the module holds only bf16 copies) and the
  working weights of frozen parameters (or, when those are not fp32, the starting checkpoint's exact
  values) into a CPU state dict on rank 0, and saves a `HyLoForCausalLM` with `hylo.io.save_hylo`
  (safetensors + config.json + hybrid_config.json, atomic directory rename).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hylo.io import load_hylo, save_hylo
from hylo.logs import get_logger
from hylo.modeling import HyLoForCausalLM
from hylo.pipeline.train.checkpoint.layout import CheckpointError
from hylo.pipeline.train.nonfinite import NonFiniteError

logger = get_logger(__name__)


def _is_zero3(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def master_weight(p: torch.nn.Parameter) -> torch.Tensor | None:
    """Collective for partitioned parameters: the full fp32 master copy the optimiser updates (ZeRO-3:
    partitioned in the optimiser; ZeRO-1/2 and DeepSpeed's bf16 optimiser: a flat fp32 buffer), or None
    when the optimiser keeps none (frozen parameters; plain fp32 training, where the weights are the master)."""
    if not p.requires_grad or (_is_zero3(p) and getattr(p, "_z3_optimizer", None) is None):
        return None
    if not _is_zero3(p) and not hasattr(p, "_hp_mapping"):
        return None
    from deepspeed.utils import safe_get_full_fp32_param  # lazy: deepspeed

    return safe_get_full_fp32_param(p)


@torch.no_grad()
def gather_state_dict(module: torch.nn.Module, rank: int) -> tuple[dict[str, torch.Tensor] | None, set[str]]:
    """Collective: full fp32 CPU state dict on rank 0 (None elsewhere), gathered submodule by submodule.

    Trained parameters come from the optimiser's fp32 master weights (`master_weight`), the others
    from the module (gathered when partitioned). Also returns the names taken from working weights
    that are not fp32 (their values were rounded when the model was loaded in that dtype)."""
    import deepspeed  # lazy: deepspeed

    out: dict[str, torch.Tensor] = {}
    rounded: set[str] = set()
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        params = [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub.named_parameters(recurse=False)
                  if id(p) not in seen]
        working = []
        for name, p in params:
            seen.add(id(p))
            master = master_weight(p)
            if master is None:
                working.append((name, p))
            elif rank == 0:
                out[name] = master.detach().to("cpu", torch.float32).reshape(p.ds_shape if _is_zero3(p) else p.shape).clone()
        full = [p for _, p in working if _is_zero3(p)]
        if working:
            with deepspeed.zero.GatheredParameters(full, modifier_rank=None, enabled=bool(full)):
                if rank == 0:
                    for name, p in working:
                        out[name] = p.detach().to("cpu", torch.float32).clone()
                        if p.dtype != torch.float32:
                            rounded.add(name)
        if rank == 0:
            for n, b in sub.named_buffers(recurse=False):
                if b is not None:
                    out[f"{prefix}.{n}" if prefix else n] = b.detach().cpu().clone()
    return (out if rank == 0 else None), rounded


def consolidate_hylo(module: torch.nn.Module, out_dir: Path, rank: int, dtype: torch.dtype = torch.float32,
                     tokenizer_from: str | Path | None = None) -> Path | None:
    """Collective: write the trained `HyLoForCausalLM` (possibly ZeRO-3 partitioned) as an HF checkpoint,
    with the tokenizer files of directory `tokenizer_from` (the checkpoint training started from).

    Trained weights are the fp32 masters; frozen weights that training held in a lower precision are
    taken from `tokenizer_from`'s checkpoint itself (they never changed), so nothing is rounded."""
    sd, rounded = gather_state_dict(module, rank)
    if rank != 0:
        return None
    # the loop stops at a non-finite step and checks the weights before the last checkpoint; this is the
    # last guard: no model is written from weights that are not finite
    bad = [n for n, t in sd.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteError(f"consolidation into {out_dir}: {len(bad)} tensor(s) hold NaN or inf (first: "
                             f"{bad[0]}); no model written")
    cfg = module.config
    if rounded and tokenizer_from is not None:
        model = load_hylo(tokenizer_from, dtype=torch.float32)
        for name in rounded:
            sd.pop(name, None)
        logger.info(f"[train] consolidation: {len(rounded)} frozen tensors taken from {tokenizer_from} "
                    f"(training held them in lower precision)")
    else:
        model = HyLoForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight") and k not in rounded]
    if missing or unexpected:
        raise CheckpointError(f"consolidation into {out_dir}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if getattr(module, "generation_config", None) is not None:
        model.generation_config = module.generation_config
    return save_hylo(model.to(dtype), out_dir, tokenizer_from=tokenizer_from)
