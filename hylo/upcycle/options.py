"""Conversion options (`ConvertConfig`) and the HybridConfig they give for a base model.

Design choices:
* One dataclass holds every option of a conversion (`ConvertConfig`, in the leaf hylo/upcycle/config.py): the
  shape options of `hybrid_config_from_base` and
  the run options of `convert` (`init`, `seed`, `calibrate`, `dtype`). jobs/convert.py's flags, the convert
  job's YAML and the training config's `model.convert` are all this class (pipeline's config loader builds
  it, its ranges `@rules` as in every config section); its defaults are the converter's defaults.
* Options are validated as given (0 or a negative size is an error, never "the default"); a latent wider
  than the hidden size or an MLA layer caching more than the attention it replaces is refused. YaRN
  (`yarn_factor`) replaces the base's RoPE scaling with a warning; Llama-3's `llama3` scaling has no MLA
  equivalent and is dropped with a warning.
* RoPE dims: Llama rotates halves (dim j pairs with j + dh/2). MLA keeps the Pr/2 highest-frequency pairs
  and sets `rope_theta = theta ** (Pr / dh)`, which reproduces exactly the base model's frequencies for
  those pairs (inv_freq_i = theta'^(-2i/Pr) = theta^(-2i/dh)). One block of the shared roped key per KV
  group (`rope_key_groups = G`) when the asked shapes allow it (see mla.py).
* The latent RMSNorms of MLA have no counterpart in the base model and rescale every token differently
  (a per-token factor on keys and values that no weight can undo): upcycled models start with
  `mla_latent_norm: false`.
* This module imports neither torch nor transformers at import time, so configs load fast.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

from hylo.upcycle.config import ConvertConfig, UpcycleError, _flag

SUPPORTED_BASE_TYPES = ("llama", "qwen3", "mistral", "qwen2")


def make_options(options: ConvertConfig | None = None, **overrides: Any) -> ConvertConfig:
    """`options` (default: all defaults) with `overrides` replaced; an unknown name lists the valid ones."""
    options = options if options is not None else ConvertConfig()
    valid = [f.name for f in dataclasses.fields(options)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise UpcycleError(f"unknown conversion option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return dataclasses.replace(options, **overrides) if overrides else options


# ---------------------------------------------------------------------------------------------- placement
def parse_placement(spec: str | list[int] | tuple[int, ...], n_layer: int) -> list[int]:
    """MLA layer indices from an explicit list, 'even', 'odd', 'uniform:N', 'all', 'none' or '0,5,10'."""
    if isinstance(spec, list | tuple):
        layers = [int(i) for i in spec]
    else:
        s = str(spec).strip().lower()
        if s == "even":
            layers = list(range(0, n_layer, 2))
        elif s == "odd":
            layers = list(range(1, n_layer, 2))
        elif s == "all":
            layers = list(range(n_layer))
        elif s in ("none", ""):
            layers = []
        elif s.startswith("uniform:"):
            try:
                n = int(s.split(":", 1)[1])
            except ValueError as e:
                raise UpcycleError(f"placement {spec!r}: 'uniform:N' needs an integer N") from e
            if not 0 <= n <= n_layer:
                raise UpcycleError(f"placement {spec!r}: N must be in 0..{n_layer}")
            # centre of each of N equal bins
            layers = sorted({int(math.floor((i + 0.5) * n_layer / n)) for i in range(n)})
        else:
            try:
                layers = [int(x) for x in s.strip("[]").split(",") if x.strip()]
            except ValueError as e:
                raise UpcycleError(
                    f"placement {spec!r} not understood; use a list like 0,5,10, 'even', 'odd', 'uniform:N', 'all', 'none'"
                ) from e
    bad = [i for i in layers if not 0 <= i < n_layer]
    if bad:
        raise UpcycleError(f"mla_layers (--mla-layers) = {_spec_text(spec)}: mla layer index {bad[0]} is out of range; "
                           f"allowed: 0..{n_layer - 1}")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        raise UpcycleError(f"mla_layers (--mla-layers) = {_spec_text(spec)}: layer {twice[0]} is listed more than "
                           "once; list each MLA layer once")
    return sorted(layers)


def _spec_text(spec: str | list[int] | tuple[int, ...]) -> str:
    return ",".join(map(str, spec)) if isinstance(spec, list | tuple) else str(spec)


# ---------------------------------------------------------------------------------------------- base config
def base_dims(base_cfg: Any) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head dim, layers) of a base config."""
    h = base_cfg.num_attention_heads
    g = getattr(base_cfg, "num_key_value_heads", None) or h
    dh = getattr(base_cfg, "head_dim", None) or base_cfg.hidden_size // h
    return h, g, dh, base_cfg.num_hidden_layers


def _base_rope_theta(base_cfg: Any) -> float:
    theta = getattr(base_cfg, "rope_theta", None)
    params = getattr(base_cfg, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta or 10000.0)


def _base_rope_params(base_cfg: Any) -> dict | None:
    """The base's RoPE scaling dict (transformers 5 `rope_parameters` or older `rope_scaling`), or None."""
    params = getattr(base_cfg, "rope_parameters", None) or getattr(base_cfg, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    rtype = params.get("rope_type", params.get("type")) or "default"
    return None if rtype == "default" else {k: v for k, v in params.items() if k != "rope_theta"}


def _base_rope_scaling(base_cfg: Any) -> dict | None:
    """The part of the base's RoPE scaling that MLA carries exactly (yarn, linear); None otherwise."""
    params = _base_rope_params(base_cfg)
    if params is None or params.get("rope_type", params.get("type")) not in ("yarn", "linear"):
        return None
    return params


def yarn_rope_scaling(factor: float, original_max_position_embeddings: int | None = None,
                      max_position_embeddings: int | None = None, beta_fast: float = 32.0,
                      beta_slow: float = 1.0) -> dict:
    """YaRN settings for the MLA RoPE: `factor` times an original window gives the usable positions.

    The released HyLo 64K models use factor 32 over an original window of 2,048 tokens (65,536 positions).
    Without `original_max_position_embeddings` the window is `max_position_embeddings / factor`.
    """
    if not factor or factor < 1:
        raise UpcycleError(f"yarn factor (--yarn-factor) must be >= 1, got {factor!r}")
    if original_max_position_embeddings is None:
        if not max_position_embeddings:
            raise UpcycleError("yarn: give original_max_position_embeddings (--yarn-original-max-position-embeddings) "
                               "or max_position_embeddings")
        original_max_position_embeddings = int(round(max_position_embeddings / factor))
        if original_max_position_embeddings < 1:
            raise UpcycleError(f"yarn factor (--yarn-factor) = {factor!r} leaves an original window of "
                               f"{max_position_embeddings} / {factor:g} < 1 position; give a factor of at most "
                               f"{max_position_embeddings} or --yarn-original-max-position-embeddings")
    if not isinstance(original_max_position_embeddings, int) or original_max_position_embeddings <= 0:
        raise UpcycleError("yarn original_max_position_embeddings (--yarn-original-max-position-embeddings) must be "
                           f"a positive integer, got {original_max_position_embeddings!r}")
    return {"rope_type": "yarn", "factor": float(factor),
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": float(beta_fast), "beta_slow": float(beta_slow)}


def _default_rope_key_groups(g: int, dh: int, d_rope: int | None, d_nope: int | None) -> int:
    """One block per KV group when it fits the asked shapes (exact init), otherwise one shared key."""
    if not 1 < g <= 8:
        return 1
    if d_rope is not None and d_rope % (2 * g):
        return 1
    if d_rope is not None and d_nope is not None and d_nope + d_rope // g != dh:
        # e.g. the released models' rope 64 + nope 64 = head_dim 128: one shared key of 64 dims
        return 1
    return g


def _rope_scaling_for(base_cfg: Any, rope_scaling: dict | None) -> dict | None:
    """The MLA RoPE scaling, warning when the base's own scaling is replaced or cannot be carried."""
    base = _base_rope_params(base_cfg)
    carried = _base_rope_scaling(base_cfg)
    if rope_scaling is not None:
        if base is not None and base != rope_scaling:
            warnings.warn(f"the base model's RoPE scaling {base} is replaced by {rope_scaling} in the MLA layers",
                          UserWarning, stacklevel=3)
        return dict(rope_scaling)
    if base is not None and carried is None:
        warnings.warn(f"the base model's RoPE scaling {base} has no MLA equivalent and is dropped: the MLA layers "
                      f"use plain RoPE (set rope_scaling / --yarn-factor for long context)", UserWarning, stacklevel=3)
    return carried


def check_base_type(model_type: Any, where: str = "base") -> None:
    if model_type not in SUPPORTED_BASE_TYPES:
        raise UpcycleError(f"{where} model_type {model_type!r} is not supported; "
                           f"supported: {', '.join(SUPPORTED_BASE_TYPES)}")


def hybrid_config_from_base(base_cfg: Any, options: ConvertConfig | None = None, **overrides: Any):
    """Derive a HybridConfig from a base model config (a transformers config object or a dict).

    The options are `options` (a ConvertConfig, default: all defaults) with `overrides` (its field names)
    replaced; every explicitly given option is validated (0 or negative is an error, not "use the
    default"). `yarn_factor` (with `yarn_original_max_position_embeddings`, default max positions /
    factor) is a shorthand for a YaRN `rope_scaling`; `tie_word_embeddings` None keeps the base's choice
    (the released HyLo models untie the LM head: `tie_word_embeddings: false` copies the base embedding
    into it).
    """
    from hylo.config import HybridConfig, HybridConfigError  # lazy: torch

    o = make_options(options, **overrides)
    if isinstance(base_cfg, dict):
        from transformers import AutoConfig  # lazy: torch

        check_base_type(base_cfg.get("model_type"))
        base_cfg = AutoConfig.for_model(**base_cfg)
    mt = getattr(base_cfg, "model_type", None)
    check_base_type(mt)
    h, g, dh, n_layer = base_dims(base_cfg)
    # One block of the shared roped key per KV head group keeps every group's RoPE keys exact
    # (a single shared key averaged over groups wrecks the base attention); see mla_weights_from_attention.
    rope_key_groups = o.rope_key_groups
    if rope_key_groups is None:
        rope_key_groups = _default_rope_key_groups(g, dh, o.qk_rope_head_dim, o.qk_nope_head_dim)
    if o.qk_rope_head_dim is not None:
        d_rope = o.qk_rope_head_dim
    elif rope_key_groups > 1:
        d_rope = rope_key_groups * min(16, dh // 2)
    else:
        d_rope = min(64, dh // 2)
    if rope_key_groups not in (1, g):
        raise UpcycleError(f"rope_key_groups={rope_key_groups}: allowed 1 (one shared key) or {g} (one block per KV head group)")
    if d_rope % (2 * rope_key_groups):
        raise UpcycleError(f"qk_rope_head_dim={d_rope} must be a multiple of 2 * rope_key_groups = {2 * rope_key_groups}")
    per_group_rope = d_rope // rope_key_groups
    d_nope = o.qk_nope_head_dim if o.qk_nope_head_dim is not None else dh - per_group_rope
    dv = o.v_head_dim if o.v_head_dim is not None else dh
    full_kv_rank = g * (d_nope + dv)
    # default: the joint SVD's full rank, capped at 256 (the published models use 128 at 1B-3B scale)
    r_kv = o.kv_lora_rank if o.kv_lora_rank is not None else min(256, full_kv_rank - full_kv_rank % 8)
    # a latent wider than the layer's input holds nothing more than the input itself
    d_model = base_cfg.hidden_size
    for name, rank in (("kv_lora_rank", r_kv), ("q_lora_rank", o.q_lora_rank)):
        if rank is not None and rank > d_model:
            raise UpcycleError(f"{name} ({_flag(name)}) = {rank} is larger than the hidden size {d_model}: a latent "
                               f"cannot hold more than its input (allowed: 8..{d_model})")
    # an MLA layer that caches more per token than the attention it replaces defeats its purpose (the key
    # 1/RMS values of a Qwen3 base's q/k norms, one per kv_b head, are left out: the full-rank conversion
    # that keeps every RoPE pair, and so reproduces the base, caches exactly 2 x G x K plus them)
    if r_kv + d_rope > 2 * g * dh:
        raise UpcycleError(
            f"kv_lora_rank + qk_rope_head_dim = {r_kv} + {d_rope}: an MLA layer would cache {r_kv + d_rope} values "
            f"per token, more per token than the attention layer it replaces ({2 * g * dh} = 2 x {g} KV heads x "
            f"{dh}); lower --kv-lora-rank (full joint rank: {full_kv_rank})")
    max_pos = o.max_position_embeddings if o.max_position_embeddings is not None else base_cfg.max_position_embeddings
    rope_scaling = o.rope_scaling
    if o.yarn_factor is not None:
        if rope_scaling is not None:
            raise UpcycleError("give either rope_scaling or yarn_factor (--yarn-factor), not both")
        rope_scaling = yarn_rope_scaling(o.yarn_factor, o.yarn_original_max_position_embeddings, max_pos)
    elif o.yarn_original_max_position_embeddings is not None:
        raise UpcycleError("yarn_original_max_position_embeddings (--yarn-original-max-position-embeddings) needs "
                           "yarn_factor (--yarn-factor)")
    theta = _base_rope_theta(base_cfg)
    eos = getattr(base_cfg, "eos_token_id", None)
    try:
        return HybridConfig(
            vocab_size=base_cfg.vocab_size,
            hidden_size=base_cfg.hidden_size,
            intermediate_size=base_cfg.intermediate_size,
            hidden_act=getattr(base_cfg, "hidden_act", "silu"),
            n_layer=n_layer,
            mla_layers=parse_placement(o.mla_layers, n_layer),
            rms_norm_eps=base_cfg.rms_norm_eps,
            num_attention_heads=h,
            num_key_value_heads=g,
            head_dim=dh,
            kv_lora_rank=r_kv,
            q_lora_rank=o.q_lora_rank,
            qk_rope_head_dim=d_rope,
            qk_nope_head_dim=d_nope,
            rope_key_groups=rope_key_groups,
            mla_latent_norm=o.mla_latent_norm,
            mla_latent_norm_eps=o.mla_latent_norm_eps,
            kv_b_per_kv_head=o.kv_b_per_kv_head,
            # Qwen3 normalises each head's q and k: MLA keeps those norms (the linear blocks fold them)
            mla_qk_norm=mt == "qwen3",
            v_head_dim=dv,
            max_position_embeddings=max_pos,
            # reproduce the base frequencies of the kept (highest-frequency) RoPE pairs exactly
            rope_theta=theta ** (per_group_rope / dh),
            rope_scaling=_rope_scaling_for(base_cfg, rope_scaling),
            attention_bias=bool(getattr(base_cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(base_cfg, "mlp_bias", False)),
            linear_type=o.linear_type,
            mamba2_xb_groups=o.mamba2_xb_groups,
            mamba2_norm_eps=o.mamba2_norm_eps,
            gdn_num_heads=o.gdn_num_heads if o.gdn_num_heads is not None else h,
            gdn_head_dim=o.gdn_head_dim if o.gdn_head_dim is not None else dh,
            gdn_expand_v=o.gdn_expand_v if o.gdn_expand_v is not None else 1.0,
            tie_word_embeddings=(bool(getattr(base_cfg, "tie_word_embeddings", False)) if o.tie_word_embeddings is None
                                 else bool(o.tie_word_embeddings)),
            base_model_type=mt,
            base_num_key_value_heads=g,
            base_head_dim=dh,
            base_tie_word_embeddings=bool(getattr(base_cfg, "tie_word_embeddings", False)),
            pad_token_id=getattr(base_cfg, "pad_token_id", None),
            bos_token_id=getattr(base_cfg, "bos_token_id", None),
            eos_token_id=eos,
        )
    except HybridConfigError as e:
        raise UpcycleError(str(e)) from None


def kv_summary(base_cfg: Any, hcfg: Any, bytes_per_value: int = 2) -> dict[str, Any]:
    """KV-cache accounting (values per token; bytes at `bytes_per_value`, bf16 by default)."""
    from hylo.config import base_kv_values_per_token  # lazy: torch

    base_vals = base_kv_values_per_token(base_cfg)
    hyb_vals = hcfg.kv_cache_values_per_token()
    return {
        "layers": hcfg.n_layer,
        "mla_layers": hcfg.mla_layers,
        "linear_layers": hcfg.linear_layers,
        "linear_type": hcfg.linear_type,
        "n_mla": len(hcfg.mla_layers),
        "n_linear": len(hcfg.linear_layers),
        "kv_lora_rank": hcfg.kv_lora_rank,
        "qk_rope_head_dim": hcfg.qk_rope_head_dim,
        # per MLA layer and token: latent + roped key, plus with mla_qk_norm one key 1/RMS per kv_b head
        "mla_values_per_token": hcfg.mla_cache_values_per_token(),
        "qk_norm_values_per_token": hcfg.kv_b_heads if hcfg.mla_qk_norm else 0,
        "base_kv_bytes_per_token": base_vals * bytes_per_value,
        "hybrid_kv_bytes_per_token": hyb_vals * bytes_per_value,
        "kv_cache_ratio": hyb_vals / base_vals,
    }
