"""The released checkpoint layout (AMD's Hybrid-Models code): import, export, strictness.

The reference (tests/helpers/released.py) is a plain-torch forward of a checkpoint in *their* layout, written
from their code's math: `mla.*` / `out_proj` names, `kv_b_proj` rows per KV head repeated to the query heads
(`repeat_kv`) or per query head (`use_full_kv_head`), RoPE on interleaved pairs (2i, 2i+1) with
DeepSeek's YaRN, latent RMSNorms with eps 1e-6. Importing that checkpoint must give the same logits.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylo.config import HybridConfig, HybridConfigError
from hylo.io import load_hylo, save_hylo
from hylo.jobs import convert
from hylo.released import ReleasedLayoutError, export_released, is_released_layout, load_released

from tests.helpers.released import (
    CONV,
    GDN_H,
    GDN_K,
    GDN_V,
    IMPORT_ONLY,
    M2_STATE,
    MLA_LAYERS,
    VARIANTS,
    VOCAB,
    G,
    H,
    N,
    rel,
    their_configs,
    their_logits,
    tiny_llama,
    variant,
    write_released,
)

ROOT = Path(__file__).resolve().parents[2]

IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------ import
def _load_noting(path: Path):
    """load_hylo(path) in fp64 and the warnings it gave."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_hylo(path, dtype=torch.float64)
    return model, [str(w.message) for w in caught]


@pytest.mark.parametrize("variant", [*VARIANTS, *IMPORT_ONLY])
def test_import_gives_the_released_models_outputs(tmp_path, variant):
    v = {**VARIANTS, **IMPORT_ONLY}[variant]
    tensors = write_released(tmp_path / "rel", v)
    assert is_released_layout(tmp_path / "rel")
    model, notes = _load_noting(tmp_path / "rel")
    cfg = model.config
    # vocabulary and special tokens come from the base config.json, not from HyLo's defaults
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (VOCAB, 7, [8, 9])
    assert cfg.kv_b_per_kv_head == (not v["use_full_kv_head"]) and cfg.rope_key_groups == 1
    if v["linear"] == "gdn":
        assert (cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_dim, cfg.gdn_conv_size) == (GDN_H, GDN_K, GDN_V, CONV)
    else:
        # heads = ngroups, head dim = state = d_state, C per head, x / B in d_xb / d_state groups
        assert cfg.linear_type == "mamba2" and cfg.mamba2_dims == (H, M2_STATE, M2_STATE, H)
        assert cfg.mamba2_xb_groups == (None if v["repeat_before_conv"] else G) and cfg.mamba2_norm_eps == 1e-5
    # the head as their code uses it: a stored head that differs from the embeddings is a head of its own
    assert cfg.tie_word_embeddings == (v["tie"] and not v["own_head"])
    assert cfg.mla_qk_norm == v["qk_norm"]
    # one notice line for each thing the import had to infer
    untied = [n for n in notes if "imported as an untied LM head" in n]
    assert len(untied) == (1 if v["tie"] and v["own_head"] else 0), notes
    # q/k norms found without our use_qk_norm key (AMD's own HyLo-Qwen files) are named once
    qk = [n for n in notes if "q/k RMSNorm" in n]
    assert len(qk) == (v["qk_norm"] and not v["qk_key"]), notes
    assert not qk or f"{v['qk_norm_part']}.q_norm.weight" in qk[0], notes
    ids = IDS[:, :12] if v["linear"] == "mamba2" else IDS
    with torch.no_grad():
        ours = model(ids).logits
        ref = their_logits(tensors, their_configs(v)[1], ids)
    # fp64 throughout except the RoPE angles, fp32 on both sides as in both codes (measured: ~1e-15)
    assert rel(ours, ref) < 1e-9, rel(ours, ref)


def test_a_layout_mistake_is_visible_to_the_reference(tmp_path):
    """Guard for the test above: importing without the RoPE permutation is far off."""
    import hylo.released.importing as released

    v = VARIANTS["qwen-gdn-qknorm"]
    tensors = write_released(tmp_path / "rel", v)
    orig = released.interleaved_to_half_perm
    try:
        released.interleaved_to_half_perm = lambda p: torch.arange(p)
        model = load_hylo(tmp_path / "rel", dtype=torch.float64)
    finally:
        released.interleaved_to_half_perm = orig
    with torch.no_grad():
        assert rel(model(IDS).logits, their_logits(tensors, their_configs(v)[1], IDS)) > 1e-3
    # and so is a q/k norm whose rope part is not permuted with the rows
    model = load_hylo(tmp_path / "rel", dtype=torch.float64)
    with torch.no_grad():
        for i in MLA_LAYERS:
            w = model.model.layers[i].mixer.q_norm.weight
            w[N:] = w[N:].flip(0)
        assert rel(model(IDS).logits, their_logits(tensors, their_configs(v)[1], IDS)) > 1e-3


def test_rope_positions_far_apart_match_their_code_both_ways(tmp_path):
    """AMD's MLA turns pair i at hybrid_config.json's rope_theta ** (-2i / P): a released model's theta (its
    base's, on P dims) is imported as it is, and our converter's (the base's theta ** (P / head_dim)) is
    exported as it is, so logits at positions 0 and 60,000+ agree with their code both ways."""
    from hylo.upcycle import upcycle

    pos = torch.tensor([0, *range(60_000, 60_011)])
    ids = IDS[:, :12]
    # import: a released model whose MLA uses the base's theta 500,000 on its 8 rope dims
    v = variant(rope_theta=500_000.0, max_positions=65_536)
    tensors = write_released(tmp_path / "rel", v)
    model = load_hylo(tmp_path / "rel", dtype=torch.float64)
    with torch.no_grad():
        ours = model(ids, position_ids=pos.expand(2, -1)).logits
        assert rel(ours, their_logits(tensors, their_configs(v)[1], ids, pos)) < 1e-9
    # export: our conversion of a base with theta 10,000 and head_dim 16 keeps 8 rope dims at theta 100
    conv = upcycle(tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                   rope_key_groups=1, gdn_head_dim=32, gdn_num_heads=2, gdn_expand_v=2.0,
                   max_position_embeddings=65_536, tie_word_embeddings=False).eval()
    export_released(conv, tmp_path / "out")
    hyb = json.loads((tmp_path / "out" / "hybrid_config.json").read_text())
    base = json.loads((tmp_path / "out" / "config.json").read_text())
    assert math.isclose(hyb["rope_theta"], 100.0) and math.isclose(base["rope_theta"], 10_000.0)
    files = load_file(tmp_path / "out" / "model.safetensors")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = conv(ids, position_ids=pos.expand(2, -1)).logits
        assert rel(ours, their_logits(files, hyb, ids, pos)) < 1e-9
        # guard: their code fed the base's theta (config.json's) on those dims is far off at 60,000
        assert rel(ours, their_logits(files, {**hyb, "rope_theta": base["rope_theta"]}, ids, pos)) > 1e-3


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_writes_back_the_same_files(tmp_path, variant):
    """Import, export: the same tensors (names, shapes, values) and the same two config files, key by key."""
    v = VARIANTS[variant]
    tensors = write_released(tmp_path / "rel", v)
    model = load_released(tmp_path / "rel")
    export_released(model, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    assert [k for k in tensors if back[k].shape != tensors[k].shape or not torch.equal(back[k], tensors[k])] == []
    base, hyb = their_configs(v)
    assert json.loads((tmp_path / "back" / "hybrid_config.json").read_text()) == hyb
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == base
    # and it reads back in our code too
    again = load_hylo(tmp_path / "back", dtype=torch.float64)
    ids = IDS[:, :8]
    with torch.no_grad():
        assert rel(again(ids).logits, load_hylo(tmp_path / "rel", dtype=torch.float64)(ids).logits) < 1e-12


def test_export_of_a_tied_model_stores_the_head_and_every_key_their_config_has(tmp_path):
    """Their loader always uses lm_head.weight (left at its random init when absent) and fills a missing
    hybrid_config.json key with its own default (q_lora_rank 1536, d_xb 2560, ...): every field of their
    HybridConfig is written, and no other key but HyLo's for the GDN layers their public code cannot build."""
    from hylo.released_facts import HYBRID_CONFIG_FIELDS
    from hylo.upcycle import upcycle

    model = upcycle(tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                    rope_key_groups=1, gdn_head_dim=32, gdn_num_heads=2, gdn_expand_v=2.0).eval()
    assert model.config.tie_word_embeddings
    with pytest.warns(UserWarning, match="cannot build this model's Gated DeltaNet linear layers"):
        export_released(model, tmp_path / "rel")
    files = load_file(tmp_path / "rel" / "model.safetensors")
    assert torch.equal(files["lm_head.weight"], files["model.embed_tokens.weight"])
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    assert list(hyb)[:len(HYBRID_CONFIG_FIELDS)] == list(HYBRID_CONFIG_FIELDS)
    assert list(hyb)[len(HYBRID_CONFIG_FIELDS):] == ["linear_type", "gdn_num_heads", "gdn_head_dim"]
    assert (hyb["linear_type"], hyb["gdn_num_heads"], hyb["gdn_head_dim"]) == ("gdn", 2, 32)
    assert json.loads((tmp_path / "rel" / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_mamba2_conversion_exports_as_zebra_llama_writes_it(tmp_path):
    """Our Mamba-2 with x / B per KV head (mamba2_xb_groups = KV heads): d_xb = KV heads * d_state, read back by
    their loader's module tree and by their layer's math."""
    from hylo.upcycle import hybrid_config_from_base, upcycle

    base = tiny_llama()
    hcfg = hybrid_config_from_base(base.config, mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32,
                                   qk_rope_head_dim=8, rope_key_groups=1, linear_type="mamba2",
                                   tie_word_embeddings=False)
    hcfg.mamba2_xb_groups, hcfg.mamba2_norm_eps = 2, 1e-5
    model = upcycle(base, hcfg).eval()
    with torch.no_grad():
        for i in model.config.linear_layers:
            mixer = model.model.layers[i].mixer
            mixer.conv1d.weight.normal_(0, 0.3)
            mixer.conv1d.bias.normal_(0, 0.3)
    export_released(model, tmp_path / "rel")
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    assert (hyb["d_model"], hyb["d_inner"], hyb["d_xb"]) == (64, 4 * 16, 2 * 16)
    assert hyb["ssm_cfg"] == {"expand": 1, "ngroups": 4, "d_state": 16, "repeat_kv_before_conv": False}
    files = load_file(tmp_path / "rel" / "model.safetensors")
    assert files["model.layers.1.mamba.in_proj.weight"].shape == (2 * 64 + 2 * 32 + 4, 64)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(model(ids).logits, their_logits(files, hyb, ids)) < 1e-9


@pytest.mark.parametrize("tamper,needle", [
    ("no-head", "left at their random init (not in the file): lm_head.weight"),
    ("extra", "dropped by their loader (no such module): model.layers.1.mamba.bogus.weight"),
    ("no-d_model", "shape mismatch: model.layers.1.input_layernorm.weight: file (32,), their module (2560,)"),
    ("unknown-key", "mla_qk_norm are not fields of AMD's HybridConfig"),
    ("no-q-norm", "left at their random init (not in the file): model.layers.0.mla.q_norm.weight"),
    # what their HybridConfig (at the pinned commit) refuses: a field removed in 2025, a null rank
    ("old-key", "layer_rank_list are not fields of AMD's HybridConfig"),
    ("q-null", "would refuse it: TypeError in HybridConfig.__post_init__: unsupported operand type(s) for %"),
    # without our use_qk_norm key their loader would build MLA layers without q/k norms and drop them
    ("no-qk-key", "dropped by their loader (no such module): model.layers.0.mla.k_norm.weight"),
])
def test_check_released_dir_reads_it_back_as_their_loader_would(tmp_path, tamper, needle):
    from hylo.released import check_released_dir

    d = tmp_path / "rel"
    tensors = write_released(d, VARIANTS["qwen-mamba2"])
    check_released_dir(d)
    hyb = json.loads((d / "hybrid_config.json").read_text())
    if tamper == "no-head":
        del tensors["lm_head.weight"]
    elif tamper == "extra":
        tensors["model.layers.1.mamba.bogus.weight"] = torch.zeros(2)
    elif tamper == "no-d_model":
        del hyb["d_model"]
    elif tamper == "unknown-key":
        hyb["mla_qk_norm"] = True
    elif tamper == "no-q-norm":
        del tensors["model.layers.0.mla.q_norm.weight"]
    elif tamper == "old-key":
        hyb["layer_rank_list"] = {}
    elif tamper == "q-null":
        hyb["q_lora_rank"] = None
    elif tamper == "no-qk-key":
        del hyb["use_qk_norm"]
    save_file(tensors, str(d / "model.safetensors"))
    (d / "hybrid_config.json").write_text(json.dumps(hyb))
    with pytest.raises(ReleasedLayoutError, match=re.escape(needle)):
        check_released_dir(d)


def test_our_conversion_round_trips_through_the_released_layout_and_the_cli(tmp_path, capsys):
    from hylo.upcycle import upcycle

    model = upcycle(tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                    rope_key_groups=1, gdn_head_dim=32, gdn_num_heads=2, gdn_expand_v=2.0,
                    yarn_factor=4.0, yarn_original_max_position_embeddings=64, tie_word_embeddings=False).eval()
    save_hylo(model, tmp_path / "ours")
    assert convert.main(["--to-released", str(tmp_path / "ours"), "--out", str(tmp_path / "rel")]) == 0
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    # converted rows repeat within each KV group: written per KV head (the compact layout)
    assert hyb["use_full_kv_head"] is False
    files = load_file(tmp_path / "rel" / "model.safetensors")
    assert files["model.layers.0.mla.kv_b_proj.weight"].shape == (2 * (8 + 16), 32)
    assert "model.layers.0.mla.out_proj.weight" in files and "model.layers.1.gdn.A_log" in files
    assert convert.main(["--from-released", str(tmp_path / "rel"), "--out", str(tmp_path / "again")]) == 0
    capsys.readouterr()
    again = load_hylo(tmp_path / "again", dtype=torch.float64)
    assert not is_released_layout(tmp_path / "again") and again.config.kv_b_per_kv_head
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
        assert rel(again(ids).logits, want) < 1e-12
        assert rel(load_hylo(tmp_path / "rel", dtype=torch.float64)(ids).logits, want) < 1e-12


def test_a_qwen3_conversion_exports_its_qk_norms_as_their_layout_reads_them(tmp_path):
    """Our Qwen3 conversion keeps the q/k norms (rotate-half rope part): exported under `mla.`, rope part back in
    interleaved order, their layer's math on the written files gives our logits (positions 0 and 60,000+)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo.upcycle import upcycle

    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                        max_position_embeddings=65_536)).double().eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model = upcycle(base, mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1,
                    gdn_head_dim=32, gdn_num_heads=2, gdn_expand_v=2.0, tie_word_embeddings=False).eval()
    assert model.config.mla_qk_norm
    export_released(model, tmp_path / "rel")
    files = load_file(tmp_path / "rel" / "model.safetensors")
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    assert files["model.layers.0.mla.q_norm.weight"].shape == (8 + 8,)
    pos = torch.tensor([0, *range(60_000, 60_009)])
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(ids, position_ids=pos.expand(2, -1)).logits
        assert rel(ours, their_logits(files, hyb, ids, pos)) < 1e-9


def test_export_refuses_what_the_released_layout_cannot_hold(tmp_path):
    from hylo.upcycle import upcycle

    grouped = upcycle(tiny_llama(), mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8)
    assert grouped.config.rope_key_groups == 2
    with pytest.raises(ReleasedLayoutError, match="rope_key_groups=2.*--rope-key-groups 1"):
        export_released(grouped, tmp_path / "x")
    from hylo.upcycle import hybrid_config_from_base

    base = tiny_llama()
    hcfg = hybrid_config_from_base(base.config, mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8,
                                   rope_key_groups=1, linear_type="mamba2")
    hcfg.mamba2_n_groups = 2
    m2 = upcycle(base, hcfg)
    with pytest.raises(ReleasedLayoutError, match="2 groups of C for 4 heads.*one C group per head"):
        export_released(m2, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_keeps_per_query_head_rows_that_do_not_repeat(tmp_path):
    from hylo.upcycle import upcycle

    model = upcycle(tiny_llama(), mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1).eval()
    with torch.no_grad():
        model.model.layers[0].mixer.kv_b_proj.weight.add_(0.01 * torch.randn_like(model.model.layers[0].mixer.kv_b_proj.weight))
    # their inference wrapper cannot read that layout: the export says so, and how to keep the compact one
    with pytest.warns(UserWarning, match=r"hybrid_inference wrapper .* does not .*--kv-b-per-kv-head"):
        export_released(model, tmp_path / "rel")
    assert json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())["use_full_kv_head"] is True
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert rel(load_hylo(tmp_path / "rel", dtype=torch.float64)(ids).logits, model(ids).logits) < 1e-12


# ------------------------------------------------------------------------------------ AMD's public loader
def _their_dataclass():
    """A dataclass with the fields, defaults and __post_init__ asserts recorded in hylo/released_facts.py (read
    off AMD's HybridConfig at AMD_COMMIT), built by Python's dataclass machinery as their file is: an unknown
    key is Python's own TypeError, a None rank fails in `%` as theirs does."""
    import copy
    import dataclasses

    from hylo.released_facts import HYBRID_CONFIG_ASSERTS, HYBRID_CONFIG_FIELDS

    def post_init(self):
        for message, expr in HYBRID_CONFIG_ASSERTS:
            assert eval(expr, {}, dataclasses.asdict(self)), message

    fields = [(k, Any, dataclasses.field(default_factory=lambda v=v: copy.deepcopy(v)) if isinstance(v, list | dict)
               else dataclasses.field(default=v)) for k, v in HYBRID_CONFIG_FIELDS.items()]
    return dataclasses.make_dataclass("HybridConfig", fields, namespace={"__post_init__": post_init})


def test_the_recorded_facts_are_those_of_the_pinned_commit_and_refuse_as_their_dataclass_does():
    from hylo.released_facts import (
        AMD_COMMIT,
        HYBRID_CONFIG_FIELDS,
        HYBRID_CONFIG_REMOVED,
        hybrid_config_refusal,
    )

    # read at AMD-AGI/AMD-Hybrid-Models 61c93485 (2026-05-14): 26 fields; 4 removed in c33ccff
    assert AMD_COMMIT.startswith("61c93485") and len(HYBRID_CONFIG_FIELDS) == 26
    assert set(HYBRID_CONFIG_REMOVED).isdisjoint(HYBRID_CONFIG_FIELDS)
    cls = _their_dataclass()
    cases = {"defaults": {}, "old-key": {"layer_rank_list": {}}, "hylo-key": {"linear_type": "gdn"},
             "q-null": {"q_lora_rank": None}, "kv-12": {"kv_lora_rank": 12}, "divisor-12": {"qkv_rank_divisor": 12},
             "heads": {"num_attention_heads": 6, "num_key_value_heads": 4}, "ok": {"kv_lora_rank": 64, "q_lora_rank": 32}}
    for name, kw in cases.items():
        try:
            cls(**kw)
            raised = None
        except (TypeError, AssertionError) as e:
            raised = type(e).__name__
        said = hybrid_config_refusal(kw)
        assert (said or "").split(":")[0].split(" ")[0] == (raised or ""), (name, said, raised)
    assert "layer_rank_list" in hybrid_config_refusal({"layer_rank_list": {}})
    assert "unsupported operand type(s) for %: 'NoneType' and 'int'" in hybrid_config_refusal({"q_lora_rank": None})


# {name: shape} of the module tree AMD's HybridModelWrapper.from_pretrained built, at commit 61c93485, for a
# Llama base (hidden 64, 4 heads of 16, 2 KV heads, vocabulary 128, 4 layers) and the hybrid_config.json below
# (printed by bench/amd_compat.py's worker from their real code; layers 2 and 3 repeat layers 0 and 1)
THEIR_TREE_AT_61C93485 = {
    "model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64),
    "model.layers.0.mla.q_a_proj.weight": (32, 64), "model.layers.0.mla.q_b_proj.weight": (64, 32),
    "model.layers.0.mla.kv_a_proj_with_mqa.weight": (40, 64), "model.layers.0.mla.kv_b_proj.weight": (48, 32),
    "model.layers.0.mla.out_proj.weight": (64, 64),
    "model.layers.1.mamba.dt_bias": (4,), "model.layers.1.mamba.A_log": (4,), "model.layers.1.mamba.D": (4,),
    "model.layers.1.mamba.in_proj.weight": (196, 64), "model.layers.1.mamba.conv1d.weight": (128, 1, 4),
    "model.layers.1.mamba.conv1d.bias": (128,), "model.layers.1.mamba.norm.weight": (64,),
    "model.layers.1.mamba.out_proj.weight": (64, 64),
    **{f"model.layers.{i}.{name}": shape for i in (0, 1) for name, shape in (
        ("mlp.gate_proj.weight", (128, 64)), ("mlp.up_proj.weight", (128, 64)), ("mlp.down_proj.weight", (64, 128)),
        ("input_layernorm.weight", (64,)), ("post_attention_layernorm.weight", (64,)))},
}
# the same, MLA layers with latent norms and q_lora_rank 48 (their layer 0)
THEIR_NORMED_MLA_AT_61C93485 = {
    "q_a_proj.weight": (48, 64), "q_a_layernorm.weight": (48,), "q_b_proj.weight": (64, 48),
    "kv_a_proj_with_mqa.weight": (40, 64), "kv_a_layernorm.weight": (32,), "kv_b_proj.weight": (48, 32),
    "out_proj.weight": (64, 64),
}


def test_our_read_back_builds_the_module_tree_their_loader_built_at_the_pinned_commit():
    from hylo.released import their_expected_tensors
    from hylo.released_facts import AMD_COMMIT

    assert AMD_COMMIT.startswith("61c93485")
    base = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    hyb = {"hidden_size": 64, "intermediate_size": 128, "n_layer": 4, "mla_layers": [0, 2], "num_attention_heads": 4,
           "num_key_value_heads": 2, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "qk_nope_head_dim": 8, "d_model": 64, "d_inner": 64, "d_xb": 32,
           "ssm_cfg": {"expand": 1, "ngroups": 4, "d_state": 16, "repeat_kv_before_conv": False}}
    ours = their_expected_tensors(base, hyb)
    assert len(ours) == 49
    assert {k: v for k, v in ours.items() if ".layers.2." not in k and ".layers.3." not in k} == THEIR_TREE_AT_61C93485
    normed = their_expected_tensors(base, {**hyb, "mla_layers": [0, 1, 2, 3], "q_lora_rank": 48,
                                           "use_lora_layer_norm": True})
    assert {k.removeprefix("model.layers.0.mla."): v for k, v in normed.items()
            if k.startswith("model.layers.0.mla.")} == THEIR_NORMED_MLA_AT_61C93485


def _tiny_qwen3(seed=0, vocab=128):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    base = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                        max_position_embeddings=4096, rms_norm_eps=1e-6)).double().eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return base


def _perturbed(model, seed=1):
    """Every weight moved a little (trained-looking: norms off 1, conv/gates off their init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


# conversions whose export AMD's public loader builds (Llama bases: MLA + Mamba-2, MLA only)
PUBLIC_EXPORTS = {
    "mla-mamba2": dict(mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, linear_type="mamba2",
                       mamba2_xb_groups=2, mamba2_norm_eps=1e-5),
    # whole queries (q_lora_rank null, our default): written behind an identity q_a_proj
    "mla-mamba2-whole-queries": dict(mla_layers=[1, 3], kv_lora_rank=24, linear_type="mamba2", mamba2_xb_groups=2,
                                     mamba2_norm_eps=1e-5),
    "mla-only": dict(mla_layers="all", kv_lora_rank=32),
    "mla-only-yarn-latent-norms": dict(mla_layers="all", kv_lora_rank=32, q_lora_rank=48, mla_latent_norm=True,
                                       mla_latent_norm_eps=1e-6, yarn_factor=4.0,
                                       yarn_original_max_position_embeddings=64),
}


@pytest.mark.parametrize("name", list(PUBLIC_EXPORTS))
def test_every_export_loads_in_their_public_loader_as_written(tmp_path, name):
    """An export loads with AMD's loader: hybrid_config.json holds exactly their fields (no extra key such as
    'use_fixed_rank_for_first_and_last_block', which their dataclass refuses with a TypeError; no null
    q_lora_rank, which fails their __post_init__), their dataclass builds from it, every tensor is one their
    module tree has, and their layers' math on the written files gives our logits."""
    import warnings as _w

    from hylo.released import check_released_dir
    from hylo.released_facts import HYBRID_CONFIG_FIELDS, hybrid_config_refusal
    from hylo.upcycle import upcycle

    model = _perturbed(upcycle(tiny_llama(), rope_key_groups=1, qk_rope_head_dim=8, tie_word_embeddings=False,
                               max_position_embeddings=256, kv_b_per_kv_head=True, **PUBLIC_EXPORTS[name]).eval())
    with _w.catch_warnings():
        _w.simplefilter("error")
        export_released(model, tmp_path / "rel")
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    assert list(hyb) == list(HYBRID_CONFIG_FIELDS)
    assert hybrid_config_refusal(hyb) is None and check_released_dir(tmp_path / "rel") is None
    _their_dataclass()(**hyb)
    files = load_file(tmp_path / "rel" / "model.safetensors")
    if model.config.q_lora_rank is None:
        assert hyb["q_lora_rank"] == 64 and torch.equal(files["model.layers.1.mla.q_a_proj.weight"],
                                                        torch.eye(64, dtype=torch.float64))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(ids).logits
        assert rel(their_logits(files, hyb, ids), ours) < 1e-9
        # and back: the identity q_a_proj is read as the whole queries it stands for
        again = load_hylo(tmp_path / "rel", dtype=torch.float64)
        assert again.config.q_lora_rank == model.config.q_lora_rank
        assert rel(again(ids).logits, ours) < 1e-12


def test_an_export_their_post_init_or_layers_would_refuse_is_refused_naming_the_flag(tmp_path, monkeypatch):
    import hylo.released_facts as facts
    from hylo.upcycle import upcycle

    def refused(match, **kw):
        m = upcycle(tiny_llama(), rope_key_groups=1, qk_rope_head_dim=8, **kw)
        with pytest.raises(ReleasedLayoutError, match=match):
            export_released(m, tmp_path / "x")
        assert not (tmp_path / "x").exists()

    # kv_lora_rank % qkv_rank_divisor != 0 (ours are multiples of 8, their divisor: had upstream's default become
    # 16, that one edit of the facts refuses a rank of 24)
    monkeypatch.setitem(facts.HYBRID_CONFIG_FIELDS, "qkv_rank_divisor", 16)
    refused(r"kv_lora_rank=24 is not a multiple of 16.*--kv-lora-rank 16 or 32", mla_layers=[0], kv_lora_rank=24,
            q_lora_rank=16)
    monkeypatch.undo()
    # whole queries behind an identity are not exact under latent norms
    refused(r"q_lora_rank is null.*latent norms.*--q-lora-rank N", mla_layers=[0], kv_lora_rank=16,
            mla_latent_norm=True, mla_latent_norm_eps=1e-6)
    # their latent norms' eps is 1e-6 (this base's 1e-5 would move every logit)
    refused(r"latent norms use eps 1e-05.*--mla-latent-norm-eps 1e-06", mla_layers=[0], kv_lora_rank=16,
            q_lora_rank=16, mla_latent_norm=True, mla_latent_norm_eps=1e-5)
    # their Mamba-2 gated norm's eps is 1e-5 whatever the base's (this one: 1e-6)
    refused(r"Mamba-2 gated norms use eps 1e-06 \(mamba2_norm_eps unset: the base rms_norm_eps\).*"
            r"--mamba2-norm-eps 1e-05", mla_layers=[0], kv_lora_rank=16, q_lora_rank=16, linear_type="mamba2",
            mamba2_xb_groups=2)


def test_a_qwen3_mamba2_export_is_exact_with_the_mamba2_norm_eps_option(tmp_path, capsys):
    """A Qwen3 base (eps 1e-6) converted to Mamba-2 cannot be exported exactly (their gated norm fixes eps
    at 1e-5: a warning only, and the export -> import round trip moved the logits): the export is refused,
    naming --mamba2-norm-eps, and a conversion with it exports exactly, from the command line too."""
    from hylo.upcycle import upcycle

    opts = dict(mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1,
                linear_type="mamba2", mamba2_xb_groups=2, tie_word_embeddings=False)
    plain = _perturbed(upcycle(_tiny_qwen3(), **opts).eval())
    with pytest.raises(ReleasedLayoutError, match=r"eps 1e-06.*--mamba2-norm-eps 1e-05"):
        export_released(plain, tmp_path / "x")
    model = _perturbed(upcycle(_tiny_qwen3(), mamba2_norm_eps=1e-5, **opts).eval())
    assert model.config.mamba2_norm_eps == 1e-5 and model.config.rms_norm_eps == 1e-6
    with pytest.warns(UserWarning, match="q/k RMSNorms"):
        export_released(model, tmp_path / "rel")
    files = load_file(tmp_path / "rel" / "model.safetensors")
    hyb = json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours = model(ids).logits
        assert rel(their_logits(files, hyb, ids), ours) < 1e-9
        assert rel(load_hylo(tmp_path / "rel", dtype=torch.float64)(ids).logits, ours) < 1e-12
        # guard: the same weights with the base's eps in the gated norm are visibly off their code
        plain.load_state_dict(model.state_dict())
        assert rel(plain(ids).logits, ours) > 1e-7
    # the command line: convert with the flag, then export
    base = tmp_path / "qwen3"
    _tiny_qwen3().float().save_pretrained(base)
    flags = ["--mla-layers", "0,2", "--kv-lora-rank", "32", "--q-lora-rank", "32", "--qk-rope-head-dim", "8",
             "--rope-key-groups", "1", "--linear-type", "mamba2", "--mamba2-xb-groups", "2", "--no-calibrate"]
    assert convert.main(["--base", str(base), "--out", str(tmp_path / "conv"), *flags]) == 0
    assert convert.main(["--to-released", str(tmp_path / "conv"), "--out", str(tmp_path / "o1")]) == 2
    assert "--mamba2-norm-eps 1e-05" in capsys.readouterr().err
    assert convert.main(["--base", str(base), "--out", str(tmp_path / "conv2"), *flags,
                         "--mamba2-norm-eps", "1e-5"]) == 0
    assert convert.main(["--to-released", str(tmp_path / "conv2"), "--out", str(tmp_path / "o2")]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rfind("\n{") + 1:])
    assert "use_qk_norm" in summary["amd_public_loader"]


def test_layouts_their_public_code_cannot_build_are_said_so_and_fail_loudly_there(tmp_path):
    """Exports that their loader would accept but read wrongly (Mamba-2 layers built in GDN slots: logits off
    by 2.7; the q/k norms dropped: off by 2.3) say so at export time, carry HyLo's keys so that their
    HybridConfig refuses them (TypeError), and without those keys our read-back fails on the tensors their
    module tree would drop."""
    from hylo.upcycle import upcycle

    gdn = upcycle(tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                  rope_key_groups=1, gdn_head_dim=32, gdn_num_heads=2).eval()
    qwen = upcycle(_tiny_qwen3(), mla_layers="all", kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1).eval()
    for name, model, key, part in (("gdn", gdn, "linear_type", "Gated DeltaNet linear layers (2 of 4)"),
                                   ("qwen", qwen, "use_qk_norm", "per-head q/k RMSNorms in the MLA layers")):
        d = tmp_path / name
        with pytest.warns(UserWarning, match=re.escape(f"cannot build this model's {part}")):
            export_released(model, d)
        from hylo.released import check_released_dir, public_loader_refusal

        refusal = public_loader_refusal(d)
        assert refusal.startswith(f"TypeError: HybridConfig.__init__() got an unexpected keyword argument '{key}'")
        assert check_released_dir(d) == refusal
        with pytest.raises(TypeError, match=key):
            _their_dataclass()(**json.loads((d / "hybrid_config.json").read_text()))
        # a loader that took the file without HyLo's keys would drop tensors: our read-back says which
        hyb = json.loads((d / "hybrid_config.json").read_text())
        (d / "hybrid_config.json").write_text(json.dumps({k: v for k, v in hyb.items()
                                                          if k not in ("linear_type", "gdn_num_heads", "gdn_head_dim",
                                                                       "use_qk_norm")}))
        dropped = "model.layers.1.gdn" if name == "gdn" else "model.layers.0.mla.k_norm.weight"
        with pytest.raises(ReleasedLayoutError, match=re.escape(f"dropped by their loader (no such module): {dropped}")):
            check_released_dir(d)


# ------------------------------------------------------------------------------------ strictness
@pytest.mark.parametrize("tamper,needle", [
    ("drop", "missing: model.layers.2.mla.kv_b_proj.weight"),
    ("extra", "model.layers.1.gdn.bogus.weight"),
    ("mamba", "linear_type='gdn' but the non-MLA layers hold `mamba.*` tensors"),
    ("shape", "model.layers.0.mixer.o_proj.weight"),
    ("pickle", "pickled weights are never loaded"),
    ("vocab", "missing vocab_size"),
    # an index out of range, negative, or not an integer is refused, naming the file and the field
    ("mla-5", "hybrid_config.json: mla_layers holds [5]: out of range for n_layer=3 (allowed 0..2)"),
    ("mla-neg", "hybrid_config.json: mla_layers holds [-1]: out of range for n_layer=3 (allowed 0..2)"),
    ("mla-str", "hybrid_config.json: mla_layers must be a list of integer layer indices, got ['0', 2]"),
    ("mla-dup", "hybrid_config.json: mla_layers has duplicates: [0, 2, 2]"),
    ("ranks", "layer_rank_list['2'] = {'q_rank': 16, 'kv_rank': 8}: per-layer MLA ranks are not supported"),
    ("ssm", "ssm_cfg.D_has_hdim=True is not supported"),
])
def test_released_import_is_strict(tmp_path, tamper, needle):
    v = VARIANTS["qlora-perkv"]
    d = tmp_path / "rel"
    tensors = write_released(d, v)
    if tamper == "drop":
        del tensors["model.layers.2.mla.kv_b_proj.weight"]
    elif tamper == "extra":
        tensors["model.layers.1.gdn.bogus.weight"] = torch.zeros(2)
    elif tamper == "mamba":
        tensors = {k.replace(".gdn.", ".mamba."): x for k, x in tensors.items()}
    elif tamper == "shape":
        tensors["model.layers.0.mla.out_proj.weight"] = tensors["model.layers.0.mla.out_proj.weight"][:, :8].clone()
    elif tamper == "vocab":
        base = json.loads((d / "config.json").read_text())
        del base["vocab_size"]
        (d / "config.json").write_text(json.dumps(base))
    hyb = json.loads((d / "hybrid_config.json").read_text())
    edits = {"mla-5": {"mla_layers": [0, 5]}, "mla-neg": {"mla_layers": [-1, 0]}, "mla-str": {"mla_layers": ["0", 2]},
             "mla-dup": {"mla_layers": [0, 2, 2]},
             "ranks": {"layer_rank_list": {"0": {"q_rank": 16, "kv_rank": 16}, "2": {"q_rank": 16, "kv_rank": 8}}},
             "ssm": {"linear_type": "mamba2", "ssm_cfg": {**hyb["ssm_cfg"], "D_has_hdim": True}}}
    if tamper == "ssm":
        tensors = {k.replace(".gdn.", ".mamba."): x for k, x in tensors.items()}
    (d / "hybrid_config.json").write_text(json.dumps({**hyb, **edits.get(tamper, {})}))
    if tamper == "pickle":
        (d / "model.safetensors").unlink()
        (d / "pytorch_model.bin").write_bytes(b"not loaded")
    else:
        save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ReleasedLayoutError, match=re.escape(needle)):
        load_hylo(d)


def test_our_config_reader_refuses_amd_keys_and_incomplete_files(tmp_path):
    _, hyb = their_configs(VARIANTS["qlora-perkv"])
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hyb))
    with pytest.raises(HybridConfigError, match="AMD's Hybrid-Models code.*--from-released"):
        HybridConfig.from_hybrid_json(tmp_path)
    (tmp_path / "hybrid_config.json").write_text(json.dumps({"model_type": "hylo", "n_layer": 2, "mla_layers": [0]}))
    with pytest.raises(HybridConfigError, match="missing key.*vocab_size"):
        HybridConfig.from_hybrid_json(tmp_path)


def test_cli_errors_for_bad_released_input(tmp_path, capsys):
    assert convert.main(["--from-released", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "ours").mkdir()
    assert convert.main(["--to-released", str(tmp_path / "ours"), "--out", str(tmp_path / "o")]) == 2
    assert "hybrid_config.json" in capsys.readouterr().err
    # an MLA index the model does not have: refused, naming the file and the field (never dropped)
    d = tmp_path / "rel"
    write_released(d, VARIANTS["qwen-mamba2"])
    hyb = json.loads((d / "hybrid_config.json").read_text())
    for bad in ([0, 5], [-1, 2], ["0", 2]):
        (d / "hybrid_config.json").write_text(json.dumps({**hyb, "mla_layers": bad}))
        assert convert.main(["--from-released", str(d), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert "hybrid_config.json: mla_layers" in err and "mixers named" not in err, err
    (d / "hybrid_config.json").write_text(json.dumps(hyb))
    with pytest.warns(UserWarning, match="imported as an untied LM head"):
        assert convert.main(["--from-released", str(d), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rindex("\n{"):] if "\n{" in out else out)
    assert (summary["linear_type"], summary["mla_qk_norm"]) == ("mamba2", True)


# ------------------------------------------------------------------------------------ the cards' models
# Public base configs (config.json of each base model on the hub), as the recipes see them.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
LLAMA_3_2_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 128000,
                "eos_token_id": [128001, 128008, 128009]}
LLAMA_3_2_3B = {**LLAMA_3_2_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                "head_dim": 128}
QWEN3_1_7B = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645}

# recipe -> (base, the card's parameter count in billions, its KV-cache fraction, the card's shapes:
# kv_lora_rank, q_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, GDN heads, GDN head dim).
# 3B: amd/HyLo-Llama-14MLA14GDN-64K-SFT (3.97B, 4.7 %; shapes from its card). 1B: the 8MLA8GDN card
# (1.61B, 7.8 %). Qwen: amd/HyLo-Qwen-7MLA21GDN-8K-SFT (2.28B, 3.9 %); the 1B's and Qwen's q_lora_rank
# (1344, as in AMD's Zebra-Llama-1B hybrid_config) is the value their counts imply (the 1B's count allows
# 1088..1392, Qwen's 1032..1368).
CARDS = {
    "llama-3.2-1b-8mla8gdn-64k": (LLAMA_3_2_1B, 1.61, 0.078, (128, 1344, 32, 32, 64, 6, 256)),
    "llama-3.2-3b-14mla14gdn-64k": (LLAMA_3_2_3B, 3.97, 0.047, (128, 1536, 64, 64, 128, 9, 256)),
    "qwen3-1.7b-7mla21gdn-64k": (QWEN3_1_7B, 2.28, 0.039, (256, 1344, 64, 64, 128, 6, 256)),
}


def _card_kv(summary: dict) -> float:
    """The cards' KV-cache fraction counts latent + roped key. A Qwen base's MLA layers keep its q/k norms
    (`mla_qk_norm`), and our absorbed decode then also caches one key 1/RMS per kv_b head and token: the
    converter counts those (summary["kv_cache_ratio"]); the card's figure is the ratio without them."""
    mla = summary["mla_values_per_token"]
    return summary["kv_cache_ratio"] * (mla - summary["qk_norm_values_per_token"]) / mla


def _recipe_hcfg(recipe: str, **override):
    import warnings

    from hylo.pipeline.train.config import load_stage_config
    from hylo.upcycle import hybrid_config_from_base

    base = CARDS[recipe][0]
    s1 = load_stage_config(1, ROOT / "configs" / f"{recipe}.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hcfg = hybrid_config_from_base(dict(base), s1.model.convert, **override)
    return hcfg, [str(w.message) for w in caught]


@pytest.mark.parametrize("recipe", list(CARDS))
def test_each_recipe_builds_exactly_the_cards_model(recipe):
    from hylo.modeling import HyLoForCausalLM
    from hylo.upcycle import kv_summary

    base, params_b, kv, shapes = CARDS[recipe]
    hcfg, _ = _recipe_hcfg(recipe)
    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e9, 2) == params_b, n
    from transformers import AutoConfig

    summary = kv_summary(AutoConfig.for_model(**base), hcfg)
    assert round(_card_kv(summary), 3) == kv
    qwen = recipe.startswith("qwen")
    # Qwen: the q/k norms are kept (2 x 128 weights per MLA layer), 8 key 1/RMS values per layer and token
    assert hcfg.mla_qk_norm == qwen and summary["qk_norm_values_per_token"] == (8 if qwen else 0)
    assert summary["mla_values_per_token"] == hcfg.kv_lora_rank + hcfg.qk_rope_head_dim + (8 if qwen else 0)
    got = (hcfg.kv_lora_rank, hcfg.q_lora_rank, hcfg.qk_rope_head_dim, hcfg.qk_nope_head_dim, hcfg.v_head_dim,
           hcfg.gdn_num_heads, hcfg.gdn_head_dim)
    assert got == shapes
    assert hcfg.num_attention_heads == base["num_attention_heads"] and hcfg.gdn_value_dim == 512
    # what the count implies: an untied LM head and kv_b_proj rows per KV head, one shared roped key
    assert not hcfg.tie_word_embeddings and hcfg.kv_b_per_kv_head and hcfg.rope_key_groups == 1
    # the cards' YaRN: factor 32 over an original window of 2,048 tokens, 65,536 usable positions
    rs = hcfg.rope_scaling
    assert (rs["rope_type"], rs["factor"], rs["original_max_position_embeddings"]) == ("yarn", 32.0, 2048)
    assert hcfg.max_position_embeddings == 65536


# The model cards: every released model's KV-cache fraction with the recipes' shapes
RELEASED_KV = [
    ("llama-3.2-1b-8mla8gdn-64k", "uniform:4", 0.039),      # HyLo-Llama 4MLA12GDN
    ("llama-3.2-1b-8mla8gdn-64k", "even", 0.078),           # 8MLA8GDN
    ("llama-3.2-3b-14mla14gdn-64k", "0,5,10,16,21,26", 0.020),  # 6MLA22GDN
    ("llama-3.2-3b-14mla14gdn-64k", "even", 0.047),         # 14MLA14GDN
    ("qwen3-1.7b-7mla21gdn-64k", "uniform:7", 0.039),       # Qwen 7MLA21GDN
    ("qwen3-1.7b-7mla21gdn-64k", "even", 0.078),            # Qwen 14MLA14GDN (and 14MLA14M2)
]


@pytest.mark.parametrize("recipe,placement,kv", RELEASED_KV, ids=["1b-4mla", "1b-8mla", "3b-6mla", "3b-14mla",
                                                                 "qwen-7mla", "qwen-14mla"])
def test_released_family_kv_fractions(recipe, placement, kv):
    from transformers import AutoConfig

    from hylo.upcycle import kv_summary

    hcfg, _ = _recipe_hcfg(recipe, mla_layers=placement)
    assert round(_card_kv(kv_summary(AutoConfig.for_model(**CARDS[recipe][0]), hcfg)), 3) == kv


def test_card_shapes_need_no_rope_key_groups_flag_and_llama3_scaling_is_not_dropped_silently():
    hcfg, warned = _recipe_hcfg("llama-3.2-3b-14mla14gdn-64k")
    assert hcfg.rope_key_groups == 1 and hcfg.qk_nope_head_dim == 64
    assert any("llama3" in w and "replaced" in w for w in warned), warned
    from hylo.upcycle import hybrid_config_from_base

    with pytest.warns(UserWarning, match="llama3.*dropped"):
        plain = hybrid_config_from_base(dict(LLAMA_3_2_1B), kv_lora_rank=128, qk_rope_head_dim=32)
    from hylo.layers.rope import rope_type_of

    assert rope_type_of(plain.rope_scaling) == "default"


def test_yarn_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_3_2_3B))
    args = ["--dry-run", "--base-config", str(path), "--kv-lora-rank", "128", "--q-lora-rank", "1536",
            "--qk-rope-head-dim", "64", "--qk-nope-head-dim", "64", "--v-head-dim", "128", "--gdn-num-heads", "9",
            "--gdn-head-dim", "256", "--gdn-expand-v", "2", "--max-position-embeddings", "65536",
            "--yarn-factor", "32", "--untie-lm-head", "--kv-b-per-kv-head"]
    with pytest.warns(UserWarning, match="llama3"):
        assert convert.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    # the card's figures: 3.97B parameters, KV cache 4.7 % (window 65,536 / 32 = 2,048)
    assert round(summary["hybrid_parameters"] / 1e9, 2) == 3.97 and round(summary["kv_cache_ratio"], 3) == 0.047
    assert summary["rope_scaling"]["original_max_position_embeddings"] == 2048
    with pytest.warns(UserWarning):
        assert convert.main(args + ["--yarn-original-max-position-embeddings", "4096"]) == 0
    assert json.loads(capsys.readouterr().out)["rope_scaling"]["original_max_position_embeddings"] == 4096


# ------------------------------------------------------------------------------------ recipes on the image
@pytest.mark.parametrize("recipe", list(CARDS))
def test_recipe_teacher_and_student_settings_load_on_the_image_package_set(tmp_path, recipe):
    import dataclasses

    from hylo.pipeline.teacher.model import TeacherModel
    from hylo.pipeline.train.config import load_stage_config

    from tests.helpers.teacher import save_tiny_llama

    path = ROOT / "configs" / f"{recipe}.yaml"
    s1, s2 = load_stage_config(1, path), load_stage_config(2, path)
    # what the cluster images install (cluster/Dockerfile.*): an attention implementation that needs a
    # package they lack (flash_attention_2 -> flash-attn) raises ImportError when the teacher loads
    images = " ".join(p.read_text() for p in (ROOT / "cluster").glob("Dockerfile.*"))
    attn = s2.teacher.model.attn_implementation
    assert attn in (None, "sdpa", "eager") or ("flash-attn" in images or "flash_attn" in images), attn
    # the teacher's settings load a model with this package set (a tiny stand-in for the 8B, on CPU)
    teacher = TeacherModel.from_config(dataclasses.replace(s2.teacher.model, path=str(save_tiny_llama(tmp_path / "t")),
                                                           device="cpu"))
    assert teacher.isolation == s2.teacher.model.isolation and teacher.dtype == torch.bfloat16
    # the student: stage 1 converts with options the converter accepts (shapes: the card test above),
    # stage 2 starts from stage 1's consolidated model
    _recipe_hcfg(recipe)
    assert s1.model.student is None and s2.model.student == f"{s1.ray.storage_path}/{s1.ray.name}/model"
    # the 64K stage runs the teacher from the Serve pool on GPUs of its own, sized in the recipe
    assert s2.teacher.source == "serve" and s2.teacher.start_pool and s2.ray.use_gpu
    assert s2.ray.num_workers + s2.teacher.pool.num_replicas * s2.teacher.pool.num_gpus == 8  # one 8-GPU node
    assert s2.teacher.pool.num_gpus == 1 and s2.teacher.pool.max_batch_tokens >= s2.data.seq_len == 65536
    assert s2.grad_accum == 2


def test_cli_conversion_with_the_cards_options_then_export_and_generate(tmp_path, capsys):
    """Full CLI path on a tiny Llama: the released models' options, then the released layout and back."""
    tiny_llama().float().save_pretrained(tmp_path / "base")
    args = ["--base", str(tmp_path / "base"), "--out", str(tmp_path / "hylo"), "--mla-layers", "0,2",
            "--kv-lora-rank", "32", "--q-lora-rank", "32", "--qk-rope-head-dim", "8", "--qk-nope-head-dim", "8",
            "--gdn-num-heads", "2", "--gdn-head-dim", "32", "--gdn-expand-v", "2", "--untie-lm-head",
            "--kv-b-per-kv-head", "--max-position-embeddings", "256", "--yarn-factor", "4",
            # the tiny base has no tokenizer, and calibration needs one
            "--no-calibrate"]
    assert convert.main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["rope_scaling"]["original_max_position_embeddings"] == 64
    model = load_hylo(tmp_path / "hylo")
    cfg = model.config
    assert (cfg.rope_key_groups, cfg.kv_b_per_kv_head, cfg.tie_word_embeddings) == (1, True, False)
    assert model.model.layers[0].mixer.kv_b_proj.weight.shape == (2 * (8 + 16), 32)
    assert convert.main(["--to-released", str(tmp_path / "hylo"), "--out", str(tmp_path / "rel")]) == 0
    back = load_hylo(tmp_path / "rel")
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert rel(back(ids).logits, model(ids).logits) < 1e-5
    # cached decoding of an imported model continues what full forwards pick
    gen = back.generate(ids, max_new_tokens=4, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(back(gen[:, :-1]).logits[:, 11:].argmax(-1), gen[:, 12:])
