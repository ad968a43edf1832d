"""Import and export of the released checkpoint layout (AMD's Hybrid-Models code, the HyLo / Zebra-Llama cards).

A released checkpoint directory holds:
* `config.json`: the base model's config; the vocabulary, bos/eos/pad ids, `tie_word_embeddings`, the MLP
  activation and bias come from here (AMD's hybrid config has no such keys);
* `hybrid_config.json` with AMD's keys: `n_layer`, `mla_layers`, `num_attention_heads`,
  `num_key_value_heads`, `kv_lora_rank`, `q_lora_rank`, `qk_rope_head_dim`, `qk_nope_head_dim`,
  `v_head_dim`, `use_lora_layer_norm`, `use_full_kv_head`, `rope_theta`, `rope_scaling`,
  `max_position_embeddings`, `attention_bias`, `rms_norm_eps`, ... (plus Mamba keys we do not use);
* safetensors whose keys are those of a Llama causal LM whose layers hold their mixer under `mla.`
  (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
  `kv_b_proj`, `out_proj`) or, for Gated DeltaNet layers, `gdn.` with flash-linear-attention's names
  (the same as ours).

How it differs from ours, and why each mapping is exact:
* names: `mixer.*` here, `mla.*` / `gdn.*` there; `o_proj` here, `out_proj` there.
* `kv_b_proj`: there one block of (nope-key, value) rows per KV head, each query head reading its
  group's block (`repeat_kv`), unless `use_full_kv_head` (one block per query head). Ours supports both
  natively (`kv_b_per_kv_head`), so an import copies the rows as they are. An export writes per KV head
  when our per-query-head rows repeat within each group, and `use_full_kv_head: true` otherwise.
* RoPE: DeepSeek / AMD rotate interleaved pairs (dims 2i, 2i+1), we rotate halves (dims i, i + P/2).
  Pair i turns at the same frequency in both, so permuting the rope rows of the query heads and of the
  shared key (`k_pe`) maps one onto the other exactly.
* The latent RMSNorms (`use_lora_layer_norm`) use eps 1e-6 there: imported as `mla_latent_norm_eps`.
* YaRN: the same frequencies and softmax scale; the cos/sin magnitude is `mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)` there, written as an explicit `attention_factor` on import.

GDN dimensions are read from the tensors' shapes (AMD's public code has no GDN layer, so no config key
is relied upon). Mamba-2 layers (`mamba.*`, AMD's d_xb variant) are not supported. Nothing is unpickled:
a directory with only `pytorch_model.bin` is refused.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from hylo.config import HYBRID_CONFIG_NAME, HybridConfig, HybridConfigError
from hylo.files import atomic_dir, read_json

# hybrid_config.json keys that only AMD's Hybrid-Models code writes (ours never does)
AMD_ONLY_KEYS = ("use_lora_layer_norm", "use_full_kv_head", "qkv_rank_divisor", "ssm_cfg", "d_xb", "d_inner",
                 "d_model", "attention_dropout")
# AMD's latent norms: DeepseekV3RMSNorm with its default eps
AMD_LATENT_NORM_EPS = 1e-6
# what AMD's config supplies when a key is absent (their HybridConfig dataclass / YaRN defaults)
AMD_DEFAULTS = {"use_lora_layer_norm": False, "use_full_kv_head": False, "attention_bias": False,
                "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
YARN_DEFAULT_ORIGINAL = 4096
LINEAR_PREFIXES = ("gdn", "linear_attn")
BASE_TYPES = ("llama", "qwen3", "qwen2", "mistral")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.([A-Za-z_]+)\.(.+)$")
_SHARED_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")


class ReleasedLayoutError(ValueError):
    """A released-layout checkpoint cannot be imported, or a model cannot be exported to that layout exactly."""


# ---------------------------------------------------------------------------------------------- detection
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReleasedLayoutError(f"{path} does not exist")
    return read_json(path, ReleasedLayoutError, mapping=True)


def is_released_layout(path: str | Path) -> bool:
    """True when `path/hybrid_config.json` was written by AMD's code (their keys, no `model_type: hylo`)."""
    p = Path(path) / HYBRID_CONFIG_NAME
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("model_type") != "hylo" and any(k in data for k in AMD_ONLY_KEYS)


# ---------------------------------------------------------------------------------------------- rope rows
def interleaved_to_half_perm(P: int) -> torch.Tensor:
    """Row order taking an interleaved rope block (pairs 2i, 2i+1) to rotate-half (pairs i, i + P/2):
    `ours = theirs[perm]`."""
    return torch.cat([torch.arange(0, P, 2), torch.arange(1, P, 2)])


def _permute_q_rope(w: torch.Tensor, H: int, N: int, P: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the rope rows of every query head of a [H * (N + P), ...] weight or bias."""
    rest = w.shape[1:]
    w_H = w.reshape(H, N + P, *rest)
    return torch.cat([w_H[:, :N], w_H[:, N:][:, perm]], dim=1).reshape(H * (N + P), *rest)


def _permute_kv_a(w: torch.Tensor, R: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the k_pe rows (after the R latent rows) of kv_a_proj_with_mqa's weight or bias."""
    return torch.cat([w[:R], w[R:][perm]], dim=0)


# ---------------------------------------------------------------------------------------------- reading
def read_released_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files (a sharded index is checked for missing shards)."""
    from safetensors import safe_open

    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
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
                for k in sf.keys():
                    if k in tensors:
                        raise ReleasedLayoutError(f"{p}: tensor {k!r} appears in more than one file ({f.name})")
                    tensors[k] = sf.get_tensor(k)
        except ReleasedLayoutError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
            raise ReleasedLayoutError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return tensors


def _their_rope_scaling(rs: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
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


def released_hybrid_config(path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> HybridConfig:
    """Our HybridConfig for a released directory (base config.json + AMD's hybrid_config.json + tensor shapes)."""
    p = Path(path)
    base = _read_json(p / "config.json")
    hyb = _read_json(p / HYBRID_CONFIG_NAME)
    where = str(p / HYBRID_CONFIG_NAME)
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
    n_layer = int(hyb["n_layer"])
    mla = sorted(int(i) for i in hyb.get("mla_layers") or [])
    linear_kw: dict[str, Any] = {}
    linear_layers = [i for i in range(n_layer) if i not in set(mla)]
    if linear_layers:
        tensors = tensors if tensors is not None else read_released_tensors(p)
        prefixes = sorted({m.group(2) for k in tensors if (m := _LAYER_KEY.match(k)) and int(m.group(1)) in linear_layers
                           and m.group(2) not in _SHARED_LAYER_PARTS})
        if "mamba" in prefixes:
            raise ReleasedLayoutError(f"{p}: Mamba-2 layers (`mamba.*`, AMD's d_xb variant) cannot be imported; "
                                      f"only MLA and Gated DeltaNet (`gdn.*`) layers are supported")
        unknown = [x for x in prefixes if x not in LINEAR_PREFIXES]
        if unknown or not prefixes:
            raise ReleasedLayoutError(f"{p}: the non-MLA layers {linear_layers[:6]} hold mixers named "
                                      f"{unknown or 'nothing'}; expected one of {', '.join(LINEAR_PREFIXES)}")
        i0 = linear_layers[0]
        linear_kw = _linear_dims(tensors, f"model.layers.{i0}.{prefixes[0]}", str(p))
        for key in ("gdn_num_heads", "gdn_head_dim", "gdn_expand_v", "gdn_conv_size"):
            if key in hyb and hyb[key] != linear_kw[key]:
                raise ReleasedLayoutError(f"{where}: {key}={hyb[key]} but the layer {i0} tensors give {linear_kw[key]}")
    eps = hyb.get("rms_norm_eps", base.get("rms_norm_eps", AMD_DEFAULTS["rms_norm_eps"]))
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
            q_lora_rank=hyb.get("q_lora_rank"),
            qk_rope_head_dim=hyb["qk_rope_head_dim"],
            qk_nope_head_dim=hyb["qk_nope_head_dim"],
            rope_key_groups=1,
            mla_latent_norm=bool(hyb.get("use_lora_layer_norm", AMD_DEFAULTS["use_lora_layer_norm"])),
            mla_latent_norm_eps=AMD_LATENT_NORM_EPS,
            kv_b_per_kv_head=not full_kv and g != hyb["num_attention_heads"],
            v_head_dim=hyb["v_head_dim"],
            max_position_embeddings=hyb.get("max_position_embeddings", AMD_DEFAULTS["max_position_embeddings"]),
            rope_theta=hyb.get("rope_theta", AMD_DEFAULTS["rope_theta"]),
            rope_scaling=_their_rope_scaling(hyb.get("rope_scaling"), where),
            attention_bias=bool(hyb.get("attention_bias", AMD_DEFAULTS["attention_bias"])),
            mlp_bias=bool(base.get("mlp_bias", False)),
            linear_type="gdn",
            **linear_kw,
            initializer_range=base.get("initializer_range", 0.02),
            tie_word_embeddings=bool(base.get("tie_word_embeddings", False)),
            base_model_type=mt,
            pad_token_id=base.get("pad_token_id"),
            bos_token_id=base.get("bos_token_id"),
            eos_token_id=base.get("eos_token_id"),
        )
    except HybridConfigError as e:
        raise ReleasedLayoutError(f"{p}: {e}") from None


# ---------------------------------------------------------------------------------------------- names
def released_name(key: str, mla_layers: set[int] | list[int]) -> str:
    """The released layout's name of one of our state-dict keys."""
    m = _LAYER_KEY.match(key)
    if m is None or m.group(2) != "mixer":
        return key
    i, rest = int(m.group(1)), m.group(3)
    if i in set(mla_layers):
        rest = "out_proj." + rest.removeprefix("o_proj.") if rest.startswith("o_proj.") else rest
        return f"model.layers.{i}.mla.{rest}"
    return f"model.layers.{i}.gdn.{rest}"


# ---------------------------------------------------------------------------------------------- import
def released_to_state_dict(tensors: dict[str, torch.Tensor], hcfg: HybridConfig, where: str = "",
                           origin: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Rename and permute released tensors into our state-dict layout (no tensor left over, none invented).

    `origin`, when given, receives {our key: the file's key} for error messages."""
    H, N, P, R = hcfg.num_attention_heads, hcfg.qk_nope_head_dim, hcfg.qk_rope_head_dim, hcfg.kv_lora_rank
    perm = interleaved_to_half_perm(P)
    mla = set(hcfg.mla_layers)
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, t in tensors.items():
        m = _LAYER_KEY.match(key)
        if m is None:
            if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                out[key] = t
            else:
                unknown.append(key)
            continue
        i, part, rest = int(m.group(1)), m.group(2), m.group(3)
        if part in _SHARED_LAYER_PARTS:
            out[key] = t
        elif part == "mla" and i in mla:
            name = "o_proj." + rest.removeprefix("out_proj.") if rest.startswith("out_proj.") else rest
            if name in ("q_proj.weight", "q_proj.bias", "q_b_proj.weight"):
                t = _permute_q_rope(t, H, N, P, perm)
            elif name in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                t = _permute_kv_a(t, R, perm)
            out[f"model.layers.{i}.mixer.{name}"] = t
            if origin is not None:
                origin[f"model.layers.{i}.mixer.{name}"] = key
        elif part in LINEAR_PREFIXES and i not in mla:
            out[f"model.layers.{i}.mixer.{rest}"] = t
            if origin is not None:
                origin[f"model.layers.{i}.mixer.{rest}"] = key
        else:
            unknown.append(key)
    if unknown:
        raise ReleasedLayoutError(f"{where}: {len(unknown)} tensor(s) have no place in the model its config "
                                  f"describes: {', '.join(sorted(unknown)[:8])}")
    return out


def load_released(path: str | Path, dtype: torch.dtype | None = None) -> Any:
    """A released-layout directory as a `HyLoForCausalLM` (strict: every tensor used, none missing)."""
    from hylo.modeling import HyLoForCausalLM

    p = Path(path)
    tensors = read_released_tensors(p)
    hcfg = released_hybrid_config(p, tensors)
    origin: dict[str, str] = {}
    sd = released_to_state_dict(tensors, hcfg, str(p), origin)
    embed = sd.get("model.embed_tokens.weight")
    if hcfg.tie_word_embeddings and "lm_head.weight" in sd:
        if embed is None or not torch.equal(sd["lm_head.weight"], embed):
            raise ReleasedLayoutError(f"{p}: config.json ties the LM head to the embeddings "
                                      f"(tie_word_embeddings: true) but lm_head.weight differs from them")
        del sd["lm_head.weight"]
    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    expected = {k for k in model.state_dict() if not (hcfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or extra:
        lines = ([f"missing: {released_name(k, hcfg.mla_layers)}" for k in missing[:8]]
                 + [f"unexpected: {origin.get(k, k)}" for k in extra[:8]])
        raise ReleasedLayoutError(f"{p}: the tensors do not match the model its configs describe:\n  " + "\n  ".join(lines))
    own = model.state_dict()
    bad = [f"{origin.get(k, k)} (ours: {k}): file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
           for k, v in sd.items() if v.shape != own[k].shape]
    if bad:
        raise ReleasedLayoutError(f"{p}: tensor shapes do not match the configs:\n  " + "\n  ".join(bad[:8]))
    target = dtype or next(iter(sd.values())).dtype
    model.load_state_dict({k: v.to(target) for k, v in sd.items()}, strict=not hcfg.tie_word_embeddings, assign=True)
    if hcfg.tie_word_embeddings:
        model.tie_weights()
    gen = p / "generation_config.json"
    if gen.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(p)
    return model.eval()


# ---------------------------------------------------------------------------------------------- export
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


def _their_rope_scaling_out(rs: dict[str, Any] | None, max_pos: int) -> dict[str, Any] | None:
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
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
           "beta_fast": float(rs.get("beta_fast") or 32), "beta_slow": float(rs.get("beta_slow") or 1)}
    for key in ("mscale", "mscale_all_dim"):
        if rs.get(key) is not None:
            out[key] = float(rs[key])
    # what their code will compute for the cos/sin magnitude must be what ours uses
    ours = _their_rope_scaling(out, "export")["attention_factor"]
    from hylo.layers.rope import rope_parameters

    _, mine = rope_parameters(2, 10000.0, rs, max_pos)
    if not math.isclose(ours, mine, rel_tol=1e-12):
        raise ReleasedLayoutError(f"rope_scaling {rs}: its attention factor {mine} cannot be expressed in the "
                                  f"released layout (which would use {ours})")
    return out


def released_files(model: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, hybrid_config.json, tensors) of `model` in the released layout; refuses what is not exact."""
    hcfg: HybridConfig = model.config
    where = "export to the released layout"
    if hcfg.linear_type != "gdn" and hcfg.linear_layers:
        raise ReleasedLayoutError(f"{where}: linear_type={hcfg.linear_type!r}: only Gated DeltaNet linear layers "
                                  f"can be exported (AMD's Mamba-2 layers have another structure)")
    if hcfg.mla_layers and hcfg.rope_key_groups != 1:
        raise ReleasedLayoutError(f"{where}: rope_key_groups={hcfg.rope_key_groups}: the released MLA layers share one "
                                  f"roped key; convert with --rope-key-groups 1 to export")
    if hcfg.mlp_bias:
        raise ReleasedLayoutError(f"{where}: mlp_bias=true: the released MLP has no biases")
    if hcfg.mla_layers and hcfg.mla_latent_norm and not math.isclose(hcfg.latent_norm_eps, AMD_LATENT_NORM_EPS):
        warnings.warn(f"{where}: the MLA latent norms use eps {hcfg.latent_norm_eps}; AMD's code uses "
                      f"{AMD_LATENT_NORM_EPS}, so its outputs will differ slightly", UserWarning, stacklevel=2)
    H, N, P, R = hcfg.num_attention_heads, hcfg.qk_nope_head_dim, hcfg.qk_rope_head_dim, hcfg.kv_lora_rank
    inv = torch.argsort(interleaved_to_half_perm(P))
    mla = set(hcfg.mla_layers)
    full_kv: set[bool] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        if key == "lm_head.weight" and hcfg.tie_word_embeddings:
            continue
        m = _LAYER_KEY.match(key)
        if m is None or m.group(2) != "mixer":
            tensors[key] = t
            continue
        i, rest = int(m.group(1)), m.group(3)
        if i in mla:
            if rest in ("q_proj.weight", "q_proj.bias", "q_b_proj.weight"):
                t = _permute_q_rope(t, H, N, P, inv)
            elif rest in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                t = _permute_kv_a(t, R, inv)
            elif rest == "kv_b_proj.weight":
                t, full = _kv_b_for_export(t, hcfg)
                full_kv.add(full)
            tensors[released_name(key, mla)] = t.contiguous()
        else:
            tensors[released_name(key, mla)] = t
    use_full_kv = any(full_kv)
    if use_full_kv and False in full_kv:
        # one layout for all layers: expand the per-KV-head layers to per query head (exact)
        G = hcfg.num_key_value_heads
        X = N + hcfg.v_head_dim
        for i in mla:
            k = f"model.layers.{i}.mla.kv_b_proj.weight"
            if tensors[k].shape[0] == G * X:
                tensors[k] = tensors[k].view(G, X, R).repeat_interleave(H // G, 0).reshape(H * X, R).contiguous()
    base_type = hcfg.base_model_type if hcfg.base_model_type in BASE_TYPES else "llama"
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM"}[base_type]
    config_json = {
        "architectures": [arch], "model_type": base_type, "vocab_size": hcfg.vocab_size,
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size,
        "num_hidden_layers": hcfg.n_layer, "num_attention_heads": H,
        "num_key_value_heads": hcfg.base_num_key_value_heads or hcfg.num_key_value_heads,
        "head_dim": hcfg.base_head_dim or hcfg.head_dim, "hidden_act": hcfg.hidden_act,
        "rms_norm_eps": hcfg.rms_norm_eps, "max_position_embeddings": hcfg.max_position_embeddings,
        "rope_theta": hcfg.rope_theta, "attention_bias": hcfg.attention_bias, "mlp_bias": False,
        "tie_word_embeddings": hcfg.tie_word_embeddings, "initializer_range": hcfg.initializer_range,
        "bos_token_id": hcfg.bos_token_id, "eos_token_id": hcfg.eos_token_id, "pad_token_id": hcfg.pad_token_id,
        "torch_dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
    }
    hybrid_json = {
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size, "hidden_act": hcfg.hidden_act,
        "n_layer": hcfg.n_layer, "mla_layers": list(hcfg.mla_layers), "rms_norm_eps": hcfg.rms_norm_eps,
        "num_attention_heads": H, "num_key_value_heads": hcfg.num_key_value_heads,
        "kv_lora_rank": R, "q_lora_rank": hcfg.q_lora_rank, "use_lora_layer_norm": hcfg.mla_latent_norm,
        "use_full_kv_head": use_full_kv, "qk_rope_head_dim": P, "v_head_dim": hcfg.v_head_dim,
        "qk_nope_head_dim": N, "qkv_rank_divisor": 8, "max_position_embeddings": hcfg.max_position_embeddings,
        "rope_theta": hcfg.rope_theta,
        "rope_scaling": _their_rope_scaling_out(hcfg.rope_scaling, hcfg.max_position_embeddings),
        "attention_bias": hcfg.attention_bias, "attention_dropout": 0.0, "rope_type": "yarn",
    }
    return config_json, hybrid_json, tensors


def export_released(model: Any, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Write `model` in the released layout, atomically (temporary directory renamed into place)."""
    from safetensors.torch import save_file

    from hylo.io import copy_tokenizer_files

    config_json, hybrid_json, tensors = released_files(model)
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
        (tmp / HYBRID_CONFIG_NAME).write_text(json.dumps(hybrid_json, indent=4))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(tmp)
        if tokenizer_from is not None:
            copy_tokenizer_files(tokenizer_from, tmp)
    return out
