"""X-EcoMLA checkpoints as AMD's code writes them (`X-EcoMLA/mla/hybrid_wrapper.py`, read at the commit of
hylo/released_facts.py): the base Llama's config.json, `asdict` of their MLAConfig without `deepseek_cfg` as
MLA_config.json, their layer config (every DeepseekV3Config key, `layer_rank_list` with each MLA layer's ranks)
as mla_layer_config.json, and safetensors with each layer's mixer under `mla.`; kv_b_proj has one block per
query head and the head is tied when config.json says so (their loader builds a LlamaForCausalLM). The
reference forward (`their_logits`) is released.py's plain-torch reading of their MLA layer (interleaved RoPE,
DeepSeek's YaRN), layer by layer with that layer's ranks. For tests/model/test_released_xecomla.py and the
model-file tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hylo.released_facts import DEEPSEEK_V3_DEFAULTS

from tests.helpers.released import rms, their_mla

D, F, VOCAB, H, G, N, P, V = 32, 48, 61, 4, 2, 6, 8, 8
LAYERS = 3


def variant(**kw) -> dict:
    """An X-EcoMLA checkpoint: fixed ranks (q 16, kv 16 in every layer), no latent norms, an untied head, no
    RoPE scaling, unless `kw` says otherwise. `ranks`: {layer: (q, kv)} written to layer_rank_list."""
    v = dict(q_lora_rank=16, kv_lora_rank=16, ranks={i: (16, 16) for i in range(LAYERS)}, use_lora_layer_norm=False,
             attention_bias=False, rope_scaling=None, tie=False, rope_theta=500.0, attn_layers=[])
    v.update(kw)
    return v


VARIANTS = {
    "fixed-ranks": variant(),
    # latent norms, biases, DeepSeek YaRN with mscale under their key `type`, a tied head (SmolLM's)
    "norms-bias-yarn-tied": variant(use_lora_layer_norm=True, attention_bias=True, tie=True,
                                    rope_scaling={"factor": 4.0, "original_max_position_embeddings": 8, "type": "yarn",
                                                  "mscale": 0.9, "mscale_all_dim": 1.0}),
    # what their training script writes for a Llama-3.2 base (llama3 scaling): YaRN without an original window
    "llama32-yarn": variant(rope_scaling={"factor": 32.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                          "mscale_all_dim": 0.0, "type": "yarn"}, rope_theta=500000.0),
}
# ranks chosen per layer by an energy ratio: imported zero-padded to the largest (the export writes those)
PER_LAYER = {
    "energy-ranks": variant(ranks={0: (8, 16), 1: (24, 8), 2: (16, 24)}),
    # a layer without an entry keeps the ranks the layer before it set (their layers mutate one config)
    "unlisted-layer": variant(ranks={0: (8, 16), 2: (24, 8)}),
}


def _layer_ranks(v: dict) -> dict[int, tuple[int, int]]:
    q, kv, out = v["q_lora_rank"], v["kv_lora_rank"], {}
    for i in range(LAYERS):
        q, kv = v["ranks"].get(i, (q, kv))
        out[i] = (q, kv)
    return out


def their_files(v: dict) -> tuple[dict, dict, dict]:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": D,
            "intermediate_size": F, "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": G,
            "head_dim": D // H, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
            "rope_theta": v["rope_theta"], "tie_word_embeddings": v["tie"], "bos_token_id": 7, "eos_token_id": 8,
            "torch_dtype": "bfloat16"}
    mla = {"d_model": D, "rms_norm_eps": 1e-5, "vocab_size": None, "d_inner": D, "d_xb": G * (D // H),
           "intermediate_size": F, "hidden_act": "silu", "n_layer": LAYERS, "attn_layers": v["attn_layers"]}
    layer = {**DEEPSEEK_V3_DEFAULTS, "hidden_size": D, "intermediate_size": F, "num_attention_heads": H,
             "llama_num_key_value_heads": G, "mla_num_key_value_heads": H, "q_energy_ratio": None,
             "kv_energy_ratio": None, "max_position_embeddings": 64, "rope_theta": v["rope_theta"],
             "q_lora_rank": v["q_lora_rank"], "kv_lora_rank": v["kv_lora_rank"], "qk_rope_head_dim": P,
             "qk_nope_head_dim": N, "v_head_dim": V, "use_lora_layer_norm": v["use_lora_layer_norm"],
             "use_fixed_rank_for_first_and_last_block": True, "attention_bias": v["attention_bias"],
             "rope_scaling": v["rope_scaling"], "model_type": "deepseek_v3", "transformers_version": "4.43.1",
             "layer_rank_list": {str(i): {"q_rank": q, "kv_rank": kv} for i, (q, kv) in v["ranks"].items()}}
    return base, mla, layer


def _tensors(v: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    def norm_w(n):
        return 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)

    t = {"model.embed_tokens.weight": rnd(VOCAB, D, scale=1.0), "model.norm.weight": norm_w(D)}
    if not v["tie"]:
        t["lm_head.weight"] = rnd(VOCAB, D)
    for i, (q, kv) in _layer_ranks(v).items():
        pre, m = f"model.layers.{i}", f"model.layers.{i}.mla"
        t[f"{pre}.input_layernorm.weight"] = norm_w(D)
        t[f"{pre}.post_attention_layernorm.weight"] = norm_w(D)
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{pre}.mlp.{name}.weight"] = rnd(*shape)
        t[f"{m}.q_a_proj.weight"] = rnd(q, D)
        t[f"{m}.q_b_proj.weight"] = rnd(H * (N + P), q)
        t[f"{m}.kv_a_proj_with_mqa.weight"] = rnd(kv + P, D)
        t[f"{m}.kv_b_proj.weight"] = rnd(H * (N + V), kv, scale=0.5)
        t[f"{m}.out_proj.weight"] = rnd(D, H * V)
        if v["use_lora_layer_norm"]:
            t[f"{m}.q_a_layernorm.weight"] = norm_w(q)
            t[f"{m}.kv_a_layernorm.weight"] = norm_w(kv)
        if v["attention_bias"]:
            t[f"{m}.q_a_proj.bias"] = rnd(q)
            t[f"{m}.kv_a_proj_with_mqa.bias"] = rnd(kv + P)
            t[f"{m}.out_proj.bias"] = rnd(D)
    return t


def write_xecomla(path: Path, v: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    base, mla, layer = their_files(v)
    (path / "config.json").write_text(json.dumps(base))
    (path / "MLA_config.json").write_text(json.dumps(mla, indent=4))
    (path / "mla_layer_config.json").write_text(json.dumps(layer, indent=2))
    tensors = _tensors(v, seed)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def their_logits(t: dict[str, torch.Tensor], v_or_files, ids: torch.Tensor) -> torch.Tensor:
    """Their model's logits: LlamaForCausalLM around X-EcoMLA MLA layers, each with its own ranks."""
    base, mla, layer = v_or_files if isinstance(v_or_files, tuple) else their_files(v_or_files)
    layer = {**DEEPSEEK_V3_DEFAULTS, **layer}
    pos = torch.arange(ids.shape[1])
    x = t["model.embed_tokens.weight"][ids]
    listed = layer["layer_rank_list"]
    q, kv = layer["q_lora_rank"], layer["kv_lora_rank"]
    for i in range(mla["n_layer"]):
        q, kv = (listed[str(i)]["q_rank"], listed[str(i)]["kv_rank"]) if str(i) in listed else (q, kv)
        pre = f"model.layers.{i}"
        c = {**layer, "q_lora_rank": q, "kv_lora_rank": kv, "use_full_kv_head": True, "num_key_value_heads": H,
             "rms_norm_eps": mla["rms_norm_eps"]}
        x = x + their_mla(rms(x, t[f"{pre}.input_layernorm.weight"], mla["rms_norm_eps"]), t, pre, c, pos)
        h = rms(x, t[f"{pre}.post_attention_layernorm.weight"], mla["rms_norm_eps"])
        gate, up = h @ t[f"{pre}.mlp.gate_proj.weight"].T, h @ t[f"{pre}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[f"{pre}.mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"], base["rms_norm_eps"])
    head = t["model.embed_tokens.weight"] if base["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T
