"""X-EcoMLA checkpoints (AMD's Hybrid-Models code, `X-EcoMLA/mla/hybrid_wrapper.py`): import, export, strictness.

The files below are what their code writes (read at the commit of hylo/released_facts.py): the base Llama's
config.json, `asdict` of their MLAConfig without `deepseek_cfg` as MLA_config.json, their layer config
(every DeepseekV3Config key, `layer_rank_list` with each MLA layer's ranks) as mla_layer_config.json, and
safetensors with each layer's mixer under `mla.`; kv_b_proj has one block per query head and the head is
tied when config.json says so (their loader builds a LlamaForCausalLM). The reference forward is
test_released's plain-torch reading of their MLA layer (interleaved RoPE, DeepSeek's YaRN), layer by layer
with that layer's ranks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylo.io import load_hylo
from hylo.jobs import convert
from hylo.released import ReleasedLayoutError, _their_rope_scaling
from hylo.released_facts import DEEPSEEK_V3_DEFAULTS, MLA_CONFIG_FIELDS
from hylo.released_xecomla import export_xecomla, is_xecomla_layout

from test_released import _rms, _their_mla, rel

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


def _files(v: dict) -> tuple[dict, dict, dict]:
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
    base, mla, layer = _files(v)
    (path / "config.json").write_text(json.dumps(base))
    (path / "MLA_config.json").write_text(json.dumps(mla, indent=4))
    (path / "mla_layer_config.json").write_text(json.dumps(layer, indent=2))
    tensors = _tensors(v, seed)
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def their_logits(t: dict[str, torch.Tensor], v_or_files, ids: torch.Tensor) -> torch.Tensor:
    """Their model's logits: LlamaForCausalLM around X-EcoMLA MLA layers, each with its own ranks."""
    base, mla, layer = v_or_files if isinstance(v_or_files, tuple) else _files(v_or_files)
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
        x = x + _their_mla(_rms(x, t[f"{pre}.input_layernorm.weight"], mla["rms_norm_eps"]), t, pre, c, pos)
        h = _rms(x, t[f"{pre}.post_attention_layernorm.weight"], mla["rms_norm_eps"])
        gate, up = h @ t[f"{pre}.mlp.gate_proj.weight"].T, h @ t[f"{pre}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[f"{pre}.mlp.down_proj.weight"].T
    x = _rms(x, t["model.norm.weight"], base["rms_norm_eps"])
    head = t["model.embed_tokens.weight"] if base["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", [*VARIANTS, *PER_LAYER])
def test_import_gives_their_models_outputs(tmp_path, name):
    v = {**VARIANTS, **PER_LAYER}[name]
    tensors = write_xecomla(tmp_path / "x", v)
    assert is_xecomla_layout(tmp_path / "x")
    if name in PER_LAYER:
        kv = 24 if name == "energy-ranks" else 16
        with pytest.warns(UserWarning, match=rf"MLA ranks differ per layer .* zero-padded to q 24, kv {kv}"):
            model = load_hylo(tmp_path / "x", dtype=torch.float64)
    else:
        model = load_hylo(tmp_path / "x", dtype=torch.float64)
    cfg = model.config
    assert cfg.mla_layers == [0, 1, 2] and not cfg.kv_b_per_kv_head and cfg.tie_word_embeddings == v["tie"]
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (VOCAB, 7, 8)
    with torch.no_grad():
        assert rel(model(IDS).logits, their_logits(tensors, v, IDS)) < 1e-9


def test_a_layout_mistake_is_visible_to_the_reference(tmp_path):
    """Guard for the tests above: importing without the RoPE row permutation is far off the reference."""
    import hylo.released as released

    v = VARIANTS["fixed-ranks"]
    tensors = write_xecomla(tmp_path / "x", v)
    orig = released.interleaved_to_half_perm
    try:
        released.interleaved_to_half_perm = lambda p: torch.arange(p)
        model = load_hylo(tmp_path / "x", dtype=torch.float64)
    finally:
        released.interleaved_to_half_perm = orig
    with torch.no_grad():
        assert rel(model(IDS).logits, their_logits(tensors, v, IDS)) > 1e-3


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_writes_back_the_same_files(tmp_path, name):
    v = VARIANTS[name]
    tensors = write_xecomla(tmp_path / "x", v)
    model = load_hylo(tmp_path / "x", dtype=torch.float64)
    export_xecomla(model, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    assert [k for k in tensors if not torch.equal(back[k], tensors[k])] == []
    base, mla, layer = _files(v)
    mla_back = json.loads((tmp_path / "back" / "MLA_config.json").read_text())
    assert list(mla_back) == list(MLA_CONFIG_FIELDS) and {**mla_back, "vocab_size": None} == mla
    layer_back = json.loads((tmp_path / "back" / "mla_layer_config.json").read_text())
    # what their loader reads from it (the same DeepseekV3Config fields, the same ranks for every layer)
    keys = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "use_lora_layer_norm", "attention_bias", "rope_theta", "max_position_embeddings",
            "layer_rank_list")
    assert {k: layer_back[k] for k in keys} == {k: layer[k] for k in keys}
    # rope_scaling as their rotary embedding reads it (its defaults filled in: beta 32 / 1, window 4096)
    assert _their_rope_scaling(layer_back["rope_scaling"], "") == _their_rope_scaling(layer["rope_scaling"], "")
    assert (layer_back["rope_scaling"] or {}).get("type") == (layer["rope_scaling"] or {}).get("type")
    assert set(layer_back) == set(DEEPSEEK_V3_DEFAULTS) | {"model_type"}
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is v["tie"]
    with torch.no_grad():
        assert rel(load_hylo(tmp_path / "back", dtype=torch.float64)(IDS).logits, model(IDS).logits) < 1e-12


def test_per_layer_ranks_export_padded_and_exact(tmp_path):
    v = PER_LAYER["energy-ranks"]
    tensors = write_xecomla(tmp_path / "x", v)
    with pytest.warns(UserWarning, match="zero-padded"):
        model = load_hylo(tmp_path / "x", dtype=torch.float64)
    export_xecomla(model, tmp_path / "back")
    layer = json.loads((tmp_path / "back" / "mla_layer_config.json").read_text())
    assert layer["layer_rank_list"] == {str(i): {"q_rank": 24, "kv_rank": 24} for i in range(LAYERS)}
    back = load_file(tmp_path / "back" / "model.safetensors")
    files = (json.loads((tmp_path / "back" / "config.json").read_text()),
             json.loads((tmp_path / "back" / "MLA_config.json").read_text()), layer)
    with torch.no_grad():
        assert rel(their_logits(back, files, IDS), their_logits(tensors, v, IDS)) < 1e-12


def test_our_conversion_exports_to_x_ecomla_and_back_through_the_cli(tmp_path, capsys):
    from hylo.io import save_hylo
    from hylo.released_xecomla import check_xecomla_dir
    from hylo.upcycle import upcycle

    from test_released import _tiny_llama

    model = upcycle(_tiny_llama(), mla_layers="all", kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1,
                    tie_word_embeddings=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_hylo(model, tmp_path / "ours")
    assert convert.main(["--to-released", str(tmp_path / "ours"), "--out", str(tmp_path / "x"),
                         "--released-layout", "x-ecomla"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rfind("\n{") + 1:])
    assert summary["layout"] == "x-ecomla" and summary["amd_public_loader"].startswith("loads it")
    check_xecomla_dir(tmp_path / "x")
    d = tmp_path / "x"
    files = (json.loads((d / "config.json").read_text()), json.loads((d / "MLA_config.json").read_text()),
             json.loads((d / "mla_layer_config.json").read_text()))
    # whole queries behind an identity q_a_proj, kv_b_proj per query head
    t = load_file(d / "model.safetensors")
    assert torch.equal(t["model.layers.0.mla.q_a_proj.weight"], torch.eye(64, dtype=torch.float64))
    assert t["model.layers.0.mla.kv_b_proj.weight"].shape == (4 * (8 + 16), 32)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids).logits
        assert rel(their_logits(t, files, ids), ours) < 1e-9
    assert convert.main(["--from-released", str(d), "--out", str(tmp_path / "again")]) == 0
    capsys.readouterr()
    again = load_hylo(tmp_path / "again", dtype=torch.float64)
    assert again.config.q_lora_rank is None
    with torch.no_grad():
        assert rel(again(ids).logits, ours) < 1e-12


def test_export_refuses_what_x_ecomla_cannot_hold(tmp_path):
    from hylo.upcycle import upcycle

    from test_released import _tiny_llama

    hybrid = upcycle(_tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1)
    with pytest.raises(ReleasedLayoutError, match=r"layers \[1, 3\] are gdn layers.*Zebra-Llama layout"):
        export_xecomla(hybrid, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_the_cli_names_the_layouts_it_writes(tmp_path, capsys):
    rc = convert.main(["--to-released", str(tmp_path), "--out", str(tmp_path / "o"), "--set", "released_layout=zebra"])
    err = capsys.readouterr().err
    assert rc == 2 and "released_layout" in err and "x-ecomla" in err and "zebra-llama" in err, err


@pytest.mark.parametrize("tamper,needle", [
    ("attn-layers", "attn_layers=[1]: those layers keep the base's attention"),
    ("norms-uneven", "per-layer ranks [(8, 16), (16, 24), (24, 8)] below the largest (q 24, kv 24) with "
                     "use_lora_layer_norm"),
    ("eps", "MLA_config.json rms_norm_eps=1e-06 (the decoder norms) but config.json rms_norm_eps=1e-05"),
    ("q-null", "X-EcoMLA's loader (AMD-AGI/AMD-Hybrid-Models@61c93485 (2026-05-14)) would refuse it: TypeError"),
    ("drop", "missing: model.layers.2.mla.kv_b_proj.weight"),
    ("extra", "unexpected: model.layers.1.mla.bogus.weight"),
    ("tied-head", "lm_head.weight differs from model.embed_tokens.weight"),
    ("bad-entry", "layer_rank_list['1'] = [8, 8]: expected {'q_rank': int, 'kv_rank': int}"),
])
def test_x_ecomla_import_is_strict(tmp_path, tamper, needle):
    v = variant(use_lora_layer_norm=True, ranks={0: (8, 16), 1: (24, 8), 2: (16, 24)}) if tamper == "norms-uneven" \
        else variant(tie=tamper == "tied-head")
    d = tmp_path / "x"
    tensors = write_xecomla(d, v)
    mla = json.loads((d / "MLA_config.json").read_text())
    layer = json.loads((d / "mla_layer_config.json").read_text())
    if tamper == "attn-layers":
        mla["attn_layers"] = [1]
    elif tamper == "eps":
        mla["rms_norm_eps"] = 1e-6
    elif tamper == "q-null":
        layer["q_lora_rank"] = None
    elif tamper == "drop":
        del tensors["model.layers.2.mla.kv_b_proj.weight"]
    elif tamper == "extra":
        tensors["model.layers.1.mla.bogus.weight"] = torch.zeros(2)
    elif tamper == "tied-head":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    elif tamper == "bad-entry":
        layer["layer_rank_list"]["1"] = [8, 8]
    (d / "MLA_config.json").write_text(json.dumps(mla))
    (d / "mla_layer_config.json").write_text(json.dumps(layer))
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ReleasedLayoutError, match=re.escape(needle)):
        load_hylo(d)


@pytest.mark.parametrize("tamper,needle", [
    ("extra", "dropped by their loader (no such module): model.layers.0.mla.q_norm.weight"),
    ("no-head", "left at their random init (not in the file): lm_head.weight"),
    ("rank", "shape mismatch: model.layers.1.mla.kv_b_proj.weight: file (56, 16), their module (56, 8)"),
    ("mla-key", "TypeError: MLAConfig.__init__() got an unexpected keyword argument 'mla_layers'"),
])
def test_check_xecomla_dir_reads_it_back_as_their_loader_would(tmp_path, tamper, needle):
    from hylo.released_xecomla import check_xecomla_dir

    d = tmp_path / "x"
    tensors = write_xecomla(d, VARIANTS["fixed-ranks"])
    check_xecomla_dir(d)
    mla = json.loads((d / "MLA_config.json").read_text())
    layer = json.loads((d / "mla_layer_config.json").read_text())
    if tamper == "extra":
        tensors["model.layers.0.mla.q_norm.weight"] = torch.ones(N + P)
    elif tamper == "no-head":
        del tensors["lm_head.weight"]
    elif tamper == "rank":
        layer["layer_rank_list"]["1"] = {"q_rank": 16, "kv_rank": 8}
    elif tamper == "mla-key":
        mla["mla_layers"] = [0, 1, 2]
    (d / "MLA_config.json").write_text(json.dumps(mla))
    (d / "mla_layer_config.json").write_text(json.dumps(layer))
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ReleasedLayoutError, match=re.escape(needle)):
        check_xecomla_dir(d)


# {name: shape} of layer 0 of the module tree X-EcoMLA's from_pretrained built at commit 61c93485 (a Llama base:
# hidden 64, 4 heads of 16, vocabulary 128, 4 layers, all MLA; q / kv rank 32, rope 8, nope 8, v 16), printed
# by bench/amd_compat.py's worker from their real code; the top level: embeddings, final norm, an untied head
THEIR_LAYER_AT_61C93485 = {
    "mla.q_a_proj.weight": (32, 64), "mla.q_b_proj.weight": (64, 32), "mla.kv_a_proj_with_mqa.weight": (40, 64),
    "mla.kv_b_proj.weight": (96, 32), "mla.out_proj.weight": (64, 64), "mlp.gate_proj.weight": (128, 64),
    "mlp.up_proj.weight": (128, 64), "mlp.down_proj.weight": (64, 128), "input_layernorm.weight": (64,),
    "post_attention_layernorm.weight": (64,),
}


def test_our_read_back_builds_the_module_tree_their_loader_built_at_the_pinned_commit():
    from hylo.released_xecomla import xecomla_expected_tensors

    base = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4, "tie_word_embeddings": False}
    mla = {**MLA_CONFIG_FIELDS, "d_model": 64, "intermediate_size": 128, "n_layer": 4}
    layer = {"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
             "qk_nope_head_dim": 8, "v_head_dim": 16,
             "layer_rank_list": {str(i): {"q_rank": 32, "kv_rank": 32} for i in range(4)}}
    ours = xecomla_expected_tensors(base, mla, layer)
    assert len(ours) == 43
    assert {k.removeprefix("model.layers.0."): v for k, v in ours.items()
            if k.startswith("model.layers.0.")} == THEIR_LAYER_AT_61C93485
    assert {k: v for k, v in ours.items() if "layers" not in k} == {
        "model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64)}
