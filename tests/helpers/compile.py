"""What the compiled-blocks tests share (tests/train/test_compile_step.py, test_compile_zero3.py): a tiny HyLo
and the boundaries of packed rows of 1 to 6 documents."""

from __future__ import annotations

import random

import torch

from hylo.config import HybridConfig
from hylo.modeling import HyLoForCausalLM

# the rows' length
T = 48


def tiny(layers: int = 2, mla: tuple[int, ...] = (0,)) -> HyLoForCausalLM:
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layer=layers, mla_layers=list(mla),
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8, gdn_num_heads=2, gdn_head_dim=8, gdn_chunk_size=8,
                       tie_word_embeddings=False)
    return HyLoForCausalLM(cfg).train()


def rows(n: int, seed: int = 0) -> list[list[int]]:
    """Boundaries of n rows of T tokens, 1 to 6 documents each (every count from 1 to 6 appears)."""
    rng = random.Random(seed)
    counts = [1, 2, 3, 4, 5, 6] + [rng.randint(1, 6) for _ in range(n - 6)]
    rng.shuffle(counts)
    return [[0, *sorted(rng.sample(range(1, T), d - 1)), T] for d in counts]
