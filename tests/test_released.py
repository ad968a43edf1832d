"""The released checkpoint layout (AMD's Hybrid-Models code): import, export, strictness.

The reference below is a plain-torch forward of a checkpoint in *their* layout, written from their
code's math: `mla.*` / `out_proj` names, `kv_b_proj` rows per KV head repeated to the query heads
(`repeat_kv`) or per query head (`use_full_kv_head`), RoPE on interleaved pairs (2i, 2i+1) with
DeepSeek's YaRN, latent RMSNorms with eps 1e-6. Importing that checkpoint must give the same logits.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylo.config import HybridConfig, HybridConfigError
from hylo.io import load_hylo, save_hylo
from hylo.layers.gdn import GatedDeltaNet
from hylo.released import ReleasedLayoutError, export_released, is_released_layout, load_released

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "jobs"))

import convert  # noqa: E402

D, F, VOCAB, H, G, N, P, V, R = 32, 48, 61, 4, 2, 6, 8, 8, 16
GDN_H, GDN_K, GDN_V, CONV = 2, 8, 16, 4

VARIANTS = {
    # Zebra-Llama's usual settings: q_lora, no latent norms, kv_b per KV head, untied head
    "qlora-perkv": dict(q_lora_rank=16, use_lora_layer_norm=False, use_full_kv_head=False, attention_bias=False,
                        rope_scaling=None, tie=False),
    # latent norms, DeepSeek YaRN with mscale, biases, tied embeddings
    "norms-yarn-bias": dict(q_lora_rank=16, use_lora_layer_norm=True, use_full_kv_head=False, attention_bias=True,
                            rope_scaling={"factor": 4.0, "original_max_position_embeddings": 8, "rope_type": "yarn",
                                          "mscale": 0.9, "mscale_all_dim": 1.0}, tie=True),
    # uncompressed queries and one kv_b block per query head
    "qproj-fullkv": dict(q_lora_rank=None, use_lora_layer_norm=False, use_full_kv_head=True, attention_bias=False,
                         rope_scaling={"factor": 2.0, "original_max_position_embeddings": 12, "rope_type": "yarn"},
                         tie=False),
}


def _configs(v: dict) -> tuple[dict, dict]:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": D,
            "intermediate_size": F, "num_hidden_layers": 3, "num_attention_heads": H, "num_key_value_heads": G,
            "head_dim": D // H, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_theta": 500.0, "tie_word_embeddings": v["tie"],
            "bos_token_id": 7, "eos_token_id": [8, 9], "pad_token_id": None}
    hyb = {"hidden_size": D, "intermediate_size": F, "hidden_act": "silu", "n_layer": 3, "mla_layers": [0, 2],
           "rms_norm_eps": 1e-5, "num_attention_heads": H, "num_key_value_heads": G, "kv_lora_rank": R,
           "q_lora_rank": v["q_lora_rank"], "use_lora_layer_norm": v["use_lora_layer_norm"],
           "use_full_kv_head": v["use_full_kv_head"], "qk_rope_head_dim": P, "v_head_dim": V,
           "qk_nope_head_dim": N, "qkv_rank_divisor": 8, "max_position_embeddings": 64, "rope_theta": 500.0,
           "rope_scaling": v["rope_scaling"], "attention_bias": v["attention_bias"], "attention_dropout": 0.0,
           "rope_type": "yarn", "d_model": D, "ssm_cfg": {}, "d_inner": None, "d_xb": 16}
    return base, hyb


def _their_tensors(v: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    def norm_w(n):
        return 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)

    t = {"model.embed_tokens.weight": rnd(VOCAB, D, scale=1.0), "model.norm.weight": norm_w(D)}
    # AMD's code always stores its head (a model that ties it stores a copy of the embeddings)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone() if v["tie"] else rnd(VOCAB, D)
    kv_heads = H if v["use_full_kv_head"] else G
    for i in range(3):
        pre = f"model.layers.{i}"
        t[f"{pre}.input_layernorm.weight"] = norm_w(D)
        t[f"{pre}.post_attention_layernorm.weight"] = norm_w(D)
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{pre}.mlp.{name}.weight"] = rnd(*shape)
        if i in (0, 2):
            m = f"{pre}.mla"
            if v["q_lora_rank"]:
                t[f"{m}.q_a_proj.weight"] = rnd(v["q_lora_rank"], D)
                t[f"{m}.q_b_proj.weight"] = rnd(H * (N + P), v["q_lora_rank"])
                if v["use_lora_layer_norm"]:
                    t[f"{m}.q_a_layernorm.weight"] = norm_w(v["q_lora_rank"])
                if v["attention_bias"]:
                    t[f"{m}.q_a_proj.bias"] = rnd(v["q_lora_rank"])
            else:
                t[f"{m}.q_proj.weight"] = rnd(H * (N + P), D)
                if v["attention_bias"]:
                    t[f"{m}.q_proj.bias"] = rnd(H * (N + P))
            t[f"{m}.kv_a_proj_with_mqa.weight"] = rnd(R + P, D)
            if v["attention_bias"]:
                t[f"{m}.kv_a_proj_with_mqa.bias"] = rnd(R + P)
                t[f"{m}.out_proj.bias"] = rnd(D)
            if v["use_lora_layer_norm"]:
                t[f"{m}.kv_a_layernorm.weight"] = norm_w(R)
            t[f"{m}.kv_b_proj.weight"] = rnd(kv_heads * (N + V), R, scale=0.5)
            t[f"{m}.out_proj.weight"] = rnd(D, H * V)
        else:
            g = f"{pre}.gdn"
            for name, rows in (("q_proj", GDN_H * GDN_K), ("k_proj", GDN_H * GDN_K), ("v_proj", GDN_H * GDN_V),
                               ("g_proj", GDN_H * GDN_V)):
                t[f"{g}.{name}.weight"] = rnd(rows, D)
            t[f"{g}.a_proj.weight"] = rnd(GDN_H, D)
            t[f"{g}.b_proj.weight"] = rnd(GDN_H, D)
            t[f"{g}.A_log"] = torch.log(torch.rand(GDN_H, generator=gen, dtype=torch.float64) * 4 + 0.5)
            t[f"{g}.dt_bias"] = rnd(GDN_H)
            for name, ch in (("q_conv1d", GDN_H * GDN_K), ("k_conv1d", GDN_H * GDN_K), ("v_conv1d", GDN_H * GDN_V)):
                t[f"{g}.{name}.weight"] = rnd(ch, 1, CONV, scale=0.5)
            t[f"{g}.o_norm.weight"] = norm_w(GDN_V)
            t[f"{g}.o_proj.weight"] = rnd(D, GDN_H * GDN_V)
    return t


def write_released(path: Path, v: dict, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    base, hyb = _configs(v)
    (path / "config.json").write_text(json.dumps(base))
    (path / "hybrid_config.json").write_text(json.dumps(hyb, indent=4))
    tensors = {k: x.to(dtype) for k, x in _their_tensors(v, seed).items()}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


# ------------------------------------------------------------------------------------ their forward
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _get_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _their_rope(rs: dict | None, base: float = 500.0):
    """DeepSeek's YaRN as AMD's layer computes it (fp32 frequencies): inv_freq [P/2], cos/sin magnitude."""
    idx = torch.arange(0, P, 2, dtype=torch.float32)
    freq_extra = 1.0 / (base ** (idx / P))
    if rs is None:
        return freq_extra, 1.0
    f, orig = rs["factor"], rs.get("original_max_position_embeddings", 4096)
    bf, bs = rs.get("beta_fast", 32), rs.get("beta_slow", 1)
    freq_inter = 1.0 / (f * base ** (idx / P))

    def corr(rot):
        return P * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), P - 1)
    if low == high:
        high += 0.001
    mask = 1.0 - torch.clamp((torch.arange(P // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv = freq_inter * (1 - mask) + freq_extra * mask
    return inv, _get_mscale(f, rs.get("mscale", 1)) / _get_mscale(f, rs.get("mscale_all_dim", 0))


def _their_mla(x, t, m, v):
    B, T, _ = x.shape
    bias = v["attention_bias"]
    if v["q_lora_rank"]:
        cq = x @ t[f"{m}.q_a_proj.weight"].T + (t[f"{m}.q_a_proj.bias"] if bias else 0)
        if v["use_lora_layer_norm"]:
            cq = _rms(cq, t[f"{m}.q_a_layernorm.weight"], 1e-6)
        q = cq @ t[f"{m}.q_b_proj.weight"].T
    else:
        q = x @ t[f"{m}.q_proj.weight"].T + (t[f"{m}.q_proj.bias"] if bias else 0)
    q = q.view(B, T, H, N + P)
    q_nope, q_pe = q[..., :N], q[..., N:]
    ckv = x @ t[f"{m}.kv_a_proj_with_mqa.weight"].T + (t[f"{m}.kv_a_proj_with_mqa.bias"] if bias else 0)
    c, k_pe = ckv[..., :R], ckv[..., R:]
    if v["use_lora_layer_norm"]:
        c = _rms(c, t[f"{m}.kv_a_layernorm.weight"], 1e-6)
    kv_heads = H if v["use_full_kv_head"] else G
    kv = (c @ t[f"{m}.kv_b_proj.weight"].T).view(B, T, kv_heads, N + V).repeat_interleave(H // kv_heads, dim=2)
    k_nope, val = kv[..., :N], kv[..., N:]
    inv, mag = _their_rope(v["rope_scaling"])
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv  # [T, P/2]
    cos, sin = (ang.cos() * mag).double(), (ang.sin() * mag).double()

    # rotate interleaved pairs (2i, 2i+1); cos/sin broadcast over [B, T, (H,) P/2]
    cos_q, sin_q = cos[None, :, None], sin[None, :, None]
    ev, od = q_pe[..., 0::2], q_pe[..., 1::2]
    q_pe = torch.stack([ev * cos_q - od * sin_q, ev * sin_q + od * cos_q], dim=-1).flatten(-2)
    ev, od = k_pe[..., 0::2], k_pe[..., 1::2]
    k_pe = torch.stack([ev * cos[None] - od * sin[None], ev * sin[None] + od * cos[None]], dim=-1).flatten(-2)
    scale = (N + P) ** -0.5
    rs = v["rope_scaling"]
    if rs and rs.get("mscale_all_dim"):
        scale *= _get_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthp,bsp->bhts", q_pe, k_pe)
    scores = scores * scale + torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    out = torch.einsum("bhts,bshv->bthv", scores.softmax(-1), val).reshape(B, T, H * V)
    return out @ t[f"{m}.out_proj.weight"].T + (t[f"{m}.out_proj.bias"] if bias else 0)


def their_logits(t: dict[str, torch.Tensor], v: dict, ids: torch.Tensor) -> torch.Tensor:
    eps = 1e-5
    x = t["model.embed_tokens.weight"][ids]
    for i in range(3):
        pre = f"model.layers.{i}"
        h = _rms(x, t[f"{pre}.input_layernorm.weight"], eps)
        if i in (0, 2):
            a = _their_mla(h, t, f"{pre}.mla", v)
        else:
            # the GDN tensors carry flash-linear-attention's names on both sides
            cfg = HybridConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=F, n_layer=3, mla_layers=[0, 2],
                               num_attention_heads=H, num_key_value_heads=G, kv_lora_rank=R, qk_rope_head_dim=P,
                               qk_nope_head_dim=N, v_head_dim=V, gdn_num_heads=GDN_H, gdn_head_dim=GDN_K,
                               gdn_expand_v=GDN_V / GDN_K, gdn_conv_size=CONV, rms_norm_eps=eps)
            gdn = GatedDeltaNet(cfg, i).double()
            gdn.load_state_dict({k.removeprefix(f"{pre}.gdn."): w for k, w in t.items()
                                 if k.startswith(f"{pre}.gdn.")}, strict=True)
            a = gdn(h)
        x = x + a
        h = _rms(x, t[f"{pre}.post_attention_layernorm.weight"], eps)
        gate, up = h @ t[f"{pre}.mlp.gate_proj.weight"].T, h @ t[f"{pre}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[f"{pre}.mlp.down_proj.weight"].T
    x = _rms(x, t["model.norm.weight"], eps)
    return x @ t["lm_head.weight"].T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------ import
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_gives_the_released_models_outputs(tmp_path, variant):
    v = VARIANTS[variant]
    tensors = write_released(tmp_path / "rel", v)
    assert is_released_layout(tmp_path / "rel")
    model = load_hylo(tmp_path / "rel", dtype=torch.float64)
    cfg = model.config
    # vocabulary and special tokens come from the base config.json, not from HyLo's defaults
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (VOCAB, 7, [8, 9])
    assert cfg.kv_b_per_kv_head == (not v["use_full_kv_head"]) and cfg.rope_key_groups == 1
    assert (cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_dim, cfg.gdn_conv_size) == (GDN_H, GDN_K, GDN_V, CONV)
    with torch.no_grad():
        ours = model(IDS).logits
        ref = their_logits(tensors, v, IDS)
    # fp64 throughout except the RoPE angles, fp32 on both sides as in both codes (measured: ~1e-15)
    assert rel(ours, ref) < 1e-9, rel(ours, ref)


def test_a_layout_mistake_is_visible_to_the_reference(tmp_path):
    """Guard for the test above: importing without the RoPE permutation is far off."""
    import hylo.released as released

    v = VARIANTS["qlora-perkv"]
    tensors = write_released(tmp_path / "rel", v)
    orig = released.interleaved_to_half_perm
    try:
        released.interleaved_to_half_perm = lambda p: torch.arange(p)
        model = load_hylo(tmp_path / "rel", dtype=torch.float64)
    finally:
        released.interleaved_to_half_perm = orig
    with torch.no_grad():
        assert rel(model(IDS).logits, their_logits(tensors, v, IDS)) > 1e-3


# ------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_writes_back_the_same_files(tmp_path, variant):
    v = VARIANTS[variant]
    tensors = write_released(tmp_path / "rel", v)
    model = load_released(tmp_path / "rel")
    export_released(model, tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    hyb = json.loads((tmp_path / "back" / "hybrid_config.json").read_text())
    _, want = _configs(v)
    for key in ("n_layer", "mla_layers", "kv_lora_rank", "q_lora_rank", "use_lora_layer_norm", "use_full_kv_head",
                "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_theta", "attention_bias"):
        assert hyb[key] == want[key], key
    if v["rope_scaling"]:
        assert {k: hyb["rope_scaling"][k] for k in v["rope_scaling"]} == v["rope_scaling"]
    base = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (base["vocab_size"], base["eos_token_id"], base["tie_word_embeddings"]) == (VOCAB, [8, 9], v["tie"])


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).double().eval()


def test_our_conversion_round_trips_through_the_released_layout_and_the_cli(tmp_path, capsys):
    from hylo.upcycle import upcycle

    model = upcycle(_tiny_llama(), mla_layers=[0, 2], kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
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


def test_export_refuses_what_the_released_layout_cannot_hold(tmp_path):
    from hylo.upcycle import upcycle

    grouped = upcycle(_tiny_llama(), mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8)
    assert grouped.config.rope_key_groups == 2
    with pytest.raises(ReleasedLayoutError, match="rope_key_groups=2.*--rope-key-groups 1"):
        export_released(grouped, tmp_path / "x")
    from hylo.upcycle import hybrid_config_from_base

    base = _tiny_llama()
    hcfg = hybrid_config_from_base(base.config, mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8,
                                   rope_key_groups=1, linear_type="mamba2")
    hcfg.mamba2_n_groups = 2
    m2 = upcycle(base, hcfg)
    with pytest.raises(ReleasedLayoutError, match="2 groups of C for 4 heads.*one C group per head"):
        export_released(m2, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_keeps_per_query_head_rows_that_do_not_repeat(tmp_path):
    from hylo.upcycle import upcycle

    model = upcycle(_tiny_llama(), mla_layers=[0], kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1).eval()
    with torch.no_grad():
        model.model.layers[0].mixer.kv_b_proj.weight.add_(0.01 * torch.randn_like(model.model.layers[0].mixer.kv_b_proj.weight))
    export_released(model, tmp_path / "rel")
    assert json.loads((tmp_path / "rel" / "hybrid_config.json").read_text())["use_full_kv_head"] is True
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert rel(load_hylo(tmp_path / "rel", dtype=torch.float64)(ids).logits, model(ids).logits) < 1e-12


# ------------------------------------------------------------------------------------ strictness
@pytest.mark.parametrize("tamper,needle", [
    ("drop", "missing: model.layers.2.mla.kv_b_proj.weight"),
    ("extra", "model.layers.1.gdn.bogus.weight"),
    ("mamba", "d_inner=64 must equal ssm_cfg.ngroups"),
    ("shape", "model.layers.0.mixer.o_proj.weight"),
    ("pickle", "pickled weights are never loaded"),
    ("vocab", "missing vocab_size"),
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
    if tamper == "pickle":
        (d / "model.safetensors").unlink()
        (d / "pytorch_model.bin").write_bytes(b"not loaded")
    else:
        save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ReleasedLayoutError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_hylo(d)


def test_our_config_reader_refuses_amd_keys_and_incomplete_files(tmp_path):
    _, hyb = _configs(VARIANTS["qlora-perkv"])
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

    from hylo.upcycle import hybrid_config_from_base
    from pipeline.train.config import load_stage_config

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

    from pipeline.teacher.model import TeacherModel
    from pipeline.train.config import load_stage_config
    from pipeline.train.deepspeed_cfg import grad_accum_steps

    from fixtures_teacher import save_tiny_llama

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
    assert grad_accum_steps(s2.train.global_batch_sequences, s2.ray.num_workers) == 2


def test_cli_conversion_with_the_cards_options_then_export_and_generate(tmp_path, capsys):
    """Full CLI path on a tiny Llama: the released models' options, then the released layout and back."""
    _tiny_llama().float().save_pretrained(tmp_path / "base")
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
