"""The base model: its config.json, its weights, with clear errors for missing, corrupt or unsupported input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from hylo.io import CheckpointMismatchError, from_pretrained_checked
from hylo.json_files import read_json
from hylo.model_files import check_model_config, nonfinite_tensors
from hylo.upcycle.options import SUPPORTED_BASE_TYPES, UpcycleError


def read_base_config(cfg_file: str | Path) -> dict[str, Any]:
    """A base model's config.json as a dict: valid JSON with a supported `model_type` and every field within
    what a model can be built from (hylo.model_files), else UpcycleError naming the file and the field."""
    cfg_file = Path(cfg_file)
    raw = read_json(cfg_file, UpcycleError, mapping=True)
    mt = raw.get("model_type")
    if mt not in SUPPORTED_BASE_TYPES:
        arch = raw.get("architectures")
        raise UpcycleError(f"{cfg_file}: model_type {mt!r}{f' (architectures {arch})' if arch else ''} is not "
                           f"supported; supported: {', '.join(SUPPORTED_BASE_TYPES)}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if key not in raw:
            raise UpcycleError(f"{cfg_file}: missing {key} (a base model's config.json names its shape)")
    check_model_config(raw, cfg_file, UpcycleError)
    return raw


def load_base_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a base HF causal LM directory with clear errors for missing/corrupt/unsupported input."""
    p = Path(path)
    if not p.exists():
        raise UpcycleError(f"base model directory {p} does not exist")
    if not p.is_dir():
        raise UpcycleError(f"base model path {p} is not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UpcycleError(f"{p}: no config.json (is this a Hugging Face model directory?)")
    read_base_config(cfg_file)
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise UpcycleError(f"{p}: no weight files (*.safetensors) found")
    try:
        AutoConfig.from_pretrained(p)
        # a missing, unexpected or mis-shaped tensor is refused, naming it (never a random layer)
        model = from_pretrained_checked(AutoModelForCausalLM, p, dtype=dtype)
    except CheckpointMismatchError as e:
        raise UpcycleError(f"base model {e}") from None
    except Exception as e:  # transformers raises many kinds for corrupt files
        raise UpcycleError(f"{p}: could not load the base model weights: {type(e).__name__}: {e}") from e
    return model


@torch.no_grad()
def check_base_weights(base_model: nn.Module, shown: int = 5) -> None:
    """Refuse a base model with NaN or infinite weights: conversion would copy them without a word."""
    bad = [f"{name} ({n} value{'s' if n > 1 else ''})" for name, n in nonfinite_tensors(base_model.named_parameters())]
    if bad:
        more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
        raise UpcycleError(f"the base model has non-finite (NaN/inf) weights in {len(bad)} base tensors: "
                           f"{', '.join(bad[:shown])}{more}; refusing to convert a corrupt checkpoint")
