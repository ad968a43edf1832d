"""Reading a released directory: its tensors (safetensors only, checked) and our HybridConfig from its
config.json, hybrid_config.json and tensor shapes."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hylo.config import HYBRID_CONFIG_NAME, HybridConfig, HybridConfigError
from hylo.manifest_paths import confined_paths
from hylo.model_files import check_finite_tensors, check_layer_indices, check_model_config
from hylo.released.layout import (
    AMD_DEFAULTS,
    BASE_TYPES,
    LAYER_KEY,
    LINEAR_PREFIXES,
    LINEAR_TYPE_NAMES,
    MAMBA2_FIXED,
    MAMBA_PREFIX,
    QK_NORM_NAMES,
    QK_NORM_PARTS,
    SHARED_LAYER_PARTS,
    ReleasedLayoutError,
    read_layout_json,
)
from hylo.released_facts import (
    HYBRID_CONFIG_FIELDS,
    LATENT_NORM_EPS,
    MAMBA2_ARGS,
    MAMBA2_ARGS_NO_MATH,
    MAMBA_GATED_NORM_EPS,
    YARN_DEFAULT_ORIGINAL,
)


def read_released_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files (a sharded index is checked for missing shards)."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_layout_json(index).get("weight_map") or {}
        if not isinstance(weight_map, dict):
            raise ReleasedLayoutError(f"{index}: 'weight_map' must be an object (tensor name -> file)")
        # the shards it names are files of this directory (many tensors share one file: each named once here)
        shards: list[Any] = []
        for f in weight_map.values():
            if f not in shards:
                shards.append(f)
        confined_paths(p, shards, index, "weight_map", ReleasedLayoutError)
        missing = sorted({f for f in weight_map.values() if not (p / f).is_file()})
        if missing:
            raise ReleasedLayoutError(f"{index}: shard(s) {', '.join(missing)} listed but not present")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        pickled = sorted(x.name for x in p.glob("*.bin"))
        hint = (f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors "
                f"in a trusted environment)") if pickled else ""
        raise ReleasedLayoutError(f"{p}: no *.safetensors weight files{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys = set(sf.keys())
                for k in sf.keys():
                    if k in tensors:
                        raise ReleasedLayoutError(f"{p}: tensor {k!r} appears in more than one file ({f.name})")
                    tensors[k] = sf.get_tensor(k)
        except ReleasedLayoutError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
            raise ReleasedLayoutError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        # a NaN / inf weight would be imported without a word (and every later job would compute with it)
        check_finite_tensors(((k, t) for k, t in tensors.items() if k in keys), f, ReleasedLayoutError)
    return tensors


def their_rope_scaling(rs: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """AMD's rope_scaling in our terms (exact), or a clear refusal."""
    if not rs:
        return None
    rs = dict(rs)
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype == "linear":
        return {"rope_type": "linear", "factor": float(rs["factor"])}
    if rtype != "yarn":
        raise ReleasedLayoutError(f"{where}: rope_scaling.rope_type={rtype!r} is not supported for import "
                                  f"(the MLA layers of AMD's code rotate with yarn or linear scaling; allowed: yarn, linear)")
    if "factor" not in rs:
        raise ReleasedLayoutError(f"{where}: rope_scaling (yarn) has no 'factor'")
    factor = float(rs["factor"])
    mscale = float(rs.get("mscale", 1.0))
    mscale_all_dim = float(rs.get("mscale_all_dim", 0.0))

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    out = {"rope_type": "yarn", "factor": factor,
           "original_max_position_embeddings": int(rs.get("original_max_position_embeddings", YARN_DEFAULT_ORIGINAL)),
           "beta_fast": float(rs.get("beta_fast", 32)), "beta_slow": float(rs.get("beta_slow", 1)),
           # AMD's cos/sin magnitude, whatever our defaults would derive
           "attention_factor": get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)}
    for key in ("mscale", "mscale_all_dim"):
        if key in rs:
            out[key] = float(rs[key])
    return out


def _linear_dims(tensors: dict[str, torch.Tensor], prefix: str, where: str) -> dict[str, Any]:
    """GDN shapes read from one layer's tensors: heads, key head dim, value expansion, conv width."""
    try:
        H = int(tensors[f"{prefix}.A_log"].numel())
        qk = tensors[f"{prefix}.q_proj.weight"].shape[0]
        v = tensors[f"{prefix}.v_proj.weight"].shape[0]
        conv = tensors[f"{prefix}.q_conv1d.weight"].shape[-1]
    except KeyError as e:
        raise ReleasedLayoutError(f"{where}: GDN layer {prefix} lacks {e.args[0]!r}") from None
    if qk % H or v % H:
        raise ReleasedLayoutError(f"{where}: {prefix}: q_proj rows {qk} / v_proj rows {v} are not a multiple of "
                                  f"the {H} heads of A_log")
    return {"gdn_num_heads": H, "gdn_head_dim": qk // H, "gdn_expand_v": (v // H) / (qk // H), "gdn_conv_size": conv}


def their_mamba2(hyb: dict[str, Any], where: str) -> dict[str, Any]:
    """AMD's Mamba-2 shapes as their layer derives them from hybrid_config.json (`Mamba2(d_model=d_model,
    d_xb=d_xb, d_inner=d_inner, **ssm_cfg)`, missing keys at their defaults); refuses what ours cannot hold."""
    ssm = hyb.get("ssm_cfg", HYBRID_CONFIG_FIELDS["ssm_cfg"])
    if not isinstance(ssm, dict):
        raise ReleasedLayoutError(f"{where}: ssm_cfg must be an object, got {ssm!r}")
    unknown = sorted(set(ssm) - set(MAMBA2_ARGS) - set(MAMBA2_ARGS_NO_MATH))
    if unknown:
        raise ReleasedLayoutError(f"{where}: ssm_cfg key(s) {', '.join(unknown)} unknown to AMD's Mamba2 layer; "
                                  f"known: {', '.join(sorted([*MAMBA2_ARGS, *MAMBA2_ARGS_NO_MATH]))}")
    cfg = {**MAMBA2_ARGS, **ssm}
    for key in MAMBA2_FIXED:
        given, default = cfg[key], MAMBA2_ARGS[key]
        same = list(given) == default if key == "dt_limit" and isinstance(given, list | tuple) else given == default
        if not same:
            raise ReleasedLayoutError(f"{where}: ssm_cfg.{key}={given!r} is not supported for import (our Mamba-2 "
                                      f"layer holds AMD's default {default!r}: D per head, gated RMSNorm after the "
                                      f"gate, no dt clamp, no projection biases, a conv bias)")
    d_model = hyb.get("d_model", HYBRID_CONFIG_FIELDS["d_model"])
    d_inner = hyb.get("d_inner")
    d_inner = d_inner if d_inner is not None else cfg["expand"] * d_model
    d_xb = hyb.get("d_xb", HYBRID_CONFIG_FIELDS["d_xb"])
    d_state, ngroups = cfg["d_state"], cfg["ngroups"]
    for key, v in (("d_model", d_model), ("d_inner", d_inner), ("d_xb", d_xb), ("ssm_cfg.d_state", d_state),
                   ("ssm_cfg.ngroups", ngroups), ("ssm_cfg.d_conv", cfg["d_conv"])):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ReleasedLayoutError(f"{where}: {key} must be a positive integer, got {v!r}")
    if d_inner != ngroups * d_state:
        raise ReleasedLayoutError(f"{where}: d_inner={d_inner} must equal ssm_cfg.ngroups * ssm_cfg.d_state = "
                                  f"{ngroups} * {d_state} (AMD's Mamba2 asserts it: one head of d_state per group)")
    if d_xb % d_state or ngroups % (d_xb // d_state):
        raise ReleasedLayoutError(f"{where}: d_xb={d_xb} must be a multiple of d_state={d_state} whose group "
                                  f"count divides the {ngroups} heads (x and B are repeated to the heads)")
    return {"d_model": d_model, "d_inner": d_inner, "d_xb": d_xb, "d_state": d_state, "heads": ngroups,
            "xb_groups": d_xb // d_state, "d_conv": cfg["d_conv"],
            "repeat_before_conv": bool(cfg["repeat_kv_before_conv"])}


def _their_mla_layers(hyb: dict[str, Any], n_layer: int, where: str) -> list[int]:
    """hybrid_config.json's mla_layers, refused unless a list of distinct integer layer indices in range."""
    raw = hyb.get("mla_layers", HYBRID_CONFIG_FIELDS["mla_layers"])
    if not isinstance(raw, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in raw):
        raise ReleasedLayoutError(f"{where}: mla_layers must be a list of integer layer indices, got {raw!r}")
    bad = [i for i in raw if not 0 <= i < n_layer]
    if bad:
        raise ReleasedLayoutError(f"{where}: mla_layers holds {bad}: out of range for n_layer={n_layer} "
                                  f"(allowed 0..{n_layer - 1})")
    if len(set(raw)) != len(raw):
        raise ReleasedLayoutError(f"{where}: mla_layers has duplicates: {raw}")
    return sorted(raw)


def _linear_type_of(prefixes: list[str], hyb: dict[str, Any], linear_layers: list[int], p: Path) -> str:
    """'gdn' or 'mamba2', from the non-MLA layers' tensor names (checked against `linear_type` when given)."""
    where = str(p / HYBRID_CONFIG_NAME)
    if len(prefixes) > 1:
        raise ReleasedLayoutError(f"{p}: the non-MLA layers hold mixers of more than one kind ({', '.join(prefixes)}); "
                                  f"one linear type per model")
    if not prefixes or prefixes[0] not in (*LINEAR_PREFIXES, MAMBA_PREFIX):
        raise ReleasedLayoutError(f"{p}: the non-MLA layers {linear_layers[:6]} (per mla_layers in {where}) hold "
                                  f"mixers named {prefixes or 'nothing'}; expected one of "
                                  f"{', '.join((*LINEAR_PREFIXES, MAMBA_PREFIX))}")
    kind = "mamba2" if prefixes[0] == MAMBA_PREFIX else "gdn"
    named = hyb.get("linear_type")
    if named is not None and str(named).lower() not in LINEAR_TYPE_NAMES[kind]:
        raise ReleasedLayoutError(f"{where}: linear_type={named!r} but the non-MLA layers hold `{prefixes[0]}.*` "
                                  f"tensors ({kind})")
    return kind


def _qk_norm_found(tensors: dict[str, torch.Tensor], mla: list[int], p: Path, declared: Any = None) -> bool:
    """Whether the MLA layers carry q/k norms (checked against `use_qk_norm` where our export wrote it),
    saying once under which names they were found when no key declared them."""
    found = sorted({f"{part}.{name}" for i in mla for part in QK_NORM_PARTS for name in QK_NORM_NAMES
                    if f"model.layers.{i}.{part}.{name}" in tensors})
    if declared is not None and bool(declared) != bool(found):
        raise ReleasedLayoutError(f"{p / HYBRID_CONFIG_NAME}: use_qk_norm={declared!r} but the MLA layers hold "
                                  f"{'q/k norm weights (' + ', '.join(found) + ')' if found else 'no q/k norm weights'}")
    if found and declared is None:
        warnings.warn(f"{p}: the MLA layers carry per-head q/k RMSNorm weights, found as {', '.join(found)}: "
                      f"imported as mla_qk_norm", UserWarning, stacklevel=3)
    return bool(found)


def collapse_identity_q(tensors: dict[str, torch.Tensor], hyb: dict[str, Any], mla: list[int],
                         q_rank: int | None) -> bool:
    """Our export of whole queries writes q_a_proj = the identity (AMD's config cannot say q_lora_rank: null):
    when every MLA layer's q_a_proj is exactly that (no bias, no latent norm), rename q_b_proj to the q_proj it
    is, in `tensors`, and say so (True)."""
    if not mla or q_rank != hyb.get("hidden_size") or hyb.get("use_lora_layer_norm") or hyb.get("attention_bias"):
        return False
    eye = None
    for i in mla:
        a = tensors.get(f"model.layers.{i}.mla.q_a_proj.weight")
        if a is None or a.dim() != 2 or a.shape[0] != a.shape[1]:
            return False
        eye = torch.eye(a.shape[0], dtype=a.dtype) if eye is None or eye.dtype != a.dtype else eye
        if not torch.equal(a, eye):
            return False
    for i in mla:
        pre = f"model.layers.{i}.mla"
        del tensors[f"{pre}.q_a_proj.weight"]
        tensors[f"{pre}.q_proj.weight"] = tensors.pop(f"{pre}.q_b_proj.weight")
    return True


def _untied_head(tensors: dict[str, torch.Tensor], tie: bool, p: Path) -> bool:
    """The head as AMD's code uses it: untied when lm_head.weight is stored and differs from the embeddings."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if not tie or head is None or (embed is not None and torch.equal(head, embed)):
        return not tie
    warnings.warn(f"{p}: config.json says tie_word_embeddings: true but lm_head.weight is stored apart from the "
                  f"embeddings (as AMD's code uses it): imported as an untied LM head", UserWarning, stacklevel=3)
    return True


def released_hybrid_config(path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> HybridConfig:
    """Our HybridConfig for a released directory (base config.json + AMD's hybrid_config.json + tensor shapes)."""
    p = Path(path)
    base = read_layout_json(p / "config.json")
    hyb = read_layout_json(p / HYBRID_CONFIG_NAME)
    where = str(p / HYBRID_CONFIG_NAME)
    # every field within what a model can be built from, before any arithmetic on them
    check_model_config(base, p / "config.json", ReleasedLayoutError)
    check_model_config(hyb, where, ReleasedLayoutError, derives_head_dim=False)
    mt = base.get("model_type")
    if mt not in BASE_TYPES:
        raise ReleasedLayoutError(f"{p / 'config.json'}: model_type {mt!r} is not a supported base; allowed: "
                                  f"{', '.join(BASE_TYPES)}")
    for key in ("n_layer", "num_attention_heads", "hidden_size", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
        if key not in hyb:
            raise ReleasedLayoutError(f"{where}: missing key {key!r}")
    if "vocab_size" not in base:
        raise ReleasedLayoutError(f"{p / 'config.json'}: missing vocab_size (the released layout keeps it in the "
                                  f"base config.json)")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads"):
        if key in base and base[key] != hyb[key]:
            raise ReleasedLayoutError(f"{key}: config.json says {base[key]}, {HYBRID_CONFIG_NAME} says {hyb[key]}")
    if "num_hidden_layers" in base and base["num_hidden_layers"] != hyb["n_layer"]:
        raise ReleasedLayoutError(f"config.json num_hidden_layers={base['num_hidden_layers']} but "
                                  f"{HYBRID_CONFIG_NAME} n_layer={hyb['n_layer']}")
    g = hyb.get("num_key_value_heads", base.get("num_key_value_heads", hyb["num_attention_heads"]))
    full_kv = bool(hyb.get("use_full_kv_head", AMD_DEFAULTS["use_full_kv_head"]))
    n_layer = hyb["n_layer"]
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer <= 0:
        raise ReleasedLayoutError(f"{where}: n_layer must be a positive integer, got {n_layer!r}")
    mla = _their_mla_layers(hyb, n_layer, where)
    q_default = hyb.get("q_lora_rank", HYBRID_CONFIG_FIELDS["q_lora_rank"])
    # older versions of their code wrote layer_rank_list (removed since): uniform ranks only, for MLA layers
    listed = hyb.get("layer_rank_list") or {}
    if not isinstance(listed, dict):
        raise ReleasedLayoutError(f"{where}: layer_rank_list must be an object, got {listed!r}")
    for i in check_layer_indices(listed, n_layer, "layer_rank_list", where, ReleasedLayoutError):
        if i not in mla:
            raise ReleasedLayoutError(f"{where}: layer_rank_list names layer {i}, which is not an MLA layer "
                                      f"(mla_layers {mla}): ranks for a layer without MLA are never read")
    for layer, ranks in listed.items():
        got = (ranks.get("q_rank", q_default), ranks.get("kv_rank", hyb["kv_lora_rank"])) \
            if isinstance(ranks, dict) else ranks
        if got != (q_default, hyb["kv_lora_rank"]):
            raise ReleasedLayoutError(f"{where}: layer_rank_list[{layer!r}] = {ranks!r}: per-layer MLA ranks are not "
                                      f"supported (every layer must use q_lora_rank={q_default}, "
                                      f"kv_lora_rank={hyb['kv_lora_rank']})")
    tensors = tensors if tensors is not None else read_released_tensors(p)
    q_rank = q_default
    if collapse_identity_q(tensors, hyb, mla, q_rank):
        # our export of whole queries (q_a_proj = identity): imported as the q_proj it stands for
        q_rank = None
    linear_kw: dict[str, Any] = {}
    linear_type = "gdn"
    linear_layers = [i for i in range(n_layer) if i not in set(mla)]
    if linear_layers:
        prefixes = sorted({m.group(2) for k in tensors if (m := LAYER_KEY.match(k)) and int(m.group(1)) in linear_layers
                           and m.group(2) not in SHARED_LAYER_PARTS})
        linear_type = _linear_type_of(prefixes, hyb, linear_layers, p)
        i0 = linear_layers[0]
        if linear_type == "gdn":
            linear_kw = _linear_dims(tensors, f"model.layers.{i0}.{prefixes[0]}", str(p))
            for key in ("gdn_num_heads", "gdn_head_dim", "gdn_expand_v", "gdn_conv_size"):
                if key in hyb and hyb[key] != linear_kw[key]:
                    raise ReleasedLayoutError(f"{where}: {key}={hyb[key]} but the layer {i0} tensors give "
                                              f"{linear_kw[key]}")
        else:
            m2 = their_mamba2(hyb, where)
            if m2["d_model"] != hyb["hidden_size"]:
                raise ReleasedLayoutError(f"{where}: d_model={m2['d_model']} but hidden_size={hyb['hidden_size']} "
                                          f"(the Mamba-2 layers' width, and their MLP's)")
            X, H = m2["xb_groups"], m2["heads"]
            linear_kw = {"mamba2_num_heads": H, "mamba2_head_dim": m2["d_state"], "mamba2_state_size": m2["d_state"],
                         "mamba2_n_groups": H, "gdn_conv_size": m2["d_conv"], "mamba2_norm_eps": MAMBA_GATED_NORM_EPS,
                         # repeat_kv_before_conv: the conv runs on repeated channels, x/B rows repeat per head
                         "mamba2_xb_groups": None if X == H or m2["repeat_before_conv"] else X}
            # HyLo's GDN keys mean nothing to Mamba-2 layers: kept for the export to write them back
            linear_kw.update({k: hyb[k] for k in ("gdn_num_heads", "gdn_head_dim") if k in hyb})
    eps = hyb.get("rms_norm_eps", base.get("rms_norm_eps", AMD_DEFAULTS["rms_norm_eps"]))
    qk_norm = _qk_norm_found(tensors, mla, p, hyb.get("use_qk_norm"))
    tie = bool(base.get("tie_word_embeddings", False))
    untied = _untied_head(tensors, tie, p)
    try:
        return HybridConfig(
            vocab_size=base["vocab_size"],
            hidden_size=hyb["hidden_size"],
            intermediate_size=hyb["intermediate_size"],
            hidden_act=hyb.get("hidden_act", base.get("hidden_act", "silu")),
            n_layer=n_layer,
            mla_layers=mla,
            rms_norm_eps=eps,
            num_attention_heads=hyb["num_attention_heads"],
            num_key_value_heads=g,
            head_dim=base.get("head_dim"),
            kv_lora_rank=hyb["kv_lora_rank"],
            q_lora_rank=q_rank,
            qk_rope_head_dim=hyb["qk_rope_head_dim"],
            qk_nope_head_dim=hyb["qk_nope_head_dim"],
            rope_key_groups=1,
            mla_latent_norm=bool(hyb.get("use_lora_layer_norm", AMD_DEFAULTS["use_lora_layer_norm"])),
            mla_latent_norm_eps=LATENT_NORM_EPS,
            kv_b_per_kv_head=not full_kv and g != hyb["num_attention_heads"],
            mla_qk_norm=qk_norm,
            v_head_dim=hyb["v_head_dim"],
            max_position_embeddings=hyb.get("max_position_embeddings", AMD_DEFAULTS["max_position_embeddings"]),
            rope_theta=hyb.get("rope_theta", AMD_DEFAULTS["rope_theta"]),
            rope_scaling=their_rope_scaling(hyb.get("rope_scaling"), where),
            attention_bias=bool(hyb.get("attention_bias", AMD_DEFAULTS["attention_bias"])),
            mlp_bias=bool(base.get("mlp_bias", False)),
            linear_type=linear_type,
            **linear_kw,
            initializer_range=base.get("initializer_range", 0.02),
            tie_word_embeddings=not untied,
            base_model_type=mt,
            base_tie_word_embeddings=tie,
            base_config_json=base,
            pad_token_id=base.get("pad_token_id"),
            bos_token_id=base.get("bos_token_id"),
            eos_token_id=base.get("eos_token_id"),
        )
    except HybridConfigError as e:
        raise ReleasedLayoutError(f"{p}: {e}") from None
