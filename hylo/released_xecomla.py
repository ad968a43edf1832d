"""Import and export of X-EcoMLA checkpoints (AMD's Hybrid-Models code, `X-EcoMLA/mla/hybrid_wrapper.py`).

An X-EcoMLA directory holds:
* `config.json`: the base Llama's config, copied; their loader builds `LlamaForCausalLM(LlamaConfig(**it))`, so
  its `tie_word_embeddings` does tie the head there (unlike Zebra-Llama's loader);
* `MLA_config.json`: `asdict` of their `MLAConfig` without `deepseek_cfg` (`d_model`, `rms_norm_eps`,
  `intermediate_size`, `hidden_act`, `n_layer`, `attn_layers`: the layers kept as the base's attention);
* `mla_layer_config.json`: a DeepSeek-V3-style layer config (`DeepseekV3Config.to_json_file(use_diff=True)`;
  a missing key takes `DeepseekV3Config()`'s default on load), with `layer_rank_list`: each MLA layer's q / kv
  ranks (from the SVD of its attention, possibly chosen per layer by an energy ratio);
* safetensors: Llama's keys with each MLA layer's mixer under `mla.` (the names of the Zebra-Llama layout).

How it maps onto ours (hylo/released/ has the shared parts: names, RoPE rows, YaRN):
* `kv_b_proj` has one block per query head (their `num_kv_heads = num_heads`): ours per query head too.
* Per-layer ranks: their layer i takes `layer_rank_list[str(i)]` when listed, else the ranks the previous
  MLA layer left in the shared config (they mutate it). Ours has one rank per model: smaller latents are
  zero-padded to the largest (rows of `kv_a_proj_with_mqa` / `q_a_proj`, columns of `kv_b_proj` / `q_b_proj`),
  which is exact without latent norms (and refused with them, which would see the padding); the cache then
  holds the largest rank for every layer (a warning says so).
* The decoder norms use `MLA_config.json`'s `rms_norm_eps` and the final norm config.json's: they must agree
  (ours has one). `attn_layers` (layers kept as the base's GQA attention) have no place in a HyLo model:
  refused, naming them.
* Export: an all-MLA model only (linear layers have no place there: use the Zebra-Llama layout), whole
  queries behind an identity `q_a_proj` (their config cannot say q_lora_rank: null), the layer config's
  `rope_scaling` under their key `type`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from hylo.config import HybridConfig, HybridConfigError
from hylo.model_files import check_layer_indices, check_model_config, check_rank
from hylo.modeling import HyLoForCausalLM
from hylo.released.export import released_files, their_rope_scaling_out, write_checked_layout
from hylo.released.importing import load_checked_tensors, released_to_state_dict
from hylo.released.layout import BASE_TYPES, ReleasedLayoutError, read_layout_json, released_name
from hylo.released.readback import loader_mismatches, their_mla_shapes
from hylo.released.reading import collapse_identity_q, read_released_tensors, their_rope_scaling
from hylo.released_facts import (
    AMD_AT,
    DEEPSEEK_V3_DEFAULTS,
    LATENT_NORM_EPS,
    MLA_CONFIG_FIELDS,
    MLA_CONFIG_NAME,
    MLA_LAYER_CONFIG_NAME,
    mla_config_refusal,
)


def is_xecomla_layout(path: str | Path) -> bool:
    """True for a directory of X-EcoMLA's layout (MLA_config.json + mla_layer_config.json)."""
    p = Path(path)
    return (p / MLA_CONFIG_NAME).is_file() and (p / MLA_LAYER_CONFIG_NAME).is_file()


def xecomla_loader_refusal(path: str | Path) -> str | None:
    """What X-EcoMLA's loader (AMD_AT) raises on this directory's two config files, or None if it builds it."""
    p = Path(path)
    return mla_config_refusal(read_layout_json(p / MLA_CONFIG_NAME), read_layout_json(p / MLA_LAYER_CONFIG_NAME))


def _configs(p: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(config.json, MLA_config.json, the layer config with DeepseekV3Config's defaults filled in)."""
    base = read_layout_json(p / "config.json")
    mla_cfg = read_layout_json(p / MLA_CONFIG_NAME)
    layer = read_layout_json(p / MLA_LAYER_CONFIG_NAME)
    # every field within what a model can be built from, before their loader's checks do arithmetic on them
    check_model_config(base, p / "config.json", ReleasedLayoutError)
    check_model_config(mla_cfg, p / MLA_CONFIG_NAME, ReleasedLayoutError, derives_head_dim=False)
    check_model_config(layer, p / MLA_LAYER_CONFIG_NAME, ReleasedLayoutError, derives_head_dim=False)
    refusal = mla_config_refusal(mla_cfg, layer)
    if refusal:
        raise ReleasedLayoutError(f"{p}: X-EcoMLA's loader ({AMD_AT}) would refuse it: {refusal}")
    return base, {**MLA_CONFIG_FIELDS, **mla_cfg}, {**DEEPSEEK_V3_DEFAULTS, **layer}


def xecomla_layer_ranks(layer: dict[str, Any], mla_layers: list[int], where: str,
                        n_layer: int | None = None) -> dict[int, tuple[int | None, int]]:
    """{MLA layer: (q rank, kv rank)} as their layers are built, in order, from one shared config that
    `layer_rank_list` entries overwrite (a layer without one keeps what the last one set). Every entry must
    name an MLA layer (one for another layer is never read: a typo or a config of another model) and every
    rank be within the layer config's hidden_size (the latent of the hidden states it factors)."""
    q, kv = layer["q_lora_rank"], layer["kv_lora_rank"]
    listed = layer.get("layer_rank_list") or {}
    if not isinstance(listed, dict):
        raise ReleasedLayoutError(f"{where}: layer_rank_list must be an object, got {listed!r}")
    n = n_layer if n_layer is not None else max(mla_layers, default=-1) + 1
    for i in check_layer_indices(listed, n, "layer_rank_list", where, ReleasedLayoutError):
        if i not in mla_layers:
            raise ReleasedLayoutError(f"{where}: layer_rank_list names layer {i}, which is not an MLA layer "
                                      f"(the MLA layers are {mla_layers}): its ranks would never be read")
    hidden = layer.get("hidden_size")
    out = {}
    for i in sorted(mla_layers):
        if str(i) in listed:
            entry = listed[str(i)]
            if not isinstance(entry, dict) or "q_rank" not in entry or "kv_rank" not in entry:
                raise ReleasedLayoutError(f"{where}: layer_rank_list[{str(i)!r}] = {entry!r}: expected "
                                          f"{{'q_rank': int, 'kv_rank': int}}")
            q, kv = entry["q_rank"], entry["kv_rank"]
        for name, r in (("q_rank", q), ("kv_rank", kv)):
            if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
                raise ReleasedLayoutError(f"{where}: layer {i}: {name} must be a positive integer, got {r!r}")
            if r is not None and isinstance(hidden, int):
                check_rank(r, f"layer_rank_list[{str(i)!r}].{name}", hidden, where, ReleasedLayoutError)
        out[i] = (q, kv)
    return out


def _pad8(r: int) -> int:
    return -(-r // 8) * 8


def _check_rank_shapes(tensors: dict[str, torch.Tensor], ranks: dict[int, tuple[int | None, int]], P: int,
                       where: str) -> None:
    """Each MLA layer's latent tensors have the ranks layer_rank_list gives it (padding and the rope rows'
    permutation index by them); a missing tensor is left to the import's strict check, which names it."""
    for i, (q, kv) in ranks.items():
        m = f"model.layers.{i}.mla"
        want = {f"{m}.kv_a_proj_with_mqa.weight": (0, kv + P), f"{m}.kv_a_proj_with_mqa.bias": (0, kv + P),
                f"{m}.kv_b_proj.weight": (1, kv)}
        if q is not None:
            want.update({f"{m}.q_a_proj.weight": (0, q), f"{m}.q_a_proj.bias": (0, q), f"{m}.q_b_proj.weight": (1, q)})
        for key, (dim, size) in want.items():
            t = tensors.get(key)
            if t is not None and (t.dim() <= dim or t.shape[dim] != size):
                rank = "q" if size == q and "q_" in key else "kv"
                raise ReleasedLayoutError(f"{where}: layer {i}'s {rank} rank is {q if rank == 'q' else kv} but "
                                          f"{key} has shape {tuple(t.shape)} (dim {dim} should be {size})")


def _pad_ranks(tensors: dict[str, torch.Tensor], ranks: dict[int, tuple[int | None, int]], R: int, Rq: int | None,
               P: int) -> None:
    """Zero-pad each MLA layer's latents to R (kv) and Rq (q), in place (exact without latent norms)."""
    for i, (q, kv) in ranks.items():
        m = f"model.layers.{i}.mla"
        if kv < R:
            for key in (f"{m}.kv_a_proj_with_mqa.weight", f"{m}.kv_a_proj_with_mqa.bias"):
                if key in tensors:
                    t = tensors[key]
                    tensors[key] = torch.cat([t[:kv], t.new_zeros(R - kv, *t.shape[1:]), t[kv:]])
            t = tensors[f"{m}.kv_b_proj.weight"]
            tensors[f"{m}.kv_b_proj.weight"] = torch.cat([t, t.new_zeros(t.shape[0], R - kv)], dim=1)
        if q is not None and Rq is not None and q < Rq:
            for key in (f"{m}.q_a_proj.weight", f"{m}.q_a_proj.bias"):
                if key in tensors:
                    t = tensors[key]
                    tensors[key] = torch.cat([t, t.new_zeros(Rq - q, *t.shape[1:])])
            t = tensors[f"{m}.q_b_proj.weight"]
            tensors[f"{m}.q_b_proj.weight"] = torch.cat([t, t.new_zeros(t.shape[0], Rq - q)], dim=1)


def xecomla_hybrid_config(path: str | Path, tensors: dict[str, torch.Tensor]) -> HybridConfig:
    """Our HybridConfig for an X-EcoMLA directory; pads `tensors` (in place) to one rank per model."""
    p = Path(path)
    base, mc, layer = _configs(p)
    where = str(p / MLA_LAYER_CONFIG_NAME)
    mt = base.get("model_type", "llama")
    if mt not in BASE_TYPES:
        raise ReleasedLayoutError(f"{p / 'config.json'}: model_type {mt!r} is not a supported base; allowed: "
                                  f"{', '.join(BASE_TYPES)}")
    if "vocab_size" not in base:
        raise ReleasedLayoutError(f"{p / 'config.json'}: missing vocab_size")
    n_layer = mc["n_layer"]
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer <= 0:
        raise ReleasedLayoutError(f"{p / MLA_CONFIG_NAME}: n_layer must be a positive integer, got {n_layer!r}")
    if base.get("num_hidden_layers", n_layer) != n_layer:
        raise ReleasedLayoutError(f"{p}: config.json num_hidden_layers={base['num_hidden_layers']} but "
                                  f"{MLA_CONFIG_NAME} n_layer={n_layer}")
    attn = mc["attn_layers"]
    if not isinstance(attn, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in attn):
        raise ReleasedLayoutError(f"{p / MLA_CONFIG_NAME}: attn_layers must be a list of layer indices, got {attn!r}")
    if attn:
        raise ReleasedLayoutError(f"{p / MLA_CONFIG_NAME}: attn_layers={attn}: those layers keep the base's attention, "
                                  f"which a HyLo model has no place for (its layers are MLA or linear); only "
                                  f"all-MLA X-EcoMLA checkpoints are imported")
    D = mc["d_model"]
    for key, theirs in (("hidden_size", layer["hidden_size"]), ("hidden_size", base.get("hidden_size", D))):
        if theirs != D:
            raise ReleasedLayoutError(f"{p}: {MLA_CONFIG_NAME} d_model={D} but {key}={theirs} (in "
                                      f"{MLA_LAYER_CONFIG_NAME} or config.json): the MLA layers read the hidden states")
    eps, eps_final = mc["rms_norm_eps"], base.get("rms_norm_eps", 1e-6)
    if not math.isclose(eps, eps_final, rel_tol=1e-12):
        raise ReleasedLayoutError(f"{p}: {MLA_CONFIG_NAME} rms_norm_eps={eps} (the decoder norms) but config.json "
                                  f"rms_norm_eps={eps_final} (the final norm): a HyLo model has one")
    mla = list(range(n_layer))
    ranks = xecomla_layer_ranks(layer, mla, where, n_layer)
    _check_rank_shapes(tensors, ranks, layer["qk_rope_head_dim"], where)
    qs = {q for q, _ in ranks.values()}
    if len(qs) > 1 and None in qs:
        raise ReleasedLayoutError(f"{where}: some MLA layers compress the queries and some do not: {ranks}")
    R = _pad8(max(kv for _, kv in ranks.values()))
    Rq = None if None in qs else _pad8(max(qs))
    norms = bool(layer["use_lora_layer_norm"])
    uneven = sorted({(q, kv) for q, kv in ranks.values()} - {(Rq, R)})
    if uneven:
        if norms:
            raise ReleasedLayoutError(f"{where}: per-layer ranks {uneven} below the largest (q {Rq}, kv {R}) with "
                                      f"use_lora_layer_norm: their latent norms would see zero padding; not imported")
        warnings.warn(f"{p}: MLA ranks differ per layer ({len(uneven)} layer rank pair(s) below q {Rq}, kv {R}): "
                      f"imported zero-padded to q {Rq}, kv {R} (exact; the KV cache holds {R} latent values per "
                      f"token in every MLA layer)", UserWarning, stacklevel=3)
    P = layer["qk_rope_head_dim"]
    _pad_ranks(tensors, ranks, R, Rq, P)
    if Rq is not None and collapse_identity_q(tensors, {"hidden_size": D, "use_lora_layer_norm": norms,
                                                         "attention_bias": layer["attention_bias"]}, mla, Rq):
        Rq = None
    tie = bool(base.get("tie_word_embeddings", False))
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if tie and head is not None and embed is not None and not torch.equal(head, embed):
        raise ReleasedLayoutError(f"{p}: config.json ties the LM head to the embeddings but lm_head.weight differs "
                                  f"from model.embed_tokens.weight: their loader would keep only one of them")
    if tie:
        tensors.pop("lm_head.weight", None)
    H = layer["num_attention_heads"]
    try:
        return HybridConfig(
            vocab_size=base["vocab_size"], hidden_size=D, intermediate_size=mc["intermediate_size"],
            hidden_act=mc["hidden_act"], n_layer=n_layer, mla_layers=mla, rms_norm_eps=eps,
            num_attention_heads=H, num_key_value_heads=base.get("num_key_value_heads", H),
            head_dim=base.get("head_dim"), kv_lora_rank=R, q_lora_rank=Rq, qk_rope_head_dim=P,
            qk_nope_head_dim=layer["qk_nope_head_dim"], rope_key_groups=1, mla_latent_norm=norms,
            mla_latent_norm_eps=LATENT_NORM_EPS, kv_b_per_kv_head=False, mla_qk_norm=False,
            v_head_dim=layer["v_head_dim"], max_position_embeddings=layer["max_position_embeddings"],
            rope_theta=layer["rope_theta"], rope_scaling=their_rope_scaling(layer["rope_scaling"], where),
            attention_bias=bool(layer["attention_bias"]), mlp_bias=False,
            initializer_range=base.get("initializer_range", 0.02), tie_word_embeddings=tie, base_model_type=mt,
            base_tie_word_embeddings=tie, base_config_json=base, pad_token_id=base.get("pad_token_id"),
            bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
        )
    except HybridConfigError as e:
        raise ReleasedLayoutError(f"{p}: {e}") from None


def load_xecomla(path: str | Path, dtype: torch.dtype | None = None) -> Any:
    """An X-EcoMLA directory as a `HyLoForCausalLM` (strict: every tensor used, none missing)."""
    p = Path(path)
    tensors = read_released_tensors(p)
    hcfg = xecomla_hybrid_config(p, tensors)
    origin: dict[str, str] = {}
    sd = released_to_state_dict(tensors, hcfg, str(p), origin)
    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    expected = {k for k in model.state_dict() if not (hcfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    own = model.state_dict()
    bad = [f"{origin.get(k, k)}: file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
           for k, v in sd.items() if k in own and v.shape != own[k].shape]
    if missing or extra or bad:
        lines = ([f"missing: {released_name(k, hcfg.mla_layers)}" for k in missing[:8]]
                 + [f"unexpected: {origin.get(k, k)}" for k in extra[:8]] + [f"shape: {b}" for b in bad[:8]])
        raise ReleasedLayoutError(f"{p}: the tensors do not match the model its configs describe:\n  " + "\n  ".join(lines))
    return load_checked_tensors(model, sd, hcfg, p, dtype)


# ---------------------------------------------------------------------------------------------- export
def xecomla_files(model: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, MLA_config.json, mla_layer_config.json, tensors) of an all-MLA `model` in X-EcoMLA's
    layout; refuses what that layout cannot hold exactly."""
    hcfg: HybridConfig = model.config
    where = "export to the X-EcoMLA layout"
    if hcfg.linear_layers:
        raise ReleasedLayoutError(f"{where}: layers {hcfg.linear_layers[:8]} are {hcfg.linear_type} layers, which "
                                  f"X-EcoMLA's loader cannot build (its layers are MLA or the base's attention); "
                                  f"export the Zebra-Llama layout instead (the default --released-layout)")
    if hcfg.mla_qk_norm:
        raise ReleasedLayoutError(f"{where}: the MLA layers carry per-head q/k norms (a Qwen3 base), which X-EcoMLA's "
                                  f"MLA layer has no place for")
    # the rest is the Zebra-Llama export's: names, rope rows, identity queries, eps and rank checks
    config_json, hybrid_json, tensors = released_files(model, xecomla=True)
    H, X = hcfg.num_attention_heads, hcfg.qk_nope_head_dim + hcfg.v_head_dim
    for i in hcfg.mla_layers:
        k = f"model.layers.{i}.mla.kv_b_proj.weight"
        if tensors[k].shape[0] != H * X:
            # their kv_b_proj has one block per query head: the per-KV-head rows repeated (exact)
            G = tensors[k].shape[0] // X
            tensors[k] = tensors[k].view(G, X, -1).repeat_interleave(H // G, 0).reshape(H * X, -1).contiguous()
    # their loader ties the head when config.json says so (LlamaForCausalLM), and only then
    config_json = dict(config_json, tie_word_embeddings=bool(hcfg.tie_word_embeddings))
    if hcfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    dh = hcfg.base_head_dim or hcfg.head_dim
    mla_json = {"d_model": hcfg.hidden_size, "rms_norm_eps": hcfg.rms_norm_eps, "vocab_size": hcfg.vocab_size,
                "d_inner": H * dh, "d_xb": hcfg.num_key_value_heads * dh,
                "intermediate_size": hcfg.intermediate_size, "hidden_act": hcfg.hidden_act, "n_layer": hcfg.n_layer,
                "attn_layers": []}
    rs = their_rope_scaling_out(hcfg.rope_scaling, hcfg.max_position_embeddings)
    if rs is not None:
        # X-EcoMLA's MLA reads rope_scaling["type"]
        rs = {"type": rs.pop("rope_type"), **rs}
    q_rank = hybrid_json["q_lora_rank"]
    full = {
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size,
        "num_hidden_layers": hcfg.n_layer, "num_attention_heads": H,
        "llama_num_key_value_heads": hcfg.num_key_value_heads, "mla_num_key_value_heads": H,
        "kv_lora_rank": hybrid_json["kv_lora_rank"], "q_lora_rank": q_rank,
        "use_lora_layer_norm": hcfg.mla_latent_norm,
        "layer_rank_list": {str(i): {"q_rank": q_rank, "kv_rank": hybrid_json["kv_lora_rank"]} for i in hcfg.mla_layers},
        "qk_rope_head_dim": hcfg.qk_rope_head_dim, "v_head_dim": hcfg.v_head_dim,
        "qk_nope_head_dim": hcfg.qk_nope_head_dim, "q_energy_ratio": None, "kv_energy_ratio": None,
        "hidden_act": hcfg.hidden_act, "max_position_embeddings": hcfg.max_position_embeddings,
        "rms_norm_eps": hcfg.rms_norm_eps, "rope_theta": hcfg.rope_theta, "rope_scaling": rs,
        "attention_bias": hcfg.attention_bias, "attention_dropout": 0.0,
    }
    # every DeepseekV3Config key, as their save_config writes it (with transformers 4.43, use_diff drops only
    # PretrainedConfig keys at their defaults)
    layer_json = {**DEEPSEEK_V3_DEFAULTS, **full, "model_type": "deepseek_v3"}
    return config_json, mla_json, layer_json, tensors


def xecomla_expected_tensors(config_json: dict[str, Any], mla_json: dict[str, Any], layer_json: dict[str, Any],
                             where: str = "") -> dict[str, tuple[int, ...]]:
    """{name: shape} of what X-EcoMLA's loader builds and reads with `load_state_dict(strict=False)`: a
    `LlamaForCausalLM(LlamaConfig(**config.json))` (its head tied when config.json says so: not read from the
    file then) whose non-`attn_layers` layers are MLA decoder layers of these configs."""
    refusal = mla_config_refusal(mla_json, layer_json)
    if refusal:
        raise ReleasedLayoutError(f"{where}: X-EcoMLA's loader ({AMD_AT}) would refuse it: {refusal}")
    mc, lc = {**MLA_CONFIG_FIELDS, **mla_json}, {**DEEPSEEK_V3_DEFAULTS, **layer_json}
    V, D = config_json.get("vocab_size", 32000), config_json.get("hidden_size", 4096)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not config_json.get("tie_word_embeddings", True):
        out["lm_head.weight"] = (V, D)
    n = config_json.get("num_hidden_layers", 32)
    mla = [i for i in range(mc["n_layer"]) if i not in mc["attn_layers"]]
    ranks = xecomla_layer_ranks(lc, mla, where, mc["n_layer"])
    H, Dm, N, P, Vh = (lc["num_attention_heads"], lc["hidden_size"], lc["qk_nope_head_dim"], lc["qk_rope_head_dim"],
                       lc["v_head_dim"])
    bias, norms = lc["attention_bias"], lc["use_lora_layer_norm"]
    for i in range(n):
        pre = f"model.layers.{i}"
        width, f = (mc["d_model"], mc["intermediate_size"]) if i in ranks else (D, config_json.get("intermediate_size", 11008))
        out.update({f"{pre}.input_layernorm.weight": (width,), f"{pre}.post_attention_layernorm.weight": (width,),
                    f"{pre}.mlp.gate_proj.weight": (f, width), f"{pre}.mlp.up_proj.weight": (f, width),
                    f"{pre}.mlp.down_proj.weight": (width, f)})
        if i not in ranks:
            hd = config_json.get("head_dim") or D // config_json.get("num_attention_heads", 32)
            nh, nkv = config_json.get("num_attention_heads", 32), config_json.get("num_key_value_heads", 32)
            out.update({f"{pre}.self_attn.q_proj.weight": (nh * hd, D), f"{pre}.self_attn.k_proj.weight": (nkv * hd, D),
                        f"{pre}.self_attn.v_proj.weight": (nkv * hd, D), f"{pre}.self_attn.o_proj.weight": (D, nh * hd)})
            continue
        q, kv = ranks[i]
        # the same MLA module as the HyLo layout's (every head with its own keys and values), this layer's ranks
        layer = {"num_attention_heads": H, "hidden_size": Dm, "qk_rope_head_dim": P, "qk_nope_head_dim": N,
                 "v_head_dim": Vh, "q_lora_rank": q, "kv_lora_rank": kv, "attention_bias": bias,
                 "use_lora_layer_norm": norms, "use_full_kv_head": True}
        out.update(their_mla_shapes(layer, f"{pre}.mla", qk_norm=False))
    return out


def check_xecomla_dir(path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Read an X-EcoMLA directory back as their loader would; raise naming every tensor it would drop, leave at
    its random init or refuse for its shape."""
    p = Path(path)
    expected = xecomla_expected_tensors(read_layout_json(p / "config.json"), read_layout_json(p / MLA_CONFIG_NAME),
                                        read_layout_json(p / MLA_LAYER_CONFIG_NAME), str(p))
    tensors = tensors if tensors is not None else read_released_tensors(p)
    lines = loader_mismatches(tensors, expected)
    if lines:
        raise ReleasedLayoutError(f"{p}: X-EcoMLA's loader would not read this checkpoint as written:\n  "
                                  + "\n  ".join(lines))


def export_xecomla(model: Any, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Write an all-MLA `model` in X-EcoMLA's layout, atomically, after reading it back as their loader would."""

    config_json, mla_json, layer_json, tensors = xecomla_files(model)
    return write_checked_layout(out_dir, model, tensors, {"config.json": (config_json, 2), MLA_CONFIG_NAME: (mla_json, 4),
                                                          MLA_LAYER_CONFIG_NAME: (layer_json, 2)},
                                check_xecomla_dir, tokenizer_from)

