"""Saving and loading HyLo checkpoints atomically.

A saved directory holds: safetensors weights (sharded with `model.safetensors.index.json` above
`max_shard_size`, 5 GB by default), `config.json` (the source of truth, with `auto_map`),
`hybrid_config.json` (a copy of its architecture keys for tools that read the released layout), the
model code (`modeling_hylo.py`, `configuration_hylo.py` and the modules they import, see
`hylo/remote_code.py`) so that `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works
without this project, the generated model card (`README.md` from `hylo_card.json`, see `hylo/card.py`)
and the tokenizer. The directory is written under a temporary name beside the target and renamed into
place only when complete, so a crash never leaves a directory that looks like a finished checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from hylo.atomic import atomic_write
from hylo.card import provenance as card_provenance
from hylo.card import write_card
from hylo.config import HYBRID_CONFIG_NAME, HybridConfig, HybridConfigError
from hylo.json_files import read_json
from hylo.modeling import HyLoForCausalLM
from hylo.outputs import atomic_dir
from hylo.released import is_released_layout, load_released
from hylo.released_xecomla import is_xecomla_layout, load_xecomla
from hylo.tokenizer_files import copy_tokenizer_files
from hylo.weight_files import WeightsFileError, check_weights_dir


class CheckpointMismatchError(ValueError):
    """A checkpoint's weights do not match its model (missing, unexpected or mis-shaped tensors)."""


def stock_tokenizer_config(directory: str | Path) -> None:
    """Make a saved tokenizer load with transformers' own classes: tokenizer_config.json names its class
    (`PreTrainedTokenizerFast` for a bare tokenizer.json) and keeps no `auto_map` to code that is not in the
    directory (the base's custom tokenizer code is not copied). `AutoTokenizer` then runs no tokenizer code
    from the checkpoint; it still reads config.json first, hence `trust_remote_code=True` in the snippets."""
    d = Path(directory)
    path = d / "tokenizer_config.json"
    if not path.is_file():
        return
    data = read_json(path, ValueError, mapping=True)
    changed = False
    auto_map = data.get("auto_map")
    if auto_map is not None:
        refs = auto_map if isinstance(auto_map, list | tuple) else auto_map.get("AutoTokenizer") or []
        refs = [refs] if isinstance(refs, str) else refs
        if any(r and not (d / (r.split("--")[-1].rsplit(".", 1)[0] + ".py")).is_file() for r in refs):
            data.pop("auto_map")
            changed = True
    if not data.get("tokenizer_class") and (d / "tokenizer.json").is_file():
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        changed = True
    if changed:
        atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def save_hylo(model, out_dir: str | Path, tokenizer=None, tokenizer_from: str | Path | None = None,
              max_shard_size: int | str = "5GB", provenance: dict | None = None) -> Path:
    """Write `model` (and a tokenizer object, or the tokenizer files of directory `tokenizer_from`) atomically,
    with its model code and card. `provenance` adds to what the card infers (e.g. {"teacher": ..., "step": ...})."""
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        # HyLoForCausalLM.save_pretrained also writes hybrid_config.json and the model code (auto_map)
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        elif tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
        stock_tokenizer_config(tmp)
        source = tokenizer_from if tokenizer_from is not None else getattr(tokenizer, "name_or_path", None)
        write_card(tmp, model.config, card_provenance(out, source, provenance))
    return out


def _loading_report(info: dict, shown: int = 8) -> list[str]:
    """Lines for every missing, unexpected or mis-shaped tensor of a `from_pretrained` loading report."""
    lines = []
    for kind in ("missing", "unexpected"):
        keys = sorted(info.get(f"{kind}_keys") or [])
        lines += [f"{kind}: {k}" for k in keys[:shown]]
        if len(keys) > shown:
            lines.append(f"... and {len(keys) - shown} more {kind}")
    for item in list(info.get("mismatched_keys") or [])[:shown]:
        key, *shapes = item if isinstance(item, tuple | list) else (item,)
        lines.append(f"shape mismatch: {key} " + " vs ".join(str(tuple(s)) for s in shapes))
    lines += [f"error: {m}" for m in info.get("error_msgs") or []]
    return lines


def from_pretrained_checked(cls, path: str | Path, what: str = "its config.json", **kwargs):
    """`cls.from_pretrained(path, **kwargs)` (a model class or `AutoModelForCausalLM`), refusing weights
    that do not match the model: a tensor the model expects but the files lack, one it has no place for,
    or one of the wrong shape is a `CheckpointMismatchError` naming each (transformers would initialise a
    missing tensor at random and only log it). The one loading rule for every model this project loads:
    the base to convert, stage 1's base, the teacher, the evaluated models, HyLo checkpoints."""
    model, info = cls.from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    problems = _loading_report(info)
    if problems:
        raise CheckpointMismatchError(
            f"{path}: the weights do not match the model described by {what} ({len(problems)} problem(s)); "
            f"refusing to use a partly random model:\n  " + "\n  ".join(problems))
    return model


def load_hylo(path: str | Path, dtype=None, device: str | None = None):
    """Load a HyLo checkpoint with clear errors for missing or incomplete directories.

    `dtype`: a torch dtype, None (float32) or "auto" (as stored).

    Loading is strict: a tensor the model expects but the files lack, a tensor the model has no place
    for, or one of the wrong shape is a `CheckpointMismatchError` naming the keys (never a silently
    random-initialised mixer). A directory in the released layout of AMD's Hybrid-Models code
    (hybrid_config.json with their keys, `mla.*` weights; or X-EcoMLA's MLA_config.json + mla_layer_config.json)
    is imported through `hylo.released`.
    """
    p = Path(path)
    if not p.is_dir():
        raise HybridConfigError(f"HyLo checkpoint {p} does not exist or is not a directory")
    xecomla = is_xecomla_layout(p)
    if not (p / HYBRID_CONFIG_NAME).is_file() and not xecomla:
        raise HybridConfigError(f"{p}: no {HYBRID_CONFIG_NAME}; not a HyLo checkpoint (convert one with jobs/convert.py)")

    try:
        # dtype "auto" keeps the stored dtype; None loads float32
        if xecomla:
            model = load_xecomla(p, dtype=None if dtype == "auto" else (dtype or torch.float32))
        elif is_released_layout(p):
            model = load_released(p, dtype=None if dtype == "auto" else (dtype or torch.float32))
        else:
            cfg = HybridConfig.from_hybrid_json(p)
            model = from_pretrained_checked(HyLoForCausalLM, p, f"its {HYBRID_CONFIG_NAME}", config=cfg,
                                            dtype=dtype or torch.float32)
    except SafetensorError as e:
        # safetensors' own error names no file: find the truncated or corrupt one
        check_weights_dir(p)
        raise WeightsFileError(f"{p}: cannot read the weights ({e})") from None
    if device is not None:
        model = model.to(device)
    return model
