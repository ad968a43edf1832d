"""X-EcoMLA checkpoints (AMD's Hybrid-Models code, `X-EcoMLA/mla/hybrid_wrapper.py`): import, export, strictness.

The checkpoints their code writes and the reference forward of their model are in tests/helpers/xecomla.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylo.io import load_hylo
from hylo.jobs import convert
from hylo.released import ReleasedLayoutError
from hylo.released.reading import their_rope_scaling
from hylo.released_facts import DEEPSEEK_V3_DEFAULTS, MLA_CONFIG_FIELDS
from hylo.released_xecomla import export_xecomla, is_xecomla_layout

from tests.helpers.released import rel, tiny_llama
from tests.helpers.xecomla import (
    LAYERS,
    PER_LAYER,
    VARIANTS,
    VOCAB,
    N,
    P,
    their_files,
    their_logits,
    variant,
    write_xecomla,
)

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
    import hylo.released.importing as released

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
    base, mla, layer = their_files(v)
    mla_back = json.loads((tmp_path / "back" / "MLA_config.json").read_text())
    assert list(mla_back) == list(MLA_CONFIG_FIELDS) and {**mla_back, "vocab_size": None} == mla
    layer_back = json.loads((tmp_path / "back" / "mla_layer_config.json").read_text())
    # what their loader reads from it (the same DeepseekV3Config fields, the same ranks for every layer)
    keys = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "use_lora_layer_norm", "attention_bias", "rope_theta", "max_position_embeddings",
            "layer_rank_list")
    assert {k: layer_back[k] for k in keys} == {k: layer[k] for k in keys}
    # rope_scaling as their rotary embedding reads it (its defaults filled in: beta 32 / 1, window 4096)
    assert their_rope_scaling(layer_back["rope_scaling"], "") == their_rope_scaling(layer["rope_scaling"], "")
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


    model = upcycle(tiny_llama(), mla_layers="all", kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1,
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


    hybrid = upcycle(tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1)
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
