"""Import and export of the released checkpoint layout (AMD's Hybrid-Models code, the HyLo / Zebra-Llama cards).

A released checkpoint directory holds:
* `config.json`: the base model's config, copied as it was; the vocabulary, bos/eos/pad ids, the MLP
  activation and bias come from here (AMD's hybrid config has no such keys). Its `tie_word_embeddings` does
  not tie anything there: AMD's `CustomLlamaForCausalLM` replaces the inner model after the head was tied,
  so `lm_head.weight` is always stored and always used as it is;
* `hybrid_config.json`: `asdict` of AMD's `HybridConfig` dataclass (every field written, read back as
  `HybridConfig(**json)`: a missing key takes its default, an unknown one is a TypeError; the fields, defaults
  and asserts of the public version are in hylo/released_facts.py with the commit they were read at):
  `n_layer`, `mla_layers`, the MLA shapes (`kv_lora_rank`, `q_lora_rank`, `qk_*_head_dim`, `v_head_dim`,
  `use_lora_layer_norm`, `use_full_kv_head`, ...), RoPE (`rope_theta`, `rope_scaling`), the Mamba-2 shapes
  (`d_model`, `d_inner`, `d_xb`, `ssm_cfg`); older versions also wrote `layer_rank_list` and three more (read
  here, never written), and HyLo's own layouts add `linear_type`, `gdn_num_heads`, `gdn_head_dim` (GDN) and
  our `use_qk_norm` (Qwen q/k norms), which the public dataclass refuses;
* safetensors whose keys are those of a Llama causal LM whose layers hold their mixer under `mla.`
  (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
  `kv_b_proj`, `out_proj`, and on Qwen HyLo models per-head `q_norm` / `k_norm`), `gdn.` with
  flash-linear-attention's names (the same as ours), or `mamba.` (Zebra-Llama's Mamba-2: `in_proj` rows
  `[z | x | B | C | dt]`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).

How it differs from ours, and why each mapping is exact:
* names: `mixer.*` here, `mla.*` / `gdn.*` / `mamba.*` there; `o_proj` here, `out_proj` there.
* `kv_b_proj`: there one block of (nope-key, value) rows per KV head, each query head reading its
  group's block (`repeat_kv`), unless `use_full_kv_head` (one block per query head). Ours supports both
  natively (`kv_b_per_kv_head`), so an import copies the rows as they are. An export writes per KV head
  when our per-query-head rows repeat within each group, and `use_full_kv_head: true` otherwise.
* RoPE: DeepSeek / AMD rotate interleaved pairs (dims 2i, 2i+1), we rotate halves (dims i, i + P/2).
  Pair i turns at the same frequency in both, so permuting the rope rows of the query heads and of the
  shared key (`k_pe`), and the rope part of the q/k norm weights, maps one onto the other exactly. Both
  codes turn pair i at `rope_theta ** (-2i / P)` with the theta of hybrid_config.json (AMD's MLA reads
  `HybridConfig.rope_theta`, not config.json's): our converter's theta (the base's `theta ** (P / head_dim)`,
  which keeps the base's highest-frequency pairs) is written there as it is, and a released model's theta
  (the base's own, applied to P dims) is imported as it is, so positions match both ways.
* The latent RMSNorms (`use_lora_layer_norm`) use eps 1e-6 there: imported as `mla_latent_norm_eps`.
* YaRN: the same frequencies and softmax scale; the cos/sin magnitude is `mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)` there, written as an explicit `attention_factor` on import.
* Mamba-2 (AMD's variant of mamba_ssm's layer): `nheads = ngroups`, `headdim = d_state`, C per head,
  x and B projected for `d_xb / d_state` groups and repeated to the heads after the conv (GQA's rule), the
  gated norm per head with eps 1e-5. Ours holds that natively (`mamba2_xb_groups`, `mamba2_n_groups =
  heads`, `mamba2_norm_eps`); `repeat_kv_before_conv: true` (conv over the repeated channels) imports
  exactly as x/B rows repeated per head.

GDN dimensions are read from the tensors' shapes and checked against `gdn_*` keys where present. Nothing
is unpickled: a directory with only `pytorch_model.bin` is refused. `check_released_dir` reads a written
directory back the way AMD's public loader does (its fields, defaults and asserts at the pinned commit, then
the module tree their code builds, tensor names matched one by one as `load_state_dict(strict=False)` would)
and names every tensor that would be dropped, left at its random init, or refused for its shape; the export
runs it on its own output. X-EcoMLA's layout (MLA_config.json + mla_layer_config.json) is
hylo/released_xecomla.py (which builds on this module; `hylo.io.load_hylo` and the convert job pick the
layout); bench/amd_compat.py checks both against AMD's real code.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hylo.config import HYBRID_CONFIG_NAME, HybridConfig, HybridConfigError
from hylo.files import atomic_dir, copy_tokenizer_files, read_json
from hylo.model_files import check_finite_tensors, check_layer_indices, check_model_config
from hylo.released_facts import (
    AMD_AT,
    HYBRID_CONFIG_FIELDS,
    HYBRID_CONFIG_REMOVED,
    INFERENCE_READS_FULL_KV_HEAD,
    LATENT_NORM_EPS,
    MAMBA2_ARGS,
    MAMBA2_ARGS_NO_MATH,
    MAMBA_GATED_NORM_EPS,
    YARN_DEFAULT_ORIGINAL,
    hybrid_config_refusal,
)

# hybrid_config.json keys that only AMD's Hybrid-Models code writes (ours never does)
AMD_ONLY_KEYS = ("use_lora_layer_norm", "use_full_kv_head", "qkv_rank_divisor", "ssm_cfg", "d_xb", "d_inner",
                 "d_model", "attention_dropout")
# what the import reads: the public fields and those of older versions, at their defaults when absent
AMD_READ_DEFAULTS: dict[str, Any] = {**HYBRID_CONFIG_FIELDS, **HYBRID_CONFIG_REMOVED}
# the keys of HyLo's layouts that AMD's public code cannot build (its HyLo branch is not public): GDN linear
# layers (written: the first three always, the others where they differ from flash-linear-attention's
# GatedDeltaNet defaults, FLA_GDN_DEFAULTS) and the q/k norms of Qwen MLA layers (`use_qk_norm`, our name).
# Not fields of the public HybridConfig: an export that needs them is refused there (TypeError), never
# built as something else
HYLO_KEYS = ("linear_type", "gdn_num_heads", "gdn_head_dim", "gdn_expand_v", "gdn_conv_size", "use_qk_norm")
FLA_GDN_DEFAULTS = {"gdn_expand_v": 2.0, "gdn_conv_size": 4}
# what AMD's config supplies when a key is absent (the import's subset of the dataclass defaults)
AMD_DEFAULTS = {k: HYBRID_CONFIG_FIELDS[k] for k in ("use_lora_layer_norm", "use_full_kv_head", "attention_bias",
                                                      "rope_theta", "max_position_embeddings", "rms_norm_eps")}
# of AMD's Mamba2 arguments (MAMBA2_ARGS), those our layer holds only the defaults of
MAMBA2_FIXED = ("D_has_hdim", "rmsnorm", "norm_before_gate", "dt_limit", "bias", "conv_bias", "d_ssm")
# the ssm_cfg AMD's training script writes (Zebra-Llama/train_hybrid/train_distill.py)
AMD_SSM_CFG_KEYS = ("expand", "ngroups", "d_state", "repeat_kv_before_conv")
LINEAR_PREFIXES = ("gdn", "linear_attn")
MAMBA_PREFIX = "mamba"
LINEAR_TYPE_NAMES = {"gdn": ("gdn", "gated_deltanet", "gdn2"), "mamba2": ("mamba2", "mamba", "m2")}
BASE_TYPES = ("llama", "qwen3", "qwen2", "mistral")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.([A-Za-z_]+)\.(.+)$")
_SHARED_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
# where a Qwen HyLo MLA layer's per-head q/k RMSNorm weights may sit (their names are not public): Qwen3's own
# names under the mixer's prefix, or under Qwen3's attention prefix
QK_NORM_PARTS = ("mla", "self_attn")
QK_NORM_NAMES = ("q_norm.weight", "k_norm.weight")


class ReleasedLayoutError(ValueError):
    """A released-layout checkpoint cannot be imported, or a model cannot be exported to that layout exactly."""


# ---------------------------------------------------------------------------------------------- detection
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReleasedLayoutError(f"{path} does not exist")
    return read_json(path, ReleasedLayoutError, mapping=True)


def is_released_layout(path: str | Path) -> bool:
    """True when `path/hybrid_config.json` was written by AMD's code (their keys, no `model_type: hylo`); X-EcoMLA
    checkpoints (MLA_config.json + mla_layer_config.json) are `hylo.released_xecomla.is_xecomla_layout`."""
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


def _collapse_identity_q(tensors: dict[str, torch.Tensor], hyb: dict[str, Any], mla: list[int],
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


def _permute_norm_rope(w: torch.Tensor, N: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the rope part (after the N nope entries) of a per-head [nope | rope] norm weight."""
    return torch.cat([w[:N], w[N:][perm]])


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
    base = _read_json(p / "config.json")
    hyb = _read_json(p / HYBRID_CONFIG_NAME)
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
    if _collapse_identity_q(tensors, hyb, mla, q_rank):
        # our export of whole queries (q_a_proj = identity): imported as the q_proj it stands for
        q_rank = None
    linear_kw: dict[str, Any] = {}
    linear_type = "gdn"
    linear_layers = [i for i in range(n_layer) if i not in set(mla)]
    if linear_layers:
        prefixes = sorted({m.group(2) for k in tensors if (m := _LAYER_KEY.match(k)) and int(m.group(1)) in linear_layers
                           and m.group(2) not in _SHARED_LAYER_PARTS})
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
            rope_scaling=_their_rope_scaling(hyb.get("rope_scaling"), where),
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


# ---------------------------------------------------------------------------------------------- names
def released_name(key: str, mla_layers: set[int] | list[int], linear_type: str = "gdn") -> str:
    """The released layout's name of one of our state-dict keys."""
    m = _LAYER_KEY.match(key)
    if m is None or m.group(2) != "mixer":
        return key
    i, rest = int(m.group(1)), m.group(3)
    if i in set(mla_layers):
        rest = "out_proj." + rest.removeprefix("o_proj.") if rest.startswith("o_proj.") else rest
        return f"model.layers.{i}.mla.{rest}"
    return f"model.layers.{i}.{MAMBA_PREFIX if linear_type == 'mamba2' else 'gdn'}.{rest}"


# ---------------------------------------------------------------------------------------------- import
def _repeat_xb_rows(w: torch.Tensor, hcfg: HybridConfig, d_xb: int) -> torch.Tensor:
    """in_proj rows [z | x (d_xb) | B (d_xb) | C | dt] with x and B repeated per head (repeat_kv_before_conv)."""
    H, P, N, _ = hcfg.mamba2_dims
    E = H * P
    z, x, b, rest = w.split([E, d_xb, d_xb, w.shape[0] - E - 2 * d_xb])
    rep = H // (d_xb // N)
    return torch.cat([z, x.unflatten(0, (-1, P)).repeat_interleave(rep, 0).flatten(0, 1),
                      b.unflatten(0, (-1, N)).repeat_interleave(rep, 0).flatten(0, 1), rest])


def _check_rows(t: torch.Tensor, rows: int, key: str, what: str, where: str) -> None:
    """A tensor whose rows are permuted by the configs' shapes must have those rows (else an IndexError)."""
    if t.dim() == 0 or t.shape[0] != rows:
        raise ReleasedLayoutError(f"{where}: {key} has shape {tuple(t.shape)} but the configs give {rows} rows "
                                  f"({what})")


def released_to_state_dict(tensors: dict[str, torch.Tensor], hcfg: HybridConfig, where: str = "",
                           origin: dict[str, str] | None = None, d_xb: int | None = None) -> dict[str, torch.Tensor]:
    """Rename and permute released tensors into our state-dict layout (no tensor left over, none invented).

    `origin`, when given, receives {our key: the file's key} for error messages; `d_xb`, for Mamba-2 layers
    written with `repeat_kv_before_conv`, repeats their x/B rows to the heads."""
    H, N, P, R = hcfg.num_attention_heads, hcfg.qk_nope_head_dim, hcfg.qk_rope_head_dim, hcfg.kv_lora_rank
    perm = interleaved_to_half_perm(P)
    mla = set(hcfg.mla_layers)
    linear_parts = (MAMBA_PREFIX,) if hcfg.linear_type == "mamba2" else LINEAR_PREFIXES
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
            continue
        if i in mla and (part == "mla" or (part in QK_NORM_PARTS and rest in QK_NORM_NAMES)):
            name = "o_proj." + rest.removeprefix("out_proj.") if rest.startswith("out_proj.") else rest
            if name in ("q_proj.weight", "q_proj.bias", "q_b_proj.weight"):
                _check_rows(t, H * (N + P), key, f"num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim) = "
                                                 f"{H} * ({N} + {P})", where)
                t = _permute_q_rope(t, H, N, P, perm)
            elif name in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                _check_rows(t, R + P, key, f"kv_lora_rank + qk_rope_head_dim = {R} + {P}", where)
                t = _permute_kv_a(t, R, perm)
            elif name in QK_NORM_NAMES:
                if f"model.layers.{i}.mixer.{name}" in out:
                    raise ReleasedLayoutError(f"{where}: layer {i} holds {name} under both "
                                              f"{' and '.join(QK_NORM_PARTS)}")
                t = _permute_norm_rope(t, N, perm)
        elif part in linear_parts and i not in mla:
            name = rest
            if part == MAMBA_PREFIX and name == "in_proj.weight" and d_xb is not None:
                t = _repeat_xb_rows(t, hcfg, d_xb)
        else:
            unknown.append(key)
            continue
        out[f"model.layers.{i}.mixer.{name}"] = t
        if origin is not None:
            origin[f"model.layers.{i}.mixer.{name}"] = key
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
    d_xb = None
    if hcfg.linear_type == "mamba2" and hcfg.linear_layers:
        m2 = their_mamba2(_read_json(p / HYBRID_CONFIG_NAME), str(p / HYBRID_CONFIG_NAME))
        d_xb = m2["d_xb"] if m2["repeat_before_conv"] and m2["xb_groups"] != m2["heads"] else None
    origin: dict[str, str] = {}
    sd = released_to_state_dict(tensors, hcfg, str(p), origin, d_xb)
    if hcfg.tie_word_embeddings:
        # tied (config.json says so and any stored head equals the embeddings)
        sd.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = HyLoForCausalLM(hcfg)
    expected = {k for k in model.state_dict() if not (hcfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or extra:
        lines = ([f"missing: {released_name(k, hcfg.mla_layers, hcfg.linear_type)}" for k in missing[:8]]
                 + [f"unexpected: {origin.get(k, k)}" for k in extra[:8]])
        raise ReleasedLayoutError(f"{p}: the tensors do not match the model its configs describe:\n  " + "\n  ".join(lines))
    own = model.state_dict()
    bad = [f"{origin.get(k, k)} (ours: {k}): file {tuple(v.shape)} vs model {tuple(own[k].shape)}"
           for k, v in sd.items() if v.shape != own[k].shape]
    if bad:
        raise ReleasedLayoutError(f"{p}: tensor shapes do not match the configs:\n  " + "\n  ".join(bad[:8]))
    return load_checked_tensors(model, sd, hcfg, p, dtype)


def load_checked_tensors(model: Any, sd: dict[str, torch.Tensor], hcfg: HybridConfig, p: Path,
                         dtype: torch.dtype | None) -> Any:
    """`model` given the checked tensors `sd` (cast to `dtype`, default the file's), its head tied when the
    config says so, the directory's generation config: the end of an import of either released layout."""
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
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    # DeepSeek's defaults (32, 1) are left out, as AMD's training script writes rope_scaling
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        if rs.get(key) is not None and float(rs[key]) != default:
            out[key] = float(rs[key])
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
            elif rest in QK_NORM_NAMES:
                t = _permute_norm_rope(t, N, inv)
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
        "rope_scaling": _their_rope_scaling_out(hcfg.rope_scaling, hcfg.max_position_embeddings),
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


# ---------------------------------------------------------------------------------------------- read back
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
    return hybrid_config_refusal(_read_json(Path(path) / HYBRID_CONFIG_NAME))


def check_released_dir(path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> str | None:
    """Read a released directory back as AMD's loader would (`load_state_dict(strict=False)` into the module
    tree of `their_expected_tensors`); raise naming every tensor it would drop, leave random or refuse.

    Returns None when AMD's public loader (AMD_AT) reads it exactly. A directory with HyLo's keys (a layout
    only HyLo's code builds) is checked against that layout, and must be refused by the public loader: the
    refusal it gives is returned."""
    p = Path(path)
    where = str(p / HYBRID_CONFIG_NAME)
    hyb = _read_json(p / HYBRID_CONFIG_NAME)
    hylo = any(k in hyb for k in HYLO_KEYS)
    refusal = hybrid_config_refusal(hyb)
    if hylo and refusal is None:
        raise ReleasedLayoutError(f"{where}: HyLo's keys ({', '.join(k for k in HYLO_KEYS if k in hyb)}) are fields of "
                                  f"AMD's public HybridConfig: it would build this layout with its own layers")
    expected = their_expected_tensors(_read_json(p / "config.json"), hyb, where, hylo=hylo)
    tensors = tensors if tensors is not None else read_released_tensors(p)
    dropped = sorted(set(tensors) - set(expected))
    random = sorted(set(expected) - set(tensors))
    shapes = sorted(f"{k}: file {tuple(t.shape)}, their module {expected[k]}" for k, t in tensors.items()
                    if k in expected and tuple(t.shape) != expected[k])
    lines = ([f"dropped by their loader (no such module): {k}" for k in dropped[:8]]
             + [f"left at their random init (not in the file): {k}" for k in random[:8]]
             + [f"shape mismatch: {k}" for k in shapes[:8]])
    if lines:
        raise ReleasedLayoutError(f"{p}: AMD's loader would not read this checkpoint as written:\n  " + "\n  ".join(lines))
    return refusal


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
    from safetensors.torch import save_file

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
