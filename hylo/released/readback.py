"""Reading a written directory back the way AMD's loader does: the module tree it builds from the two JSON files
(its fields, defaults and asserts at the pinned commit) and the tensors it would drop, leave random or refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hylo.config import HYBRID_CONFIG_NAME
from hylo.released.layout import (
    FLA_GDN_DEFAULTS,
    HYLO_KEYS,
    LINEAR_TYPE_NAMES,
    ReleasedLayoutError,
    read_layout_json,
)
from hylo.released.reading import read_released_tensors, their_mamba2
from hylo.released_facts import AMD_AT, HYBRID_CONFIG_FIELDS, hybrid_config_refusal


def their_expected_tensors(config_json: dict[str, Any], hybrid_json: dict[str, Any], where: str = "",
                           hylo: bool = False) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor in the module tree AMD's loader builds from these two files: a
    `LlamaConfig(**config.json)` causal LM (embeddings, final norm, an own lm_head, `num_hidden_layers` layers)
    whose first `n_layer` layers are replaced by MLA / Mamba-2 decoder layers of `HybridConfig(**hybrid)` (the
    public loader at AMD_AT: its fields, defaults and asserts), every missing key at its default. `hylo`: the
    layouts only HyLo's code builds, with `HYLO_KEYS` (GDN layers under `gdn.` with fla's names; q/k norms
    under `mla.q_norm` / `mla.k_norm` with `use_qk_norm`; HyLo's own names are not public)."""
    known = set(HYBRID_CONFIG_FIELDS) | (set(HYLO_KEYS) if hylo else set())
    unknown = [k for k in hybrid_json if k not in known]
    if unknown:
        raise ReleasedLayoutError(f"{where}: {HYBRID_CONFIG_NAME} key(s) {', '.join(unknown)} are not fields of AMD's "
                                  f"HybridConfig ({AMD_AT}): {hybrid_config_refusal(hybrid_json)}")
    refusal = hybrid_config_refusal({k: v for k, v in hybrid_json.items() if k not in HYLO_KEYS})
    if refusal:
        raise ReleasedLayoutError(f"{where}: AMD's loader ({AMD_AT}) would refuse it: {refusal}")
    c = {**HYBRID_CONFIG_FIELDS, **hybrid_json}
    V, D = config_json.get("vocab_size", 32000), config_json.get("hidden_size", 4096)
    Hd, F = c["hidden_size"], c["intermediate_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
                                       "lm_head.weight": (V, D)}
    n_base = config_json.get("num_hidden_layers", 32)
    linear = str(c.get("linear_type") or "mamba2").lower()
    qk_norm = bool(c.get("use_qk_norm"))
    for i in range(max(n_base, c["n_layer"])):
        pre = f"model.layers.{i}"
        if i >= c["n_layer"]:
            # a layer of the base model that no hybrid layer replaced
            hd = config_json.get("head_dim") or D // config_json.get("num_attention_heads", 32)
            nh, nkv = config_json.get("num_attention_heads", 32), config_json.get("num_key_value_heads", 32)
            out.update({f"{pre}.self_attn.q_proj.weight": (nh * hd, D), f"{pre}.self_attn.k_proj.weight": (nkv * hd, D),
                        f"{pre}.self_attn.v_proj.weight": (nkv * hd, D), f"{pre}.self_attn.o_proj.weight": (D, nh * hd)})
            width, f_base = D, config_json.get("intermediate_size", 11008)
        else:
            width, f_base = (c["d_model"], F) if i not in c["mla_layers"] and linear in LINEAR_TYPE_NAMES["mamba2"] \
                else (Hd, F)
        out.update({f"{pre}.input_layernorm.weight": (width,), f"{pre}.post_attention_layernorm.weight": (width,),
                    f"{pre}.mlp.gate_proj.weight": (f_base, width), f"{pre}.mlp.up_proj.weight": (f_base, width),
                    f"{pre}.mlp.down_proj.weight": (width, f_base)})
        if i >= c["n_layer"]:
            continue
        if i in c["mla_layers"]:
            out.update(their_mla_shapes(c, f"{pre}.mla", qk_norm))
        elif linear in LINEAR_TYPE_NAMES["mamba2"]:
            out.update(_their_mamba_shapes(c, f"{pre}.mamba", where))
        elif linear in LINEAR_TYPE_NAMES["gdn"]:
            out.update(_their_gdn_shapes(c, f"{pre}.gdn", Hd, where))
        else:
            raise ReleasedLayoutError(f"{where}: linear_type={c['linear_type']!r} is unknown")
    return out


def their_mla_shapes(c: dict[str, Any], m: str, qk_norm: bool) -> dict[str, tuple]:
    """{name: shape} of one MLA module `m` of AMD's code (the HyLo layout's `mla`, X-EcoMLA's too) from config `c`."""
    H, Dh, P, N, V = c["num_attention_heads"], c["hidden_size"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    q, kv, bias, norms = c["q_lora_rank"], c["kv_lora_rank"], c["attention_bias"], c["use_lora_layer_norm"]
    kv_heads = H if c["use_full_kv_head"] else c["num_key_value_heads"]
    out: dict[str, tuple] = {}
    if q is None:
        out[f"{m}.q_proj.weight"] = (H * (N + P), Dh)
        if bias:
            out[f"{m}.q_proj.bias"] = (H * (N + P),)
    else:
        out.update({f"{m}.q_a_proj.weight": (q, Dh), f"{m}.q_b_proj.weight": (H * (N + P), q)})
        if bias:
            out[f"{m}.q_a_proj.bias"] = (q,)
        if norms:
            out[f"{m}.q_a_layernorm.weight"] = (q,)
    out[f"{m}.kv_a_proj_with_mqa.weight"] = (kv + P, Dh)
    if bias:
        out.update({f"{m}.kv_a_proj_with_mqa.bias": (kv + P,), f"{m}.out_proj.bias": (Dh,)})
    if norms:
        out[f"{m}.kv_a_layernorm.weight"] = (kv,)
    out.update({f"{m}.kv_b_proj.weight": (kv_heads * (N + V), kv), f"{m}.out_proj.weight": (Dh, H * V)})
    if qk_norm:
        out.update({f"{m}.q_norm.weight": (N + P,), f"{m}.k_norm.weight": (N + P,)})
    return out


def _their_mamba_shapes(c: dict[str, Any], m: str, where: str) -> dict[str, tuple]:
    d = their_mamba2(c, where)
    d_model, d_inner, d_xb, H, w = d["d_model"], d["d_inner"], d["d_xb"], d["heads"], d["d_conv"]
    conv = 3 * d_inner if d["repeat_before_conv"] else d_inner + 2 * d_xb
    return {f"{m}.in_proj.weight": (2 * d_inner + 2 * d_xb + H, d_model), f"{m}.conv1d.weight": (conv, 1, w),
            f"{m}.conv1d.bias": (conv,), f"{m}.dt_bias": (H,), f"{m}.A_log": (H,), f"{m}.D": (H,),
            f"{m}.norm.weight": (d_inner,), f"{m}.out_proj.weight": (d_model, d_inner)}


def _their_gdn_shapes(c: dict[str, Any], m: str, Dh: int, where: str) -> dict[str, tuple]:
    if "gdn_num_heads" not in c or "gdn_head_dim" not in c:
        raise ReleasedLayoutError(f"{where}: GDN layers need gdn_num_heads and gdn_head_dim in {HYBRID_CONFIG_NAME}")
    H, K = c["gdn_num_heads"], c["gdn_head_dim"]
    Vd = int(K * c.get("gdn_expand_v", FLA_GDN_DEFAULTS["gdn_expand_v"]))
    w = c.get("gdn_conv_size", FLA_GDN_DEFAULTS["gdn_conv_size"])
    return {f"{m}.q_proj.weight": (H * K, Dh), f"{m}.k_proj.weight": (H * K, Dh), f"{m}.v_proj.weight": (H * Vd, Dh),
            f"{m}.g_proj.weight": (H * Vd, Dh), f"{m}.a_proj.weight": (H, Dh), f"{m}.b_proj.weight": (H, Dh),
            f"{m}.A_log": (H,), f"{m}.dt_bias": (H,), f"{m}.q_conv1d.weight": (H * K, 1, w),
            f"{m}.k_conv1d.weight": (H * K, 1, w), f"{m}.v_conv1d.weight": (H * Vd, 1, w),
            f"{m}.o_norm.weight": (Vd,), f"{m}.o_proj.weight": (Dh, H * Vd)}


def public_loader_refusal(path: str | Path) -> str | None:
    """What AMD's public loader (AMD_AT) raises on this directory's hybrid_config.json, or None if it builds it."""
    return hybrid_config_refusal(read_layout_json(Path(path) / HYBRID_CONFIG_NAME))


def loader_mismatches(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    """What another project's loader would do wrong with `tensors` against the shapes its modules expect
    (`expected`): the tensors it drops, those it leaves at their random init, those of the wrong shape (8 of
    each at most), one line each; [] when it reads them all."""
    dropped = sorted(set(tensors) - set(expected))
    random = sorted(set(expected) - set(tensors))
    shapes = sorted(f"{k}: file {tuple(t.shape)}, their module {expected[k]}" for k, t in tensors.items()
                    if k in expected and tuple(t.shape) != expected[k])
    return ([f"dropped by their loader (no such module): {k}" for k in dropped[:8]]
            + [f"left at their random init (not in the file): {k}" for k in random[:8]]
            + [f"shape mismatch: {k}" for k in shapes[:8]])


def check_released_dir(path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> str | None:
    """Read a released directory back as AMD's loader would (`load_state_dict(strict=False)` into the module
    tree of `their_expected_tensors`); raise naming every tensor it would drop, leave random or refuse.

    Returns None when AMD's public loader (AMD_AT) reads it exactly. A directory with HyLo's keys (a layout
    only HyLo's code builds) is checked against that layout, and must be refused by the public loader: the
    refusal it gives is returned."""
    p = Path(path)
    where = str(p / HYBRID_CONFIG_NAME)
    hyb = read_layout_json(p / HYBRID_CONFIG_NAME)
    hylo = any(k in hyb for k in HYLO_KEYS)
    refusal = hybrid_config_refusal(hyb)
    if hylo and refusal is None:
        raise ReleasedLayoutError(f"{where}: HyLo's keys ({', '.join(k for k in HYLO_KEYS if k in hyb)}) are fields of "
                                  f"AMD's public HybridConfig: it would build this layout with its own layers")
    expected = their_expected_tensors(read_layout_json(p / "config.json"), hyb, where, hylo=hylo)
    tensors = tensors if tensors is not None else read_released_tensors(p)
    lines = loader_mismatches(tensors, expected)
    if lines:
        raise ReleasedLayoutError(f"{p}: AMD's loader would not read this checkpoint as written:\n  " + "\n  ".join(lines))
    return refusal
