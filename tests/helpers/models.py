"""Configs of models the tests share: the published Llama 3.2 bases' config.json (nothing downloaded) and the
tiny student / teacher whose directories hold only a config.json (`hylo estimate` at tiny shapes)."""

from __future__ import annotations

from transformers import LlamaConfig

from hylo.config import HybridConfig

LLAMA_3B = {
    "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
    "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}
LLAMA_1B = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
}

# the vocabulary of the tiny student and teacher
TINY_VOCAB = 512


def tiny_student() -> HybridConfig:
    return HybridConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, n_layer=4,
                        mla_layers=[0, 2], num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2,
                        gdn_head_dim=16, gdn_chunk_size=16, tie_word_embeddings=False)


def tiny_teacher() -> LlamaConfig:
    return LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False)
