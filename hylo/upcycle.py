"""Upcycle a Llama / Qwen3 checkpoint into a HyLo hybrid (MLA + linear layers).

Legend: D hidden, H query heads, G KV heads, dh base head dim, Pn nope dims, Pr rope dims (both per head),
dv value head dim, R kv_lora_rank, Rq q_lora_rank.

Design choices:
* MLA from attention by SVD (X-EcoMLA): queries are kept whole (`q_lora_rank: null`, exact) or factored by
  a truncated SVD; the nope-keys and values of all KV heads are stacked and factored by ONE joint SVD into
  `kv_a_proj_with_mqa` (latent rows) and `kv_b_proj` (per-head nope-key and value rows, GQA groups expanded
  to the query heads); the shared roped key is the mean of the KV heads' RoPE rows.
* RoPE dims: Llama rotates halves (dim j pairs with j + dh/2). We keep the Pr/2 highest-frequency pairs
  together and set the MLA `rope_theta = theta ** (Pr / dh)`, which reproduces exactly the base model's
  frequencies for those pairs (inv_freq_i = theta'^(-2i/Pr) = theta^(-2i/dh)).
* RoPE keys: MLA shares one roped key across heads, but GQA key heads disagree, and averaging their RoPE
  rows wrecks the attention pattern (measured on SmolLM2: attention probabilities off by up to 0.75).
  We give the shared key one block per KV group (`rope_key_groups = G`, each block with the group's own
  highest-frequency pairs and frequency ladder), each query head reading only its group's block: exact for
  the kept pairs, at the same cache cost `kv_lora_rank + qk_rope_head_dim`. `rope_key_groups = 1` keeps a
  single block fitted by a complex rank-1 SVD per pair.
* The latent RMSNorms of MLA have no counterpart in the base model and rescale every token differently
  (a per-token factor on keys and values that no weight can undo). Upcycled models therefore start with
  `mla_latent_norm: false`; with the norms on, calibration sets their weight to the latents' mean RMS.
* GDN from attention: W_q -> q_proj, W_k -> k_proj, W_v -> v_proj, W_o -> o_proj, every query head used.
  With fewer GDN heads than query heads each GDN head stands for a contiguous group of them: its key dims
  hold the group's query / key rows side by side (q.k sums the heads' scores; an SVD basis shared by q and
  k when they do not fit), its value dims one slot per head with that head's o_proj columns. Spare value
  dims are zero with trainable o_proj columns (zero columns would never get a gradient). Qwen3's q/k
  RMSNorm weights fold exactly into q_proj / k_proj because GDN L2-normalises q and k. Gates, decay and
  beta keep their default init; the short convolutions start as identity (last tap 1) so the copied
  projections are not scrambled.
* Conversion options are validated as given (0 or negative is an error, never "the default"); a latent
  wider than the hidden size or an MLA layer caching more than the attention it replaces is refused, and
  so is a base with NaN/inf weights. YaRN (`yarn_factor`) replaces the base's RoPE scaling with a warning;
  Llama-3's `llama3` scaling has no MLA equivalent and is dropped with a warning.
* GDN / Mamba-2 gates: with calibration tokens the output gate is made ~constant and the output norm takes
  the attention heads' RMS (`_calibrate_linear`); a random gate otherwise erases what the copied projections carry.
* MLP, norms, embeddings and LM head are copied.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.config import HybridConfig, HybridConfigError, base_kv_values_per_token
from hylo.files import read_json

SUPPORTED_BASE_TYPES = ("llama", "qwen3", "mistral", "qwen2")


class UpcycleError(ValueError):
    """The base model cannot be converted; the message says why and what is supported."""


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
        raise UpcycleError(f"mla layer index {bad[0]} is out of range; allowed: 0..{n_layer - 1}")
    return sorted(set(layers))


# ---------------------------------------------------------------------------------------------- config
def _base_dims(base_cfg: Any) -> tuple[int, int, int, int]:
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
    if not isinstance(original_max_position_embeddings, int) or original_max_position_embeddings <= 0:
        raise UpcycleError("yarn original_max_position_embeddings (--yarn-original-max-position-embeddings) must be "
                           f"a positive integer, got {original_max_position_embeddings!r}")
    return {"rope_type": "yarn", "factor": float(factor),
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": float(beta_fast), "beta_slow": float(beta_slow)}


# Options of hybrid_config_from_base with their command-line spelling (for error messages).
_POSITIVE_INT_OPTIONS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "rope_key_groups", "v_head_dim",
                         "gdn_num_heads", "gdn_head_dim", "max_position_embeddings")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_options(**opts: Any) -> None:
    """Explicitly given shape options must be valid: 0 or a negative value is an error, never 'use the default'."""
    for name in _POSITIVE_INT_OPTIONS:
        v = opts.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise UpcycleError(f"{name} ({_flag(name)}) = {v!r}: must be a positive integer; omit it for the default")
    v = opts.get("qk_nope_head_dim")
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise UpcycleError(f"qk_nope_head_dim (--qk-nope-head-dim) = {v!r}: must be an integer >= 0")
    v = opts.get("gdn_expand_v")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
        raise UpcycleError(f"gdn_expand_v (--gdn-expand-v) = {v!r}: must be > 0; omit it for the default (1.0)")


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
    import warnings

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


def hybrid_config_from_base(
    base_cfg: Any,
    mla_layers: str | list[int] = "even",
    kv_lora_rank: int | None = None,
    q_lora_rank: int | None = None,
    qk_rope_head_dim: int | None = None,
    qk_nope_head_dim: int | None = None,
    rope_key_groups: int | None = None,
    mla_latent_norm: bool = False,
    mla_latent_norm_eps: float | None = None,
    kv_b_per_kv_head: bool = False,
    v_head_dim: int | None = None,
    gdn_num_heads: int | None = None,
    gdn_head_dim: int | None = None,
    gdn_expand_v: float | None = None,
    linear_type: str = "gdn",
    rope_scaling: dict | None = None,
    yarn_factor: float | None = None,
    yarn_original_max_position_embeddings: int | None = None,
    max_position_embeddings: int | None = None,
    tie_word_embeddings: bool | None = None,
) -> HybridConfig:
    """Derive a HybridConfig from a base model config (a transformers config object or a dict).

    Every explicitly given option is validated (0 or negative is an error, not "use the default").
    `yarn_factor` (with `yarn_original_max_position_embeddings`, default max positions / factor) is a
    shorthand for a YaRN `rope_scaling`; `tie_word_embeddings` None keeps the base's choice (the released
    HyLo models untie the LM head: `tie_word_embeddings: false` copies the base embedding into it).
    """
    if isinstance(base_cfg, dict):
        from transformers import AutoConfig

        mt = base_cfg.get("model_type")
        if mt not in SUPPORTED_BASE_TYPES:
            raise UpcycleError(f"base model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_BASE_TYPES)}")
        base_cfg = AutoConfig.for_model(**base_cfg)
    mt = getattr(base_cfg, "model_type", None)
    if mt not in SUPPORTED_BASE_TYPES:
        raise UpcycleError(f"base model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_BASE_TYPES)}")
    _check_options(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   qk_nope_head_dim=qk_nope_head_dim, rope_key_groups=rope_key_groups, v_head_dim=v_head_dim,
                   gdn_num_heads=gdn_num_heads, gdn_head_dim=gdn_head_dim, gdn_expand_v=gdn_expand_v,
                   max_position_embeddings=max_position_embeddings)
    h, g, dh, n_layer = _base_dims(base_cfg)
    # One block of the shared roped key per KV head group keeps every group's RoPE keys exact
    # (a single shared key averaged over groups wrecks the base attention); see mla_weights_from_attention.
    if rope_key_groups is None:
        rope_key_groups = _default_rope_key_groups(g, dh, qk_rope_head_dim, qk_nope_head_dim)
    if qk_rope_head_dim is not None:
        d_rope = qk_rope_head_dim
    elif rope_key_groups > 1:
        d_rope = rope_key_groups * min(16, dh // 2)
    else:
        d_rope = min(64, dh // 2)
    if rope_key_groups not in (1, g):
        raise UpcycleError(f"rope_key_groups={rope_key_groups}: allowed 1 (one shared key) or {g} (one block per KV head group)")
    if d_rope % (2 * rope_key_groups):
        raise UpcycleError(f"qk_rope_head_dim={d_rope} must be a multiple of 2 * rope_key_groups = {2 * rope_key_groups}")
    per_group_rope = d_rope // rope_key_groups
    d_nope = qk_nope_head_dim if qk_nope_head_dim is not None else dh - per_group_rope
    dv = v_head_dim if v_head_dim is not None else dh
    full_kv_rank = g * (d_nope + dv)
    # default: the joint SVD's full rank, capped at 256 (the published models use 128 at 1B-3B scale)
    r_kv = kv_lora_rank if kv_lora_rank is not None else min(256, full_kv_rank - full_kv_rank % 8)
    # a latent wider than the layer's input holds nothing more than the input itself
    d_model = base_cfg.hidden_size
    for name, rank in (("kv_lora_rank", r_kv), ("q_lora_rank", q_lora_rank)):
        if rank is not None and rank > d_model:
            raise UpcycleError(f"{name} ({_flag(name)}) = {rank} is larger than the hidden size {d_model}: a latent "
                               f"cannot hold more than its input (allowed: 8..{d_model})")
    # an MLA layer that caches more per token than the attention it replaces defeats its purpose
    if r_kv + d_rope > 2 * g * dh:
        raise UpcycleError(
            f"kv_lora_rank + qk_rope_head_dim = {r_kv} + {d_rope}: an MLA layer would cache {r_kv + d_rope} values "
            f"per token, more per token than the attention layer it replaces ({2 * g * dh} = 2 x {g} KV heads x "
            f"{dh}); lower --kv-lora-rank (full joint rank: {full_kv_rank})")
    max_pos = max_position_embeddings if max_position_embeddings is not None else base_cfg.max_position_embeddings
    if yarn_factor is not None:
        if rope_scaling is not None:
            raise UpcycleError("give either rope_scaling or yarn_factor (--yarn-factor), not both")
        rope_scaling = yarn_rope_scaling(yarn_factor, yarn_original_max_position_embeddings, max_pos)
    elif yarn_original_max_position_embeddings is not None:
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
            mla_layers=parse_placement(mla_layers, n_layer),
            rms_norm_eps=base_cfg.rms_norm_eps,
            num_attention_heads=h,
            num_key_value_heads=g,
            head_dim=dh,
            kv_lora_rank=r_kv,
            q_lora_rank=q_lora_rank,
            qk_rope_head_dim=d_rope,
            qk_nope_head_dim=d_nope,
            rope_key_groups=rope_key_groups,
            mla_latent_norm=mla_latent_norm,
            mla_latent_norm_eps=mla_latent_norm_eps,
            kv_b_per_kv_head=kv_b_per_kv_head,
            v_head_dim=dv,
            max_position_embeddings=max_pos,
            # reproduce the base frequencies of the kept (highest-frequency) RoPE pairs exactly
            rope_theta=theta ** (per_group_rope / dh),
            rope_scaling=_rope_scaling_for(base_cfg, rope_scaling),
            attention_bias=bool(getattr(base_cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(base_cfg, "mlp_bias", False)),
            linear_type=linear_type,
            gdn_num_heads=gdn_num_heads if gdn_num_heads is not None else h,
            gdn_head_dim=gdn_head_dim if gdn_head_dim is not None else dh,
            gdn_expand_v=gdn_expand_v if gdn_expand_v is not None else 1.0,
            tie_word_embeddings=(bool(getattr(base_cfg, "tie_word_embeddings", False)) if tie_word_embeddings is None
                                 else bool(tie_word_embeddings)),
            base_model_type=mt,
            base_num_key_value_heads=g,
            base_head_dim=dh,
            pad_token_id=getattr(base_cfg, "pad_token_id", None),
            bos_token_id=getattr(base_cfg, "bos_token_id", None),
            eos_token_id=eos,
        )
    except HybridConfigError as e:
        raise UpcycleError(str(e)) from None


def kv_summary(base_cfg: Any, hcfg: HybridConfig, bytes_per_value: int = 2) -> dict[str, Any]:
    """KV-cache accounting (values per token; bytes at `bytes_per_value`, bf16 by default)."""
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
        "base_kv_bytes_per_token": base_vals * bytes_per_value,
        "hybrid_kv_bytes_per_token": hyb_vals * bytes_per_value,
        "kv_cache_ratio": hyb_vals / base_vals,
    }


# ---------------------------------------------------------------------------------------------- loading
def load_base_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load a base HF causal LM directory with clear errors for missing/corrupt/unsupported input."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    if not p.exists():
        raise UpcycleError(f"base model directory {p} does not exist")
    if not p.is_dir():
        raise UpcycleError(f"base model path {p} is not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise UpcycleError(f"{p}: no config.json (is this a Hugging Face model directory?)")
    raw = read_json(cfg_file, UpcycleError, mapping=True)
    mt = raw.get("model_type")
    if mt not in SUPPORTED_BASE_TYPES:
        arch = raw.get("architectures")
        raise UpcycleError(
            f"{cfg_file}: model_type {mt!r} (architectures {arch}) is not supported; "
            f"supported: {', '.join(SUPPORTED_BASE_TYPES)}"
        )
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise UpcycleError(f"{p}: no weight files (*.safetensors) found")
    try:
        AutoConfig.from_pretrained(p)
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    except Exception as e:  # transformers raises many kinds for corrupt files
        raise UpcycleError(f"{p}: could not load the base model weights: {type(e).__name__}: {e}") from e
    return model


# ---------------------------------------------------------------------------------------------- weights
def rope_dim_split(dh: int, d_rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nope_idx, rope_idx) into a rotate-half head of size dh; rope keeps the d_rope/2 highest-freq pairs."""
    half = dh // 2
    pairs = torch.arange(d_rope // 2)
    rope_idx = torch.cat([pairs, pairs + half])
    mask = torch.ones(dh, dtype=torch.bool)
    mask[rope_idx] = False
    nope_idx = torch.arange(dh)[mask]
    return nope_idx, rope_idx


def _fit(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Truncate or zero-pad the first dim of w to `rows`."""
    if w.shape[0] >= rows:
        return w[:rows]
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def _qk_norm_weights(attn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    qn = getattr(attn, "q_norm", None)
    kn = getattr(attn, "k_norm", None)
    return (qn.weight.detach().float() if qn is not None else None, kn.weight.detach().float() if kn is not None else None)


def shared_rope_key(wk_rope_GPD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One roped key shared by all KV heads: per RoPE pair, the best complex rank-1 fit.

    In rotate-half layout pair j of a head is the complex number z_j = x_j + i x_{j+P/2}; RoPE multiplies
    it by e^{i theta_j t}. Writing each KV head's key rows for pair j as a complex row c_gj and fitting
    c_gj ~= a_gj s_j (SVD), the shared key is s_j and the complex factors a_gj [G, P/2] go to the queries
    (`absorb_rope_factors`). When heads agree up to a complex scale this is exact; plain averaging is
    the special case a_gj = 1.
    """
    g, p, d = wk_rope_GPD.shape
    half = p // 2
    c = torch.complex(wk_rope_GPD[:, :half], wk_rope_GPD[:, half:])  # [G, P/2, D]
    k_pe = torch.empty(p, d, dtype=wk_rope_GPD.dtype)
    a = torch.empty(g, half, dtype=c.dtype)
    for j in range(half):
        u, sv, vh = torch.linalg.svd(c[:, j], full_matrices=False)
        a[:, j] = u[:, 0] * sv[0]
        k_pe[j], k_pe[half + j] = vh[0].real, vh[0].imag
    return k_pe, a


def absorb_rope_factors(wq_rope_HPD: torch.Tensor, a_HJ: torch.Tensor) -> torch.Tensor:
    """Query rope rows whose pairs are multiplied by conj(a): q.conj(a s) == (conj(a) q).conj(s)."""
    half = wq_rope_HPD.shape[1] // 2
    q = torch.complex(wq_rope_HPD[:, :half], wq_rope_HPD[:, half:]) * a_HJ.conj().unsqueeze(-1)
    return torch.cat([q.real, q.imag], dim=1)


@torch.no_grad()
def mla_weights_from_attention(attn: nn.Module, hcfg: HybridConfig) -> dict[str, torch.Tensor]:
    """SVD initialisation of one MLA layer from a Llama/Qwen3 attention module (float64 SVD)."""
    h, g, dh = hcfg.num_attention_heads, hcfg.num_key_value_heads, hcfg.base_head_dim or hcfg.head_dim
    d_rope, d_nope, dv, r = hcfg.qk_rope_head_dim, hcfg.qk_nope_head_dim, hcfg.v_head_dim, hcfg.kv_lora_rank
    groups = getattr(hcfg, "rope_key_groups", 1)
    nope_idx, rope_idx = rope_dim_split(dh, d_rope // groups)
    wq = attn.q_proj.weight.detach().double().view(h, dh, -1)
    wk = attn.k_proj.weight.detach().double().view(g, dh, -1)
    wv = attn.v_proj.weight.detach().double().view(g, dh, -1)
    qw, kw = _qk_norm_weights(attn)
    if qw is not None:
        wq = wq * qw.double().view(1, dh, 1)
    if kw is not None:
        wk = wk * kw.double().view(1, dh, 1)
    d = wq.shape[-1]
    out: dict[str, torch.Tensor] = {}
    group = h // g
    if groups == g and g > 1:
        # one block of k_pe per KV group, exact; each query head's rope part sits in its group's block
        half, k = d_rope // 2, d_rope // (2 * g)
        wk_r = wk[:, rope_idx]  # [G, 2k, D]: real parts (first k), imaginary parts (last k)
        k_pe = torch.cat([wk_r[:, :k].reshape(g * k, d), wk_r[:, k:].reshape(g * k, d)], dim=0)
        wq_r = wq[:, rope_idx]
        q_rope = wq.new_zeros(h, d_rope, d)
        for head in range(h):
            blk = head // group
            q_rope[head, blk * k : (blk + 1) * k] = wq_r[head, :k]
            q_rope[head, half + blk * k : half + (blk + 1) * k] = wq_r[head, k:]
    elif groups == 1:
        # one key shared by all groups: best complex rank-1 fit per RoPE pair; each head's query pair
        # absorbs its group's complex factor (a complex scale commutes with the RoPE rotation)
        k_pe, a_GJ = shared_rope_key(wk[:, rope_idx])
        q_rope = absorb_rope_factors(wq[:, rope_idx], a_GJ.repeat_interleave(group, dim=0))
    else:
        raise UpcycleError(f"rope_key_groups={groups}: allowed 1 or the number of KV heads ({g})")
    # MLA scales scores by 1/sqrt(d_nope + d_rope); the base by 1/sqrt(dh)
    q_scale = math.sqrt((d_nope + d_rope) / dh)
    # queries: per head [nope | rope]
    q_full = q_scale * torch.cat([wq[:, nope_idx], q_rope], dim=1).reshape(h * (d_nope + d_rope), d)
    if hcfg.q_lora_rank is None:
        out["q_proj.weight"] = q_full
    else:
        u, s, vh = torch.linalg.svd(q_full, full_matrices=False)
        rq = min(hcfg.q_lora_rank, s.numel())
        out["q_a_proj.weight"] = _fit(s[:rq, None] * vh[:rq], hcfg.q_lora_rank)
        out["q_b_proj.weight"] = _fit(u[:, :rq].T, hcfg.q_lora_rank).T.contiguous()
    # joint SVD of stacked per-KV-head nope keys and values
    k_nope = wk[:, nope_idx]  # [G, Pn, D]
    v = _fit(wv.transpose(0, 1), dv).transpose(0, 1) if dv != dh else wv  # [G, dv, D]
    stacked = torch.cat([k_nope.reshape(g * d_nope, d), v.reshape(g * dv, d)], dim=0)
    u, s, vh = torch.linalg.svd(stacked, full_matrices=False)
    rk = min(r, s.numel())
    latent = _fit(s[:rk, None] * vh[:rk], r)  # [R, D]
    up = _fit(u[:, :rk].T, r).T  # [G*(Pn+dv), R]
    up_k = up[: g * d_nope].view(g, d_nope, r)
    up_v = up[g * d_nope :].view(g, dv, r)
    kv_b = torch.cat([up_k, up_v], dim=1)  # [G, Pn+dv, R]: one block per KV head
    if not getattr(hcfg, "kv_b_per_kv_head", False):
        # DeepSeek's layout: one block per query head, GQA groups expanded
        kv_b = kv_b.repeat_interleave(group, 0)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([latent, k_pe], dim=0)
    out["kv_b_proj.weight"] = kv_b.reshape(-1, r)
    wo = attn.o_proj.weight.detach().double().view(d, h, dh)
    if dv != dh:
        wo = _fit(wo.permute(2, 0, 1), dv).permute(1, 2, 0)
    out["o_proj.weight"] = wo.reshape(d, h * dv)
    if getattr(attn.o_proj, "bias", None) is not None:
        out["o_proj.bias"] = attn.o_proj.bias.detach().double()
    return out


def gdn_head_groups(h: int, hg: int) -> list[list[int]]:
    """The base query heads each GDN head stands for.

    Fewer GDN heads than query heads (the released 3B: 9 for 24): every query head is used, split into
    `hg` contiguous groups as even as possible. Otherwise each GDN head takes one query head in turn.
    """
    if hg >= h:
        return [[j % h] for j in range(hg)]
    bounds = [round(j * h / hg) for j in range(hg + 1)]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(hg)]


def _top_rows(m: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, m.shape[0]]: an orthonormal basis of the `rows`-dim subspace that best keeps m's rows."""
    u, _, _ = torch.linalg.svd(m, full_matrices=False)
    return u[:, :rows].T


@torch.no_grad()
def gdn_weights_from_attention(attn: nn.Module, hcfg: HybridConfig,
                               o_fill: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Copy attention projections into a GDN layer, every query head used.

    GDN head j stands for the query heads of `gdn_head_groups(h, hg)[j]`. Its key space holds their
    query / key rows side by side, so q.k is the sum of those heads' scores; when they do not fit
    (n * dh > gdn_head_dim) both are projected onto one shared basis (the leading left singular vectors
    of [q rows | k rows]). Its value space holds one slot of dh value rows per query head (the head's
    KV head), with that head's o_proj columns; when they do not fit they are projected onto the leading
    singular subspace of the stacked value rows (exact when they repeat one KV head). Unused key dims
    are zero; unused value dims are zero with the o_proj columns of `o_fill` (the layer's default init),
    so they add nothing at first but train (zero columns there would never get a gradient).
    """
    h, g, dh = hcfg.num_attention_heads, hcfg.num_key_value_heads, hcfg.base_head_dim or hcfg.head_dim
    hg, kd, vd = hcfg.gdn_num_heads, hcfg.gdn_head_dim, hcfg.gdn_value_dim
    wq = attn.q_proj.weight.detach().double().view(h, dh, -1)
    wk = attn.k_proj.weight.detach().double().view(g, dh, -1)
    wv = attn.v_proj.weight.detach().double().view(g, dh, -1)
    qw, kw = _qk_norm_weights(attn)
    if qw is not None:
        wq = wq * qw.double().view(1, dh, 1)
    if kw is not None:
        wk = wk * kw.double().view(1, dh, 1)
    d = wq.shape[-1]
    group = h // g
    wo = attn.o_proj.weight.detach().double().view(d, h, dh)
    groups = gdn_head_groups(h, hg)
    # a base head used by several GDN heads (hg > h) shares its output projection among them
    uses = torch.bincount(torch.tensor([a for grp in groups for a in grp]), minlength=h).double()
    fill = o_fill.detach().double().view(d, hg, vd) if o_fill is not None else None
    qs, ks, vs, os_ = [], [], [], []
    for j, heads in enumerate(groups):
        q_cat = torch.cat([wq[a] for a in heads])  # [n*dh, D]
        k_cat = torch.cat([wk[a // group] for a in heads])
        if q_cat.shape[0] > kd:
            basis = _top_rows(torch.cat([q_cat, k_cat], dim=1), kd)
            q_cat, k_cat = basis @ q_cat, basis @ k_cat
        qs.append(_fit(q_cat, kd))
        ks.append(_fit(k_cat, kd))
        v_cat = torch.cat([wv[a // group] for a in heads])  # [n*dh, D]
        o_cat = torch.cat([wo[:, a] / uses[a] for a in heads], dim=1)  # [D, n*dh]
        if v_cat.shape[0] > vd:
            basis = _top_rows(v_cat, vd)
            v_cat, o_cat = basis @ v_cat, o_cat @ basis.T
        used = v_cat.shape[0]
        vs.append(_fit(v_cat, vd))
        o_j = _fit(o_cat.T, vd).T
        if fill is not None and used < vd:
            o_j[:, used:] = fill[:, j, used:]
        os_.append(o_j)
    return {
        "q_proj.weight": torch.stack(qs).reshape(hg * kd, d),
        "k_proj.weight": torch.stack(ks).reshape(hg * kd, d),
        "v_proj.weight": torch.stack(vs).reshape(hg * vd, d),
        "o_proj.weight": torch.stack(os_, dim=1).reshape(d, hg * vd),
    }


@torch.no_grad()
def check_base_weights(base_model: nn.Module, shown: int = 5) -> None:
    """Refuse a base model with NaN or infinite weights: conversion would copy them without a word."""
    bad = []
    for name, p in base_model.named_parameters():
        n_bad = int((~torch.isfinite(p)).sum())
        if n_bad:
            bad.append(f"{name} ({n_bad} value{'s' if n_bad > 1 else ''})")
    if bad:
        more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
        raise UpcycleError(f"the base model has non-finite (NaN/inf) weights in {len(bad)} base tensors: "
                           f"{', '.join(bad[:shown])}{more}; refusing to convert a corrupt checkpoint")


def _identity_conv_(conv: nn.Module) -> None:
    w = conv.weight
    w.zero_()
    w[:, 0, -1] = 1.0
    if getattr(conv, "bias", None) is not None:
        conv.bias.zero_()


@torch.no_grad()
def _calibrate_mla_norms(base_model, model, calibration_ids: torch.Tensor) -> None:
    """Set MLA latent-norm weights to the mean RMS of the latents on calibration tokens."""
    if not getattr(model.config, "mla_latent_norm", True):
        return
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    base_layers = base_model.model.layers
    for i in model.config.mla_layers:
        def hook(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs["hidden_states"]
            captured[i] = x.detach()

        hooks.append(base_layers[i].self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        base_model(input_ids=calibration_ids)
    finally:
        for hk in hooks:
            hk.remove()
    for i, x in captured.items():
        mixer = model.model.layers[i].mixer
        x = x.to(mixer.kv_a_proj_with_mqa.weight.dtype)
        r = model.config.kv_lora_rank
        c_kv = mixer.kv_a_proj_with_mqa(x)[..., :r]
        rms = c_kv.float().pow(2).mean(-1).sqrt().mean()
        mixer.kv_a_layernorm.weight.fill_(float(rms))
        if model.config.q_lora_rank is not None:
            c_q = mixer.q_a_proj(x)
            mixer.q_a_layernorm.weight.fill_(float(c_q.float().pow(2).mean(-1).sqrt().mean()))


def _mixer_weights(attn: nn.Module, dst: nn.Module, hcfg: HybridConfig) -> dict[str, torch.Tensor]:
    """The converted weights of one decoder layer's mixer (identity convs are set on `dst` directly)."""
    if dst.layer_type == "mla":
        return mla_weights_from_attention(attn, hcfg)
    if dst.layer_type == "gdn":
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = getattr(dst.mixer, name, None)
            if conv is not None:
                _identity_conv_(conv)
        return gdn_weights_from_attention(attn, hcfg, o_fill=dst.mixer.o_proj.weight)
    from hylo.layers.mamba2 import mamba2_weights_from_attention

    return mamba2_weights_from_attention(attn, hcfg)


@torch.no_grad()
def upcycle(
    base_model,
    hcfg: HybridConfig | None = None,
    *,
    init: str = "attention",
    calibration_ids: torch.Tensor | None = None,
    progress: bool = False,
    seed: int = 0,
    **config_kwargs: Any,
):
    """Convert a loaded base `LlamaForCausalLM`/`Qwen3ForCausalLM` into a `HyLoForCausalLM`.

    `init="attention"` (default) initialises mixers from the attention weights; `init="random"` keeps
    the mixers' random init (the ablation used by bench/upcycle_quality.py). `seed` fixes what conversion
    does not set (per layer, see below), so a conversion is reproducible. Extra keyword arguments go
    to `hybrid_config_from_base` when `hcfg` is None.
    """
    from hylo.modeling import HyLoForCausalLM

    if init not in ("attention", "random"):
        raise UpcycleError(f"init={init!r}; allowed: attention, random")
    base_cfg = base_model.config
    if getattr(base_cfg, "model_type", None) not in SUPPORTED_BASE_TYPES:
        raise UpcycleError(
            f"base model_type {getattr(base_cfg, 'model_type', None)!r} is not supported; supported: {', '.join(SUPPORTED_BASE_TYPES)}"
        )
    check_base_weights(base_model)
    if hcfg is None:
        import inspect

        valid = [k for k in inspect.signature(hybrid_config_from_base).parameters if k != "base_cfg"]
        unknown = sorted(set(config_kwargs) - set(valid))
        if unknown:
            raise UpcycleError(f"unknown conversion option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
        hcfg = hybrid_config_from_base(base_cfg, **config_kwargs)
    dtype = next(base_model.parameters()).dtype
    model = HyLoForCausalLM(hcfg).to(dtype)
    base = base_model.model
    tgt = model.model
    tgt.embed_tokens.weight.copy_(base.embed_tokens.weight)
    tgt.norm.weight.copy_(base.norm.weight)
    if not hcfg.tie_word_embeddings:
        model.lm_head.weight.copy_(base_model.lm_head.weight)
    layers = range(hcfg.n_layer)
    if progress:
        from tqdm import tqdm

        layers = tqdm(layers, desc="upcycling layers", unit="layer")
    for i in layers:
        src, dst = base.layers[i], tgt.layers[i]
        dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
        dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        dst.mlp.load_state_dict(src.mlp.state_dict())
        # What conversion does not set (decay / step / beta / gate rows of the linear blocks, or every
        # mixer weight with init="random") is drawn from a generator seeded by (seed, layer): the result
        # is reproducible, and layer i starts the same whatever type the other layers have, so two
        # placements differ only where their layer types differ.
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed * 100_003 + i)
        try:
            dst.mixer.apply(model._init_weights)
            if init == "random":
                continue
            weights = _mixer_weights(src.self_attn, dst, hcfg)
        finally:
            torch.random.set_rng_state(rng_state)
        params = dict(dst.mixer.named_parameters())
        for name, w in weights.items():
            if name not in params:
                raise UpcycleError(f"layer {i}: converter produced {name!r} which the {dst.layer_type} mixer lacks")
            if params[name].shape != w.shape:
                raise UpcycleError(f"layer {i}: {name} shape {tuple(w.shape)} != mixer's {tuple(params[name].shape)}")
            params[name].copy_(w.to(params[name].dtype))
    if init == "attention" and calibration_ids is not None:
        if hcfg.mla_layers:
            _calibrate_mla_norms(base_model, model, calibration_ids)
        _calibrate_linear(base_model, model, calibration_ids)
    if hcfg.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = base_model.generation_config
    return model


@torch.no_grad()
def _calibrate_linear(base_model, model, calibration_ids: torch.Tensor, ridge: float = 1e-2,
                      gate_level: float = 1.2785) -> None:
    """Make each upcycled linear layer's output gate ~constant and its output scale the attention's.

    GDN's output is `o_proj(RMSNorm(o) * w * swish(g_proj x))`, Mamba-2's `out_proj(RMSNorm_G(y * SiLU(z)) * w)`
    with z from rows of `in_proj`. A random gate multiplies every channel by noise and erases what the
    copied projections carry. The gate has no bias, so we fit one direction u with u.x ~= 1 on calibration
    inputs (ridge regression) and set every gate row to `gate_level * u` (swish(1.2785) ~= 1); the norm
    weight becomes the attention heads' per-channel RMS (GDN: averaged over heads, as `o_norm` is shared;
    Mamba-2: the RMS of the base head each Mamba head stands for).
    Measured on SmolLM2 (bench/upcycle_quality.py): this turns the linear layers from worse than random
    into a real approximation of the attention they replace.
    """
    cfg = model.config
    lin = [i for i in range(cfg.n_layer) if cfg.layer_type(i) in ("gdn", "mamba2")]
    if not lin:
        return
    cap: dict[tuple[str, int], torch.Tensor] = {}
    hooks = []
    for i in lin:
        attn = base_model.model.layers[i].self_attn

        def pre(mod, args, kwargs, i=i):
            cap[("x", i)] = (args[0] if args else kwargs["hidden_states"]).detach()

        def pre_o(mod, args, i=i):
            cap[("o", i)] = args[0].detach()

        hooks.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(attn.o_proj.register_forward_pre_hook(pre_o))
    try:
        base_model(input_ids=calibration_ids)
    finally:
        for hk in hooks:
            hk.remove()
    h, dh = cfg.num_attention_heads, cfg.base_head_dim or cfg.head_dim
    for i in lin:
        x = cap[("x", i)].reshape(-1, cap[("x", i)].shape[-1]).double()
        o = cap[("o", i)].reshape(-1, h, dh).double()
        mixer = model.model.layers[i].mixer
        d = x.shape[-1]
        gram = x.T @ x + ridge * x.shape[0] * torch.eye(d, dtype=x.dtype)
        u = torch.linalg.solve(gram, x.T @ torch.ones(x.shape[0], dtype=x.dtype))
        rms_HK = o.pow(2).mean(0).sqrt()  # [h, dh] per head and channel
        if cfg.layer_type(i) == "gdn":
            hg, vd = cfg.gdn_num_heads, cfg.gdn_value_dim
            mixer.g_proj.weight.copy_((gate_level * u).expand(hg * vd, d))
            rms = rms_HK.mean(0)  # o_norm is shared by the heads
            slots = max(len(grp) for grp in gdn_head_groups(h, hg))
            if vd < dh or slots * dh > vd:
                # value channels projected or truncated: no channel is one of the base head's
                w = rms.new_full((vd,), float(rms.mean())) if vd >= dh else _fit(rms[:, None], vd)[:, 0]
            else:
                # one slot of dh channels per base head (gdn_weights_from_attention's layout)
                w = rms.repeat(-(-vd // dh))[:vd]
            mixer.o_norm.weight.copy_(w)
        else:
            H, P = mixer.num_heads, mixer.head_dim
            mixer.in_proj.weight[: H * P].copy_((gate_level * u).expand(H * P, d))  # the z rows
            rows = []
            for m in range(H):  # Mamba head m stands for query head m mod h (mamba2_weights_from_attention)
                r = rms_HK[m % h]
                rows.append(r[:P] if P <= dh else torch.cat([r, r.new_full((P - dh,), float(r.mean()))]))
            mixer.norm.weight.copy_(torch.cat(rows))


# A short, fixed calibration text (English prose + code + chat), so conversion needs no dataset.
CALIBRATION_TEXT = (
    "<|im_start|>user\nCan you explain how a hash map works and give a short Python example?<|im_end|>\n"
    "<|im_start|>assistant\nA hash map stores key-value pairs in an array of buckets. A hash function turns "
    "each key into an index; collisions are resolved by chaining or open addressing. Lookups, inserts and "
    "deletes take constant time on average.\n\n```python\nphone_book = {}\nphone_book['alice'] = '555-1234'\n"
    "print(phone_book.get('alice'))\n```\nThe history of the city dates back to the Roman period, when a small "
    "settlement grew along the river. By the twelfth century it had become an important market town, and its "
    "cathedral, finished in 1320, still dominates the skyline.<|im_end|>\n"
)


def calibration_ids_for(tokenizer) -> torch.Tensor:
    ids = tokenizer(CALIBRATION_TEXT, return_tensors="pt").input_ids
    return ids[:, :512]
