"""AMD's released checkpoint layout (their Hybrid-Models code), written and run from their code's math: a
checkpoint in *their* layout (`write_released`, the `VARIANTS` and `IMPORT_ONLY` layouts) and a plain-torch
forward of it (`their_logits`): `mla.*` / `out_proj` names, `kv_b_proj` rows per KV head repeated to the query
heads (`repeat_kv`) or per query head (`use_full_kv_head`), RoPE on interleaved pairs (2i, 2i+1) with
DeepSeek's YaRN, latent RMSNorms with eps 1e-6. For tests/model/test_released.py and the X-EcoMLA and
model-file tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from hylo.config import HybridConfig
from hylo.layers.gdn import GatedDeltaNet

D, F, VOCAB, H, G, N, P, V, R = 32, 48, 61, 4, 2, 6, 8, 8, 16
GDN_H, GDN_K, GDN_V, CONV = 2, 8, 16, 4
# AMD's Mamba-2 from this base (their training script): heads = ngroups = H, d_state = head_dim, d_xb = G * head_dim
M2_STATE = D // H
M2_INNER, M2_XB = H * M2_STATE, G * M2_STATE
MLA_LAYERS = [0, 2]


def variant(**kw) -> dict:
    """A released layout: Zebra-Llama's usual MLA settings (q_lora, no latent norms, kv_b per KV head, an
    untied head), a Llama base and GDN layers, unless `kw` says otherwise. `q_lora_rank=D` with
    `q_identity` is our export of whole queries (q_a_proj = the identity); `legacy` writes the fields their
    HybridConfig had before commit c33ccff; `qk_key` writes our `use_qk_norm` beside q/k norm tensors."""
    v = dict(q_lora_rank=16, q_identity=False, use_lora_layer_norm=False, use_full_kv_head=False,
             attention_bias=False, rope_scaling=None, tie=False, own_head=True, base="llama", linear="gdn",
             qk_norm=False, qk_norm_part="mla", qk_key=True, repeat_before_conv=False, rope_theta=500.0,
             max_positions=64, legacy=False)
    v.update(kw)
    return v


VARIANTS = {
    "qlora-perkv": variant(),
    # latent norms, DeepSeek YaRN with mscale, biases, tied embeddings (the head stored as their copy)
    "norms-yarn-bias": variant(use_lora_layer_norm=True, attention_bias=True, tie=True, own_head=False,
                               rope_scaling={"factor": 4.0, "original_max_position_embeddings": 8,
                                             "rope_type": "yarn", "mscale": 0.9, "mscale_all_dim": 1.0}),
    # whole queries as our export writes them (q_a_proj = identity) and one kv_b block per query head
    "qidentity-fullkv": variant(q_lora_rank=D, q_identity=True, use_full_kv_head=True,
                                rope_scaling={"factor": 2.0, "original_max_position_embeddings": 12,
                                              "rope_type": "yarn"}),
    # the released Llama models: config.json (the base's) ties the head, the checkpoint holds a trained one
    "llama-gdn-untied-under-tie": variant(tie=True),
    # the released Qwen GDN models: q/k RMSNorm per MLA head, Qwen3's eps, the card's YaRN factor 1
    "qwen-gdn-qknorm": variant(base="qwen3", qk_norm=True, tie=True,
                               rope_scaling={"factor": 1.0, "original_max_position_embeddings": 64, "rope_type": "yarn"}),
    # the released Qwen Mamba-2 models (HyLo-Qwen-14MLA14M2): x / B in d_xb = G * d_state, repeated to the heads
    "qwen-mamba2": variant(base="qwen3", qk_norm=True, tie=True, linear="mamba2"),
    # Zebra-Llama: MLA + Mamba-2 on a Llama base, what AMD's public loader builds
    "llama-mamba2": variant(linear="mamba2"),
}
# read only (an export writes an equivalent layout): the conv over x / B already repeated, q/k norms under
# Qwen3's prefix or without our use_qk_norm key, the fields of older versions of their HybridConfig, and
# whole queries as q_proj with q_lora_rank null (what our exports wrote before; AMD's loader refuses it)
IMPORT_ONLY = {
    "qwen-mamba2-repeat-before-conv": variant(base="qwen3", qk_norm=True, tie=True, linear="mamba2",
                                              repeat_before_conv=True),
    "qwen-gdn-qknorm-under-self-attn": variant(base="qwen3", qk_norm=True, tie=True, qk_norm_part="self_attn",
                                               qk_key=False),
    "legacy-fields": variant(linear="mamba2", legacy=True),
    "qproj-null-fullkv": variant(q_lora_rank=None, use_full_kv_head=True,
                                 rope_scaling={"factor": 2.0, "original_max_position_embeddings": 12,
                                               "rope_type": "yarn"}),
}


def _eps(v: dict) -> float:
    return 1e-6 if v["base"] == "qwen3" else 1e-5


def their_configs(v: dict) -> tuple[dict, dict]:
    """(config.json, hybrid_config.json) as AMD's code writes them: the base's config.json copied, and
    `asdict` of their HybridConfig (every field of it at the commit the tests' facts were read at; HyLo's
    keys added for the layouts only HyLo's code builds)."""
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[v["base"]]
    base = {"architectures": [arch], "model_type": v["base"], "vocab_size": VOCAB, "hidden_size": D,
            "intermediate_size": F, "num_hidden_layers": 3, "num_attention_heads": H, "num_key_value_heads": G,
            "head_dim": D // H, "hidden_act": "silu", "rms_norm_eps": _eps(v),
            "max_position_embeddings": v["max_positions"], "rope_theta": v["rope_theta"],
            "tie_word_embeddings": v["tie"], "bos_token_id": 7, "eos_token_id": [8, 9], "pad_token_id": None,
            "torch_dtype": "bfloat16", "transformers_version": "4.48.0"}
    hyb = {"hidden_size": D, "intermediate_size": F, "hidden_act": "silu", "n_layer": 3, "mla_layers": MLA_LAYERS,
           "rms_norm_eps": _eps(v), "num_attention_heads": H, "num_key_value_heads": G, "kv_lora_rank": R,
           "q_lora_rank": v["q_lora_rank"], "use_lora_layer_norm": v["use_lora_layer_norm"],
           "use_full_kv_head": v["use_full_kv_head"], "qk_rope_head_dim": P, "v_head_dim": V, "qk_nope_head_dim": N,
           "qkv_rank_divisor": 8, "max_position_embeddings": v["max_positions"], "rope_theta": v["rope_theta"],
           "rope_scaling": v["rope_scaling"], "attention_bias": v["attention_bias"], "attention_dropout": 0.0,
           "rope_type": "yarn", "d_model": D,
           "ssm_cfg": {"expand": 1, "ngroups": H, "d_state": M2_STATE, "repeat_kv_before_conv": v["repeat_before_conv"]},
           "d_inner": M2_INNER, "d_xb": M2_XB}
    if v["legacy"]:
        hyb.update(use_fixed_rank_for_first_and_last_block=False, q_energy_ratio=None, kv_energy_ratio=None,
                   layer_rank_list={str(i): {"q_rank": v["q_lora_rank"], "kv_rank": R} for i in MLA_LAYERS})
    if v["linear"] == "gdn":
        hyb.update(linear_type="gdn", gdn_num_heads=GDN_H, gdn_head_dim=GDN_K)
    if v["qk_norm"] and v["qk_key"]:
        hyb["use_qk_norm"] = True
    return base, hyb


def _their_tensors(v: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    def norm_w(n):
        return 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)

    t = {"model.embed_tokens.weight": rnd(VOCAB, D, scale=1.0), "model.norm.weight": norm_w(D)}
    # AMD's code always stores its head (a model that ties it stores a copy of the embeddings)
    t["lm_head.weight"] = rnd(VOCAB, D) if v["own_head"] else t["model.embed_tokens.weight"].clone()
    kv_heads = H if v["use_full_kv_head"] else G
    for i in range(3):
        pre = f"model.layers.{i}"
        t[f"{pre}.input_layernorm.weight"] = norm_w(D)
        t[f"{pre}.post_attention_layernorm.weight"] = norm_w(D)
        for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
            t[f"{pre}.mlp.{name}.weight"] = rnd(*shape)
        if i in MLA_LAYERS:
            m = f"{pre}.mla"
            if v["q_identity"]:
                t[f"{m}.q_a_proj.weight"] = torch.eye(D, dtype=torch.float64)
                t[f"{m}.q_b_proj.weight"] = rnd(H * (N + P), D)
            elif v["q_lora_rank"]:
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
            if v["qk_norm"]:
                # per-head [nope | rope] weights, the rope part in their (interleaved) order
                for name in ("q_norm", "k_norm"):
                    t[f"{pre}.{v['qk_norm_part']}.{name}.weight"] = norm_w(N + P)
        elif v["linear"] == "mamba2":
            m = f"{pre}.mamba"
            conv = 3 * M2_INNER if v["repeat_before_conv"] else M2_INNER + 2 * M2_XB
            t[f"{m}.in_proj.weight"] = rnd(2 * M2_INNER + 2 * M2_XB + H, D)
            t[f"{m}.conv1d.weight"] = rnd(conv, 1, CONV, scale=0.5)
            t[f"{m}.conv1d.bias"] = rnd(conv)
            t[f"{m}.dt_bias"] = rnd(H)
            t[f"{m}.A_log"] = torch.log(torch.rand(H, generator=gen, dtype=torch.float64) * 4 + 0.5)
            t[f"{m}.D"] = 1 + rnd(H)
            t[f"{m}.norm.weight"] = norm_w(M2_INNER)
            t[f"{m}.out_proj.weight"] = rnd(D, M2_INNER)
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
    base, hyb = their_configs(v)
    (path / "config.json").write_text(json.dumps(base))
    (path / "hybrid_config.json").write_text(json.dumps(hyb, indent=4))
    tensors = {k: x.to(dtype) for k, x in _their_tensors(v, seed).items()}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


# ------------------------------------------------------------------------------------ their forward
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _get_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _their_rope(rs: dict | None, base: float, P: int):
    """DeepSeek's YaRN as AMD's layer computes it (fp32 frequencies, theta from hybrid_config.json):
    inv_freq [P/2], cos/sin magnitude."""
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


def _rotate_interleaved(x, cos, sin):
    """Rotate pairs (2i, 2i+1) of the last dim; cos/sin [T, P/2] broadcast against x [B, T, ..., P]."""
    shape = (1, cos.shape[0]) + (1,) * (x.dim() - 3) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    ev, od = x[..., 0::2], x[..., 1::2]
    return torch.stack([ev * cos - od * sin, ev * sin + od * cos], dim=-1).flatten(-2)


def _qk_norm_weights(t, pre):
    for part in ("mla", "self_attn"):
        if f"{pre}.{part}.q_norm.weight" in t:
            return t[f"{pre}.{part}.q_norm.weight"], t[f"{pre}.{part}.k_norm.weight"]
    return None


def their_mla(x, t, pre, c, pos):
    """DeepseekV3Attention of AMD's code, every shape from their HybridConfig `c`."""
    B, T, _ = x.shape
    H, N, P, V, R = (c[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                    "kv_lora_rank"))
    m, bias = f"{pre}.mla", c["attention_bias"]
    if c["q_lora_rank"]:
        cq = x @ t[f"{m}.q_a_proj.weight"].T + (t[f"{m}.q_a_proj.bias"] if bias else 0)
        if c["use_lora_layer_norm"]:
            cq = rms(cq, t[f"{m}.q_a_layernorm.weight"], 1e-6)
        q = cq @ t[f"{m}.q_b_proj.weight"].T
    else:
        q = x @ t[f"{m}.q_proj.weight"].T + (t[f"{m}.q_proj.bias"] if bias else 0)
    q = q.view(B, T, H, N + P)
    ckv = x @ t[f"{m}.kv_a_proj_with_mqa.weight"].T + (t[f"{m}.kv_a_proj_with_mqa.bias"] if bias else 0)
    lat, k_pe = ckv[..., :R], ckv[..., R:]
    if c["use_lora_layer_norm"]:
        lat = rms(lat, t[f"{m}.kv_a_layernorm.weight"], 1e-6)
    kv_heads = H if c["use_full_kv_head"] else c["num_key_value_heads"]
    kv = (lat @ t[f"{m}.kv_b_proj.weight"].T).view(B, T, kv_heads, N + V).repeat_interleave(H // kv_heads, dim=2)
    k = torch.cat([kv[..., :N], k_pe[:, :, None].expand(B, T, H, P)], dim=-1)
    val = kv[..., N:]
    norms = _qk_norm_weights(t, pre)
    if norms is not None:
        # Qwen3's per-head RMSNorm of the whole [nope | rope] query and key, before RoPE
        q, k = rms(q, norms[0], c["rms_norm_eps"]), rms(k, norms[1], c["rms_norm_eps"])
    inv, mag = _their_rope(c["rope_scaling"], c["rope_theta"], P)
    ang = pos.float()[:, None] * inv  # [T, P/2]
    cos, sin = (ang.cos() * mag).double(), (ang.sin() * mag).double()
    q = torch.cat([q[..., :N], _rotate_interleaved(q[..., N:], cos, sin)], dim=-1)
    k = torch.cat([k[..., :N], _rotate_interleaved(k[..., N:], cos, sin)], dim=-1)
    scale = (N + P) ** -0.5
    rs = c["rope_scaling"]
    if rs and rs.get("mscale_all_dim"):
        scale *= _get_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    scores = torch.einsum("bthe,bshe->bhts", q, k)
    scores = scores * scale + torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    out = torch.einsum("bhts,bshv->bthv", scores.softmax(-1), val).reshape(B, T, H * V)
    return out @ t[f"{m}.out_proj.weight"].T + (t[f"{m}.out_proj.bias"] if bias else 0)


def _their_mamba2(u, t, m, c):
    """Zebra-Llama's Mamba2 forward (their layer, recurrent form): heads = ngroups, head dim = d_state, x and B
    in d_xb / d_state groups repeated to the heads, C per head, gated RMSNorm per head with eps 1e-5."""
    B, T, _ = u.shape
    ssm = c["ssm_cfg"]
    Hm, S, inner, xb = ssm["ngroups"], ssm["d_state"], c["d_inner"], c["d_xb"]
    X, before = xb // S, ssm.get("repeat_kv_before_conv", False)
    z, xBC, dt = (u @ t[f"{m}.in_proj.weight"].T).split([inner, 2 * xb + inner, Hm], dim=-1)

    def rep(a):  # [B, T, X * S] -> [B, T, Hm, S]: group j read by heads j * Hm/X .. (their repeat_kv)
        return a.view(B, T, X, S).repeat_interleave(Hm // X, dim=2)

    if before:
        x0, b0, c0 = xBC.split([xb, xb, inner], dim=-1)
        xBC = torch.cat([rep(x0).flatten(2), rep(b0).flatten(2), c0], dim=-1)
    w, bias = t[f"{m}.conv1d.weight"], t[f"{m}.conv1d.bias"]
    xBC = torch.nn.functional.conv1d(xBC.transpose(1, 2), w, bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    xBC = torch.nn.functional.silu(xBC[..., :T].transpose(1, 2))
    if before:
        x, b, cc = (a.view(B, T, Hm, S) for a in xBC.split([inner, inner, inner], dim=-1))
    else:
        x0, b0, c0 = xBC.split([xb, xb, inner], dim=-1)
        x, b, cc = rep(x0), rep(b0), c0.view(B, T, Hm, S)
    dt = torch.nn.functional.softplus(dt + t[f"{m}.dt_bias"])
    A = -torch.exp(t[f"{m}.A_log"])
    h = torch.zeros(B, Hm, S, S, dtype=u.dtype)  # [B, heads, head dim, state]
    ys = []
    for s in range(T):
        h = torch.exp(dt[:, s, :, None, None] * A[:, None, None]) * h \
            + dt[:, s, :, None, None] * x[:, s, :, :, None] * b[:, s, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, cc[:, s]) + t[f"{m}.D"][:, None] * x[:, s])
    y = torch.stack(ys, 1) * torch.nn.functional.silu(z).view(B, T, Hm, S)
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(B, T, inner) * t[f"{m}.norm.weight"]
    return y @ t[f"{m}.out_proj.weight"].T


def _their_gdn(h, t, g, c, i):
    """The GDN tensors carry flash-linear-attention's names on both sides: run them through ours."""
    Hg, K = c["gdn_num_heads"], c["gdn_head_dim"]
    cfg = HybridConfig(vocab_size=8, hidden_size=c["hidden_size"], intermediate_size=8, n_layer=i + 1,
                       mla_layers=[], num_attention_heads=c["num_attention_heads"],
                       num_key_value_heads=c["num_key_value_heads"], gdn_num_heads=Hg, gdn_head_dim=K,
                       gdn_expand_v=c.get("gdn_expand_v", 2.0), gdn_conv_size=t[f"{g}.q_conv1d.weight"].shape[-1],
                       rms_norm_eps=c["rms_norm_eps"])
    gdn = GatedDeltaNet(cfg, i).double()
    gdn.load_state_dict({k.removeprefix(f"{g}."): w for k, w in t.items() if k.startswith(f"{g}.")}, strict=True)
    return gdn(h)


def their_logits(t: dict[str, torch.Tensor], hyb: dict, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a checkpoint in their layout, from its tensors and hybrid_config.json alone."""
    pos = pos if pos is not None else torch.arange(ids.shape[1])
    eps = hyb["rms_norm_eps"]
    x = t["model.embed_tokens.weight"][ids]
    for i in range(hyb["n_layer"]):
        pre = f"model.layers.{i}"
        h = rms(x, t[f"{pre}.input_layernorm.weight"], eps)
        if i in hyb["mla_layers"]:
            a = their_mla(h, t, pre, hyb, pos)
        elif hyb.get("linear_type", "mamba2") == "mamba2":
            # the public HybridConfig has no linear_type: its linear layers are Mamba-2
            a = _their_mamba2(h, t, f"{pre}.mamba", hyb)
        else:
            a = _their_gdn(h, t, f"{pre}.gdn", hyb, i)
        x = x + a
        h = rms(x, t[f"{pre}.post_attention_layernorm.weight"], eps)
        gate, up = h @ t[f"{pre}.mlp.gate_proj.weight"].T, h @ t[f"{pre}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[f"{pre}.mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"], eps)
    return x @ t["lm_head.weight"].T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).double().eval()
