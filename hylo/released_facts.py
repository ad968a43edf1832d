"""What AMD's public Hybrid-Models code accepts, as read at one commit: the one place to edit when it changes.

Read from github.com/AMD-AGI/AMD-Hybrid-Models at `AMD_COMMIT` (bench/amd_compat.py checks every fact below
against a checkout of that repository and runs it; the tests, which cannot reach it, use these facts):
* Zebra-Llama (`Zebra-Llama/hybrid/hybrid_config.py`): `HybridConfig` is a plain dataclass built as
  `HybridConfig(**json.load(hybrid_config.json))`: a key it has no field for is a TypeError, a missing key
  takes the field's default, and `__post_init__` asserts `HYBRID_CONFIG_ASSERTS` (a None rank there is a
  TypeError: `None % 8`). Fields removed in 2025 (commit c33ccff) are `HYBRID_CONFIG_REMOVED`: older
  checkpoints carry them (read on import), the current loader refuses them (never written).
* Their layers: the MLA latent norms are `DeepseekV3RMSNorm` at its default eps (`LATENT_NORM_EPS`); the
  Mamba-2 gated norm has a fixed eps (`MAMBA_GATED_NORM_EPS`, `Zebra-Llama/hybrid/mamba2/hybrid_mamba2_layer.py`),
  whatever `rms_norm_eps` says; `Mamba2(**ssm_cfg)` takes `MAMBA2_ARGS`.
* X-EcoMLA (`X-EcoMLA/mla/hybrid_wrapper.py`, `hybrid_mla_config.py`): `MLA_config.json` is `asdict` of the
  `MLAConfig` dataclass without `deepseek_cfg` (read back as `MLAConfig(deepseek_cfg=..., **json)`), and
  `mla_layer_config.json` is `DeepseekV3Config.to_json_file(use_diff=True)` (with their pinned transformers
  4.43 that drops only PretrainedConfig keys left at their defaults); read back as `DeepseekV3Config(**json)`,
  a missing key takes its default (`DEEPSEEK_V3_DEFAULTS`) and `DEEPSEEK_V3_ASSERTS` run. `MLAConfig`'s
  `deepseek_cfg` default is a config instance: Python >= 3.11 refuses that dataclass (a mutable default), so
  their X-EcoMLA code imports on Python 3.10 only (their Docker images' version).
"""

from __future__ import annotations

import math
from typing import Any

AMD_REPO = "AMD-AGI/AMD-Hybrid-Models"
AMD_COMMIT = "61c93485c3b034c28cafc912bcfc243936aaeffc"
AMD_COMMIT_DATE = "2026-05-14"
AMD_AT = f"{AMD_REPO}@{AMD_COMMIT[:8]} ({AMD_COMMIT_DATE})"

# ------------------------------------------------------------------------------------ Zebra-Llama
HYBRID_CONFIG_NAME = "hybrid_config.json"
# HybridConfig: every field and its default, in order
HYBRID_CONFIG_FIELDS: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 18432, "hidden_act": "silu", "n_layer": 32, "mla_layers": [],
    "rms_norm_eps": 1e-5, "num_attention_heads": 32, "num_key_value_heads": 8, "kv_lora_rank": 128,
    "q_lora_rank": 1536, "use_lora_layer_norm": False, "use_full_kv_head": False, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "qkv_rank_divisor": 8, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
    "rope_type": "yarn", "d_model": 2560, "ssm_cfg": {}, "d_inner": None, "d_xb": 2560,
}
# HybridConfig.__post_init__, in order: (what it asserts, the assert as code over the config's fields)
HYBRID_CONFIG_ASSERTS: tuple[tuple[str, str], ...] = (
    ("qkv_rank_divisor must be divisible by 8", "qkv_rank_divisor % 8 == 0"),
    ("kv_lora_rank must be divisible by qkv_rank_divisor", "kv_lora_rank % qkv_rank_divisor == 0"),
    ("q_lora_rank must be divisible by qkv_rank_divisor", "q_lora_rank % qkv_rank_divisor == 0"),
    ("num_attention_heads must be divisible by num_key_value_heads", "num_attention_heads % num_key_value_heads == 0"),
)
# fields of older versions (removed in c33ccff, 2025-08-29) and their old defaults
HYBRID_CONFIG_REMOVED: dict[str, Any] = {
    "use_fixed_rank_for_first_and_last_block": False, "layer_rank_list": {}, "q_energy_ratio": None,
    "kv_energy_ratio": None,
}
# DeepseekV3RMSNorm's default eps (the latent norms); the Mamba-2 gated RMSNorm's fixed eps
LATENT_NORM_EPS = 1e-6
MAMBA_GATED_NORM_EPS = 1e-5
# Mamba2(d_model, d_xb, d_inner, **ssm_cfg): the defaults of its arguments that shape the math ...
MAMBA2_ARGS: dict[str, Any] = {
    "d_state": 128, "d_conv": 4, "expand": 2, "ngroups": 1, "repeat_kv_before_conv": False, "D_has_hdim": False,
    "rmsnorm": True, "norm_before_gate": False, "dt_limit": [0.0, math.inf], "bias": False, "conv_bias": True,
    "d_ssm": None,
}
# ... and those that only initialise or schedule
MAMBA2_ARGS_NO_MATH = ("headdim", "conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "chunk_size",
                       "use_mem_eff_path", "sequence_parallel")
# YaRN's original window when rope_scaling has none (DeepseekV3YarnRotaryEmbedding's default)
YARN_DEFAULT_ORIGINAL = 4096
# their inference wrapper (Zebra-Llama/hybrid_inference/mla/hybrid_mla_layer.py) builds kv_b_proj with
# num_key_value_heads blocks and never reads use_full_kv_head: a checkpoint with one block per query head loads
# in their HybridModelWrapper but not there (a size mismatch)
INFERENCE_READS_FULL_KV_HEAD = False

# ------------------------------------------------------------------------------------ X-EcoMLA
MLA_CONFIG_NAME = "MLA_config.json"
MLA_LAYER_CONFIG_NAME = "mla_layer_config.json"
# MLAConfig without deepseek_cfg: every field and its default, in order (attn_layers: the layers that stay
# the base's attention; the others are MLA)
MLA_CONFIG_FIELDS: dict[str, Any] = {
    "d_model": 2560, "rms_norm_eps": 1e-5, "vocab_size": None, "d_inner": None, "d_xb": 2560,
    "intermediate_size": 10240, "hidden_act": "silu", "n_layer": 32, "attn_layers": [],
}
# DeepseekV3Config.__init__: every named argument and its default (model_type "deepseek_v3"); other keys are
# kept as attributes (PretrainedConfig's **kwargs)
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "llama_num_key_value_heads": 128,
    "mla_num_key_value_heads": 16, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "use_lora_layer_norm": False, "use_fixed_rank_for_first_and_last_block": False,
    "layer_rank_list": {}, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "q_energy_ratio": 0.99, "q_svd_norm": 2.0, "kv_energy_ratio": None, "kv_svd_norm": 2.0, "qkv_rank_divisor": 8,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
    "rope_type": "yarn",
}
# DeepseekV3Config.__init__'s asserts, in order
DEEPSEEK_V3_ASSERTS: tuple[tuple[str, str], ...] = (
    ("q_energy_ratio must be (0, 1]", "q_energy_ratio is None or 1.0 >= q_energy_ratio > 0.0"),
    ("q_energy_ratio must be (0, 1]", "kv_energy_ratio is None or 1.0 >= kv_energy_ratio > 0.0"),
    ("qkv_rank_divisor must be divisible by 8", "qkv_rank_divisor % 8 ==0"),
    ("kv_lora_rank must be divisible by qkv_rank_divisor", "kv_lora_rank % qkv_rank_divisor ==0"),
    ("q_lora_rank must be divisible by qkv_rank_divisor", "q_lora_rank % qkv_rank_divisor ==0"),
)


# ------------------------------------------------------------------------------------ their constructors
def _asserts(values: dict[str, Any], asserts: tuple[tuple[str, str], ...], where: str) -> str | None:
    for message, expr in asserts:
        try:
            ok = eval(expr, {"__builtins__": {}}, dict(values))  # noqa: S307 - our own fixed expressions
        except TypeError as e:
            return f"TypeError in {where}: {e} (evaluating `{expr}`)"
        if not ok:
            return f"AssertionError in {where}: {message} (`{expr}`)"
    return None


def hybrid_config_refusal(hyb: dict[str, Any]) -> str | None:
    """What `HybridConfig(**hyb)` raises at AMD_COMMIT, worded as their code raises it; None if it builds."""
    unknown = [k for k in hyb if k not in HYBRID_CONFIG_FIELDS]
    if unknown:
        return (f"TypeError: HybridConfig.__init__() got an unexpected keyword argument {unknown[0]!r} "
                f"(not a field of AMD's HybridConfig at {AMD_AT}: {', '.join(unknown)})")
    return _asserts({**HYBRID_CONFIG_FIELDS, **hyb}, HYBRID_CONFIG_ASSERTS, "HybridConfig.__post_init__")


def mla_config_refusal(mla_config: dict[str, Any], layer_config: dict[str, Any]) -> str | None:
    """What X-EcoMLA's `DeepseekV3Config(**layer_config)` then `MLAConfig(deepseek_cfg=..., **mla_config)` raise."""
    bad = _asserts({**DEEPSEEK_V3_DEFAULTS, **layer_config}, DEEPSEEK_V3_ASSERTS, "DeepseekV3Config.__init__")
    if bad:
        return bad
    unknown = [k for k in mla_config if k not in MLA_CONFIG_FIELDS]
    if unknown:
        return f"TypeError: MLAConfig.__init__() got an unexpected keyword argument {unknown[0]!r}"
    return None
