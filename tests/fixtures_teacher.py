"""Small fixtures shared by the teacher and training tests: a tiny random Llama and packed rows.

Test modules import it as `from fixtures_teacher import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


def save_tiny_llama(out_dir: str | Path, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2,
                    seed: int = 0, tokenizer_salt: str = "") -> Path:
    """A random LlamaForCausalLM (fp32, safetensors) plus a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform logits; a larger lm_head makes top-k orderings well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"w{tokenizer_salt}{i}": i for i in range(vocab_size)}
    Tokenizer(WordLevel(vocab, unk_token=f"w{tokenizer_salt}0")).save(str(out / "tokenizer.json"))
    return out


def make_packed_row(doc_lengths: list[int], vocab_size: int, seed: int, pad: int = 0) -> dict[str, Any]:
    """A packed row of random documents; `pad` trailing tokens form a final padding document."""
    g = np.random.default_rng(seed)
    lengths = list(doc_lengths) + ([pad] if pad else [])
    t = sum(lengths)
    ids = g.integers(0, vocab_size, size=t, dtype=np.int64)
    if pad:
        ids[-pad:] = 0
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    mask = np.ones(t, dtype=np.bool_)
    mask[cu[1:] - 1] = False
    if pad:
        mask[-pad:] = False
    return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "loss_mask": mask,
            "doc_ids": [f"s{seed}-d{i}" for i in range(len(lengths))]}


def write_packed_parquet(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write packed rows as one Parquet file in the data pipeline's row schema."""
    import pyarrow.parquet as pq

    from hylo.pipeline.data.rowfile import rows_to_table

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows_to_table(rows), path)
    return path
