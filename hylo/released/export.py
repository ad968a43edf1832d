"""Exporting a model to the released layout: the files AMD's code reads (refusing what is not exact), written
atomically after reading them back as its loader would."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hylo.config import HYBRID_CONFIG_NAME, HybridConfig
from hylo.layers.rope import rope_parameters
from hylo.outputs import atomic_dir
from hylo.released.layout import (
    BASE_TYPES,
    FLA_GDN_DEFAULTS,
    HYLO_KEYS,
    LAYER_KEY,
    QK_NORM_NAMES,
    ReleasedLayoutError,
    interleaved_to_half_perm,
    permute_kv_a,
    permute_norm_rope,
    permute_q_rope,
    released_name,
)
from hylo.released.readback import check_released_dir
from hylo.released.reading import their_rope_scaling
from hylo.released_facts import (
    AMD_AT,
    HYBRID_CONFIG_FIELDS,
    INFERENCE_READS_FULL_KV_HEAD,
    LATENT_NORM_EPS,
    MAMBA2_ARGS,
    MAMBA_GATED_NORM_EPS,
)
from hylo.tokenizer_files import copy_tokenizer_files


def _kv_b_for_export(w: torch.Tensor, hcfg: HybridConfig) -> tuple[torch.Tensor, bool]:
    """(kv_b rows in the released layout, use_full_kv_head)."""
    H, G, X = hcfg.num_attention_heads, hcfg.num_key_value_heads, hcfg.qk_nope_head_dim + hcfg.v_head_dim
    if hcfg.kv_b_per_kv_head or G == H:
        return w, False
    w_H = w.view(H, X, -1)
    per_kv = w_H[:: H // G]
    if torch.equal(per_kv.repeat_interleave(H // G, 0), w_H):
        return per_kv.reshape(G * X, -1), False
    return w, True


def their_rope_scaling_out(rs: dict[str, Any] | None, max_pos: int) -> dict[str, Any] | None:
    if not rs:
        return None
    rtype = rs.get("rope_type", rs.get("type")) or "default"
    if rtype == "default":
        return None
    if rtype == "linear":
        return {"rope_type": "linear", "factor": float(rs["factor"])}
    original = int(rs["original_max_position_embeddings"])
    factor = float(rs["factor"]) if rs.get("factor") is not None else max_pos / original
    if rs.get("truncate", True) is False:
        raise ReleasedLayoutError("rope_scaling.truncate=false has no equivalent in the released layout")
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    # DeepSeek's defaults (32, 1) are left out, as AMD's training script writes rope_scaling
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        if rs.get(key) is not None and float(rs[key]) != default:
            out[key] = float(rs[key])
    for key in ("mscale", "mscale_all_dim"):
        if rs.get(key) is not None:
            out[key] = float(rs[key])
    # what their code will compute for the cos/sin magnitude must be what ours uses
    ours = their_rope_scaling(out, "export")["attention_factor"]
    _, mine = rope_parameters(2, 10000.0, rs, max_pos)
    if not math.isclose(ours, mine, rel_tol=1e-12):
        raise ReleasedLayoutError(f"rope_scaling {rs}: its attention factor {mine} cannot be expressed in the "
                                  f"released layout (which would use {ours})")
    return out


def _mamba2_for_export(hcfg: HybridConfig, where: str) -> dict[str, Any]:
    """hybrid_config.json's Mamba-2 keys for our layer, or a refusal naming what AMD's layer cannot hold."""
    H, P, N, G = hcfg.mamba2_dims
    if P != N or G != H:
        raise ReleasedLayoutError(f"{where}: Mamba-2 with head_dim {P}, state {N}, {G} groups of C for {H} heads: AMD's "
                                  f"layer has head_dim = state size (d_state) and one C group per head; set "
                                  f"mamba2_head_dim = mamba2_state_size and mamba2_n_groups = the head count")
    if not math.isclose(hcfg.mamba2_norm_eps_value, MAMBA_GATED_NORM_EPS, rel_tol=1e-12):
        raise ReleasedLayoutError(
            f"{where}: the Mamba-2 gated norms use eps {hcfg.mamba2_norm_eps_value:g} (mamba2_norm_eps"
            f"{'' if hcfg.mamba2_norm_eps is not None else ' unset: the base rms_norm_eps'}); AMD's Mamba-2 layer "
            f"fixes it at {MAMBA_GATED_NORM_EPS:g} ({AMD_AT}), so its outputs would differ. Convert with "
            f"--mamba2-norm-eps {MAMBA_GATED_NORM_EPS:g} (convert.mamba2_norm_eps) to export exactly")
    X = hcfg.mamba2_xb_groups or H
    ssm = {"expand": 1, "ngroups": H, "d_state": N, "repeat_kv_before_conv": False}
    if hcfg.gdn_conv_size != MAMBA2_ARGS["d_conv"]:
        ssm["d_conv"] = hcfg.gdn_conv_size
    return {"d_model": hcfg.hidden_size, "ssm_cfg": ssm, "d_inner": H * P, "d_xb": X * N}


def _config_json_for_export(hcfg: HybridConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The base config.json: as imported when the model came from a released checkpoint, else rebuilt (the
    base's tie_word_embeddings and, for converted models, the base's own rope_theta)."""
    base_type = hcfg.base_model_type if hcfg.base_model_type in BASE_TYPES else "llama"
    tie = hcfg.tie_word_embeddings if hcfg.base_tie_word_embeddings is None else hcfg.base_tie_word_embeddings
    if hcfg.base_config_json:
        out = dict(hcfg.base_config_json)
        # what AMD's loader builds the base model from must be this model's (it is, unless edited since)
        out.update(vocab_size=hcfg.vocab_size, hidden_size=hcfg.hidden_size, num_hidden_layers=hcfg.n_layer,
                   rms_norm_eps=hcfg.rms_norm_eps, tie_word_embeddings=tie)
        return out
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}[base_type]
    theta = hcfg.rope_theta
    if hcfg.base_head_dim and hcfg.mla_layers:
        # the converter set rope_theta = theta ** (P / head_dim); config.json holds the base's theta
        theta = hcfg.rope_theta ** (hcfg.base_head_dim / (hcfg.qk_rope_head_dim // hcfg.rope_key_groups))
    return {
        "architectures": [arch], "model_type": base_type, "vocab_size": hcfg.vocab_size,
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size,
        "num_hidden_layers": hcfg.n_layer, "num_attention_heads": hcfg.num_attention_heads,
        "num_key_value_heads": hcfg.base_num_key_value_heads or hcfg.num_key_value_heads,
        "head_dim": hcfg.base_head_dim or hcfg.head_dim, "hidden_act": hcfg.hidden_act,
        "rms_norm_eps": hcfg.rms_norm_eps, "max_position_embeddings": hcfg.max_position_embeddings,
        "rope_theta": theta, "attention_bias": hcfg.attention_bias, "mlp_bias": False,
        "tie_word_embeddings": tie, "initializer_range": hcfg.initializer_range,
        "bos_token_id": hcfg.bos_token_id, "eos_token_id": hcfg.eos_token_id, "pad_token_id": hcfg.pad_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hylo_only_parts(hcfg: HybridConfig) -> list[str]:
    """What of this model AMD's public code cannot build (its HyLo branch, which can, is not public); empty when
    its public loader builds the whole model."""
    parts = []
    if hcfg.linear_layers and hcfg.linear_type == "gdn":
        parts.append(f"Gated DeltaNet linear layers ({len(hcfg.linear_layers)} of {hcfg.n_layer})")
    if hcfg.mla_layers and hcfg.mla_qk_norm:
        parts.append("per-head q/k RMSNorms in the MLA layers (a Qwen3 base)")
    return parts


def _their_ranks(hcfg: HybridConfig, where: str) -> tuple[int, int, bool]:
    """(kv_lora_rank, q_lora_rank, whole queries written as q_a_proj = identity) as AMD's HybridConfig accepts
    them (its __post_init__ asserts both ranks are multiples of qkv_rank_divisor, itself one of 8), or a
    refusal naming the conversion flag to change."""
    div = HYBRID_CONFIG_FIELDS["qkv_rank_divisor"]
    R, D = hcfg.kv_lora_rank, hcfg.hidden_size

    def near(r: int) -> str:
        lo, hi = r - r % div, r - r % div + div
        return f"{lo} or {hi}" if lo else str(hi)

    if not hcfg.mla_layers:
        # no MLA layer reads the ranks; their dataclass still checks them
        return (R if R % div == 0 else HYBRID_CONFIG_FIELDS["kv_lora_rank"]), (
            hcfg.q_lora_rank if hcfg.q_lora_rank is not None else HYBRID_CONFIG_FIELDS["q_lora_rank"]), False
    if R % div:
        raise ReleasedLayoutError(f"{where}: kv_lora_rank={R} is not a multiple of {div}: AMD's HybridConfig asserts "
                                  f"kv_lora_rank % qkv_rank_divisor == 0 ({AMD_AT}); convert with --kv-lora-rank "
                                  f"{near(R)}")
    if hcfg.q_lora_rank is not None:
        # ours are multiples of 8 already (HybridConfig's check)
        return R, hcfg.q_lora_rank, False
    # AMD's config cannot say "no query compression" (q_lora_rank: null is `None % 8`, a TypeError): whole queries
    # go out as q_b_proj = q_proj behind q_a_proj = the identity (exact, D x D more weights per MLA layer)
    why = ("its latent norms would normalise the identity's output" if hcfg.mla_latent_norm else
           "q_proj's bias has no place there (q_b_proj has none)" if hcfg.attention_bias else
           f"hidden_size {D} is not a multiple of {div}" if D % div else "")
    if why:
        raise ReleasedLayoutError(f"{where}: q_lora_rank is null (whole queries) and AMD's HybridConfig needs an integer "
                                  f"multiple of {div} ({AMD_AT}); writing the queries behind an identity q_a_proj is "
                                  f"not exact here ({why}): convert with --q-lora-rank N (a multiple of {div})")
    return R, D, True


def released_files(model: Any, xecomla: bool = False) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, hybrid_config.json, tensors) of `model` in the released layout; refuses what is not exact.

    hybrid_config.json holds exactly the fields of AMD's public HybridConfig (`HYBRID_CONFIG_FIELDS`, at
    `AMD_AT`) with values its __post_init__ accepts; a layout that code cannot build (`hylo_only_parts`: GDN
    layers, Qwen q/k norms) also carries HyLo's keys (`HYLO_KEYS`), which its dataclass refuses with a
    TypeError: loading fails loudly there instead of building other layers (a warning says so). `xecomla`:
    the part X-EcoMLA's export shares (its kv_b_proj is per query head anyway)."""
    hcfg: HybridConfig = model.config
    where = "export to the released layout"
    if hcfg.mla_layers and hcfg.rope_key_groups != 1:
        raise ReleasedLayoutError(f"{where}: rope_key_groups={hcfg.rope_key_groups}: the released MLA layers share one "
                                  f"roped key; convert with --rope-key-groups 1 to export")
    if hcfg.mlp_bias:
        raise ReleasedLayoutError(f"{where}: mlp_bias=true: the released MLP has no biases")
    if hcfg.mla_layers and hcfg.mla_latent_norm and not math.isclose(hcfg.latent_norm_eps, LATENT_NORM_EPS,
                                                                     rel_tol=1e-12):
        raise ReleasedLayoutError(f"{where}: the MLA latent norms use eps {hcfg.latent_norm_eps:g}; AMD's MLA layer fixes "
                                  f"it at {LATENT_NORM_EPS:g} ({AMD_AT}), so its outputs would differ. Convert with "
                                  f"--mla-latent-norm-eps {LATENT_NORM_EPS:g} (convert.mla_latent_norm_eps) to export "
                                  f"exactly")
    mamba = hcfg.linear_type == "mamba2" and bool(hcfg.linear_layers)
    mamba_keys = _mamba2_for_export(hcfg, where) if mamba else None
    R, q_rank, identity_q = _their_ranks(hcfg, where)
    H, N, P = hcfg.num_attention_heads, hcfg.qk_nope_head_dim, hcfg.qk_rope_head_dim
    inv = torch.argsort(interleaved_to_half_perm(P))
    mla = set(hcfg.mla_layers)
    full_kv: set[bool] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        m = LAYER_KEY.match(key)
        if m is None or m.group(2) != "mixer":
            tensors[key] = t
            continue
        i, rest = int(m.group(1)), m.group(3)
        if i in mla:
            if rest in ("q_proj.weight", "q_proj.bias", "q_b_proj.weight"):
                t = permute_q_rope(t, H, N, P, inv)
            elif rest in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                t = permute_kv_a(t, R, inv)
            elif rest == "kv_b_proj.weight":
                t, full = _kv_b_for_export(t, hcfg)
                full_kv.add(full)
            elif rest in QK_NORM_NAMES:
                t = permute_norm_rope(t, N, inv)
            name = released_name(key, mla)
            if identity_q and rest == "q_proj.weight":
                tensors[name.replace(".q_proj.", ".q_a_proj.")] = torch.eye(hcfg.hidden_size, dtype=t.dtype)
                name = name.replace(".q_proj.", ".q_b_proj.")
            tensors[name] = t.contiguous()
        else:
            tensors[released_name(key, mla, hcfg.linear_type)] = t
    # AMD's code always uses a head of its own (a tied one is written as a copy of the embeddings)
    if "lm_head.weight" not in tensors or hcfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    use_full_kv = any(full_kv)
    if use_full_kv and False in full_kv:
        # one layout for all layers: expand the per-KV-head layers to per query head (exact)
        G = hcfg.num_key_value_heads
        X = N + hcfg.v_head_dim
        for i in mla:
            k = f"model.layers.{i}.mla.kv_b_proj.weight"
            if tensors[k].shape[0] == G * X:
                tensors[k] = tensors[k].view(G, X, R).repeat_interleave(H // G, 0).reshape(H * X, R).contiguous()
    config_json = _config_json_for_export(hcfg, tensors["model.embed_tokens.weight"].dtype)
    dh = hcfg.base_head_dim or hcfg.head_dim
    hybrid_json = dict(HYBRID_CONFIG_FIELDS)
    hybrid_json.update({
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size, "hidden_act": hcfg.hidden_act,
        "n_layer": hcfg.n_layer, "mla_layers": list(hcfg.mla_layers), "rms_norm_eps": hcfg.rms_norm_eps,
        "num_attention_heads": H, "num_key_value_heads": hcfg.num_key_value_heads,
        "kv_lora_rank": R, "q_lora_rank": q_rank, "use_lora_layer_norm": hcfg.mla_latent_norm,
        "use_full_kv_head": use_full_kv,
        "qk_rope_head_dim": P, "v_head_dim": hcfg.v_head_dim, "qk_nope_head_dim": N,
        "max_position_embeddings": hcfg.max_position_embeddings,
        # AMD's MLA turns pair i at rope_theta ** (-2i / P) with this theta, as ours does
        "rope_theta": hcfg.rope_theta,
        "rope_scaling": their_rope_scaling_out(hcfg.rope_scaling, hcfg.max_position_embeddings),
        "attention_bias": hcfg.attention_bias,
        # Mamba-2 keys: this model's layers, or what AMD's training script derives from the base (unused)
        **(mamba_keys or {"d_model": hcfg.hidden_size, "d_inner": H * dh, "d_xb": hcfg.num_key_value_heads * dh,
                          "ssm_cfg": {"expand": 1, "ngroups": H, "d_state": dh, "repeat_kv_before_conv": False}}),
    })
    if hcfg.linear_layers and hcfg.linear_type == "gdn":
        hybrid_json.update(linear_type="gdn", gdn_num_heads=hcfg.gdn_num_heads, gdn_head_dim=hcfg.gdn_head_dim)
        for key, default in FLA_GDN_DEFAULTS.items():
            if getattr(hcfg, key) != default:
                hybrid_json[key] = getattr(hcfg, key)
    if hcfg.mla_layers and hcfg.mla_qk_norm:
        hybrid_json["use_qk_norm"] = True
    if use_full_kv and not INFERENCE_READS_FULL_KV_HEAD and not xecomla:
        warnings.warn(f"{where}: kv_b_proj rows no longer repeat within each KV group, so they are written per query "
                      f"head (use_full_kv_head: true): AMD's HybridModelWrapper reads that, their hybrid_inference "
                      f"wrapper ({AMD_AT}) does not (it builds kv_b_proj per KV head: a size mismatch there). "
                      f"Converting with --kv-b-per-kv-head keeps one block per KV head through training",
                      UserWarning, stacklevel=2)
    parts = hylo_only_parts(hcfg)
    if parts:
        keys = [k for k in HYLO_KEYS if k in hybrid_json]
        warnings.warn(f"{where}: AMD's public code ({AMD_AT}) cannot build this model's {' and '.join(parts)}; "
                      f"its hybrid_config.json carries {', '.join(keys)} (HyLo's keys), which their public "
                      f"HybridConfig refuses (TypeError), so that loader fails instead of building other layers. "
                      f"It loads in this project (load_hylo, --from-released) and in HyLo's own (non-public) code",
                      UserWarning, stacklevel=2)
    return config_json, hybrid_json, tensors


def export_released(model: Any, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Write `model` in the released layout, atomically (temporary directory renamed into place), after reading
    the written files back the way AMD's loader does (`check_released_dir`); X-EcoMLA's layout is
    `hylo.released_xecomla.export_xecomla`."""

    config_json, hybrid_json, tensors = released_files(model)
    return write_checked_layout(out_dir, model, tensors, {"config.json": (config_json, 2),
                                                          HYBRID_CONFIG_NAME: (hybrid_json, 4)},
                                check_released_dir, tokenizer_from)


def write_checked_layout(out_dir: str | Path, model: Any, tensors: dict[str, torch.Tensor],
                         json_files: dict[str, tuple[dict[str, Any], int]], check: Callable[[Path], Any],
                         tokenizer_from: str | Path | None) -> Path:
    """One released layout's files, atomically: `model.safetensors`, each JSON file (name -> (content,
    indent)), read back by `check` as the other project's loader would before anything is in place (its
    error names `out_dir`), then the model's generation config and the tokenizer files."""
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, (content, indent) in json_files.items():
            (tmp / name).write_text(json.dumps(content, indent=indent))
        try:
            check(tmp)
        except ReleasedLayoutError as e:
            raise ReleasedLayoutError(str(e).replace(str(tmp), str(out))) from None
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
    return out
