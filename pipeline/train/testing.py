"""Tiny fixtures for the training tests and smoke runs: a random Llama base, its HyLo conversion, a config.

Kept in the package (like pipeline/teacher/testing.py) so tests, benches and smoke runs share them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def make_tiny_models(root: str | Path, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
                     mla_layers: str = "even", seed: int = 0) -> dict[str, Path]:
    """A random Llama base (also the teacher) and its HyLo conversion (MLA on `mla_layers`, GDN elsewhere)."""
    from hylo.io import save_hylo
    from hylo.upcycle import load_base_model, upcycle
    from pipeline.teacher.testing import save_tiny_llama

    root = Path(root)
    base = save_tiny_llama(root / "base", vocab_size=vocab_size, hidden_size=hidden_size, layers=layers, seed=seed)
    student = upcycle(load_base_model(base), mla_layers=mla_layers, kv_lora_rank=16, gdn_head_dim=8,
                      gdn_num_heads=4)
    save_hylo(student, root / "student", tokenizer_from=base)
    return {"base": base, "student": root / "student"}


def tiny_config(models: dict[str, Path], storage: str | Path, name: str, stage: int = 2,
                **sections: dict[str, Any]) -> dict[str, Any]:
    """A config dict for a tiny 2-worker run on synthetic rows (torchrun launcher by default)."""
    cfg: dict[str, Any] = {
        "model": {"student": str(models["student"]), "base": str(models["base"])},
        "data": {"source": "synthetic", "seq_len": 64, "split": f"stage{stage}",
                 "synthetic": {"rows": 48, "vocab_size": 96, "min_doc_len": 8, "max_doc_len": 40}},
        "optim": {"lr": 1e-3, "warmup_ratio": 0.1},
        "train": {"global_batch_sequences": 4},
        "checkpoint": {"every_steps": 3, "keep": None},
        "ray": {"num_workers": 2, "storage_path": str(storage), "name": name, "launcher": "torchrun"},
        "metrics": {"tensorboard": True},
    }
    if stage == 2:
        cfg["teacher"] = {"model": {"path": str(models["base"])}}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def write_config(cfg: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
