"""HybridConfig: the HyLo architecture (which layers are MLA, which are linear, and their shapes).

Keys follow the released HyLo checkpoints (`n_layer`, `mla_layers`, `kv_lora_rank`, ...) plus the
linear-block keys (`linear_type`, `gdn_*`). `config.json` is the source of truth; `hybrid_config.json`
beside it is a derived copy (written from the same object on save) for tools that read the released
layout, and loading refuses a directory where the two disagree (`check_config_files`).
Validation runs on construction and on load; each error names the key and what is allowed.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from hylo.atomic import atomic_write
from hylo.json_files import read_json
from hylo.model_files import MODEL_FIELDS, check_model_config

LINEAR_TYPES = ("gdn", "mamba2")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
HYBRID_CONFIG_NAME = "hybrid_config.json"
# keys that are bookkeeping, not architecture: not compared between config.json and hybrid_config.json
_BOOKKEEPING_KEYS = ("transformers_version", "architectures", "auto_map", "num_hidden_layers", "_name_or_path",
                     "dtype", "torch_dtype", "model_type")


class HybridConfigError(ValueError):
    """Invalid HybridConfig: the message names the key and the allowed values."""


def _layer_indices(value: Any) -> list[int]:
    """`mla_layers` as given: a list of integer layer indices. Anything else (the string "0", a float, a bool,
    a bare number) is a HybridConfigError naming the entry, never read as a layer (int("0") was layer 0)."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise HybridConfigError(f"HybridConfig.mla_layers: must be a list of integer layer indices, got {value!r}")
    for j, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise HybridConfigError(
                f"HybridConfig.mla_layers: must be a list of integer layer indices, got {list(value)!r} (entry {j}, "
                f"{v!r}, is a {type(v).__name__}; a string such as \"0\" is never read as a layer)")
    return [int(v) for v in value]


class HybridConfig(PretrainedConfig):
    """The architecture of a HyLo model: which layers are MLA, the shapes of the MLA and linear mixers, RoPE.

    A transformers `PretrainedConfig` (`model_type` "hylo"), saved as config.json. The keys follow AMD's
    released checkpoints (`n_layer`, `mla_layers`, `kv_lora_rank`, `q_lora_rank`, `qk_rope_head_dim`, ...) plus
    the linear blocks' (`linear_type` "gdn" or "mamba2", `gdn_*`, `mamba2_*`). Every value is checked when the
    config is built and when it is loaded: a `HybridConfigError` names the key and what it accepts.
    `hylo convert` derives one from a base model's config and the conversion's options
    (`hylo.upcycle.ConvertConfig`).
    """

    model_type = "hylo"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        hidden_act: str = "silu",
        n_layer: int = 30,
        mla_layers: list[int] | None = None,
        rms_norm_eps: float = 1e-5,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int | None = None,
        kv_lora_rank: int = 128,
        q_lora_rank: int | None = None,
        qk_rope_head_dim: int = 32,
        qk_nope_head_dim: int = 32,
        rope_key_groups: int = 1,
        mla_latent_norm: bool = True,
        mla_latent_norm_eps: float | None = None,
        kv_b_per_kv_head: bool = False,
        mla_qk_norm: bool = False,
        v_head_dim: int = 64,
        max_position_embeddings: int = 8192,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        rope_parameters: dict[str, Any] | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        linear_type: str = "gdn",
        gdn_num_heads: int = 9,
        gdn_head_dim: int = 64,
        gdn_expand_v: float = 1.0,
        gdn_conv_size: int = 4,
        gdn_chunk_size: int = 64,
        mamba2_num_heads: int | None = None,
        mamba2_head_dim: int | None = None,
        mamba2_state_size: int | None = None,
        mamba2_n_groups: int | None = None,
        mamba2_xb_groups: int | None = None,
        mamba2_norm_eps: float | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        base_model_type: str | None = None,
        base_num_key_value_heads: int | None = None,
        base_head_dim: int | None = None,
        base_tie_word_embeddings: bool | None = None,
        base_config_json: dict[str, Any] | None = None,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.n_layer = n_layer
        self.mla_layers = sorted(_layer_indices(mla_layers))
        self.rms_norm_eps = rms_norm_eps
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.rope_key_groups = rope_key_groups
        self.mla_latent_norm = bool(mla_latent_norm)
        # eps of the latent RMSNorms; None = rms_norm_eps (AMD's released MLA layers use 1e-6)
        self.mla_latent_norm_eps = mla_latent_norm_eps
        # kv_b_proj rows per KV head (each query head reads its GQA group's rows, AMD's layout) rather
        # than per query head (DeepSeek's layout)
        self.kv_b_per_kv_head = bool(kv_b_per_kv_head)
        # per-head RMSNorm of each MLA query and key ([nope | rope], before RoPE, eps rms_norm_eps): Qwen3's
        # q_norm / k_norm, kept by the converter for Qwen3 bases (the cache then holds one 1/RMS per kv_b head)
        self.mla_qk_norm = bool(mla_qk_norm)
        self.v_head_dim = v_head_dim
        self.max_position_embeddings = max_position_embeddings
        # RoPE as transformers 5 writes it: `rope_parameters` = {rope_type, rope_theta, scaling keys}; a config
        # written before (`rope_scaling` + `rope_theta`) reads the same. `rope_theta` stays an attribute too.
        params = dict(rope_parameters or rope_scaling or {})
        self.rope_theta = float(params.pop("rope_theta", rope_theta))
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        self.rope_parameters = {"rope_type": params.pop("rope_type", "default"), **params, "rope_theta": self.rope_theta}
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.linear_type = linear_type
        self.gdn_num_heads = gdn_num_heads
        self.gdn_head_dim = gdn_head_dim
        self.gdn_expand_v = gdn_expand_v
        self.gdn_conv_size = gdn_conv_size
        self.gdn_chunk_size = gdn_chunk_size
        self.mamba2_num_heads = mamba2_num_heads
        self.mamba2_head_dim = mamba2_head_dim
        self.mamba2_state_size = mamba2_state_size
        self.mamba2_n_groups = mamba2_n_groups
        # x and B projected for this many groups, each read by heads / groups consecutive heads (the
        # Zebra-Llama / HyLo Mamba-2 layer: d_xb = groups * state, as GQA's KV heads); None: x per head,
        # B shared like C in mamba2_n_groups groups (mamba_ssm's layer)
        self.mamba2_xb_groups = mamba2_xb_groups
        # eps of the Mamba-2 gated output norm; None = rms_norm_eps (AMD's Mamba-2 layers use 1e-5)
        self.mamba2_norm_eps = mamba2_norm_eps
        self.initializer_range = initializer_range
        self.base_model_type = base_model_type
        self.base_num_key_value_heads = base_num_key_value_heads
        self.base_head_dim = base_head_dim
        # the base model's config.json `tie_word_embeddings` (what the released layout writes back into its
        # config.json, whatever the hybrid's own head does); None = tie_word_embeddings
        self.base_tie_word_embeddings = None if base_tie_word_embeddings is None else bool(base_tie_word_embeddings)
        # the base config.json a released checkpoint carried (imported): written back verbatim on export
        self.base_config_json = dict(base_config_json) if base_config_json else None
        self.use_cache = use_cache
        # transformers' generic code reads num_hidden_layers
        self.num_hidden_layers = n_layer
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    @property
    def rope_scaling(self) -> dict[str, Any] | None:  # type: ignore[override]
        """The MLA RoPE's scaling (`rope_parameters` without `rope_theta`), None for plain RoPE."""
        params = getattr(self, "rope_parameters", None) or {}
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return None if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1 else scaling

    @rope_scaling.setter
    def rope_scaling(self, value: dict[str, Any] | None) -> None:
        self.rope_parameters = {"rope_type": "default", **dict(value or {}), "rope_theta": self.rope_theta}

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_b_heads(self) -> int:
        """Heads of kv_b_proj: the KV heads with `kv_b_per_kv_head`, else every query head."""
        return self.num_key_value_heads if self.kv_b_per_kv_head else self.num_attention_heads

    @property
    def latent_norm_eps(self) -> float:
        return self.rms_norm_eps if self.mla_latent_norm_eps is None else float(self.mla_latent_norm_eps)

    @property
    def gdn_value_dim(self) -> int:
        return int(self.gdn_head_dim * self.gdn_expand_v)

    @property
    def mamba2_dims(self) -> tuple[int, int, int, int]:
        """(heads, head_dim, state_size, n_groups) of a Mamba-2 layer; None keys derive from the attention
        shape (heads = num_attention_heads, head_dim = state_size = head_dim, one group per head) so that
        x, B, C copy from W_v, W_k, W_q without truncation. Conv width and chunk size are gdn_conv_size
        and gdn_chunk_size (shared by both linear blocks)."""
        heads = self.mamba2_num_heads or self.num_attention_heads
        head_dim = self.mamba2_head_dim or self.head_dim
        state = self.mamba2_state_size or self.head_dim
        groups = self.mamba2_n_groups or heads
        return heads, head_dim, state, groups

    @property
    def mamba2_norm_eps_value(self) -> float:
        return self.rms_norm_eps if self.mamba2_norm_eps is None else float(self.mamba2_norm_eps)

    @property
    def linear_layers(self) -> list[int]:
        mla = set(self.mla_layers)
        return [i for i in range(self.n_layer) if i not in mla]

    def layer_type(self, idx: int) -> str:
        return "mla" if idx in set(self.mla_layers) else self.linear_type

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(key: str, msg: str) -> None:
            raise HybridConfigError(f"HybridConfig.{key}: {msg}")

        for key in ("vocab_size", "hidden_size", "intermediate_size", "n_layer", "num_attention_heads",
                    "num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                    "gdn_num_heads", "gdn_head_dim", "gdn_conv_size", "max_position_embeddings",
                    "gdn_chunk_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(key, f"must be a positive integer, got {v!r}")
        if self.qk_nope_head_dim < 0:
            bad("qk_nope_head_dim", f"must be >= 0, got {self.qk_nope_head_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            bad("hidden_act", f"{self.hidden_act!r} is not supported; allowed: {', '.join(HIDDEN_ACTS)}")
        if self.linear_type not in LINEAR_TYPES:
            bad("linear_type", f"{self.linear_type!r} is unknown; allowed: {', '.join(LINEAR_TYPES)}")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            bad("mla_layers", f"contains duplicates: {self.mla_layers}")
        for i in self.mla_layers:
            if not 0 <= i < self.n_layer:
                bad("mla_layers", f"layer index {i} is out of range; allowed: 0..{self.n_layer - 1} (n_layer={self.n_layer})")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"{self.num_key_value_heads} must divide num_attention_heads={self.num_attention_heads}")
        if self.kv_lora_rank % 8:
            bad("kv_lora_rank", f"must be a multiple of 8, got {self.kv_lora_rank}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or isinstance(self.q_lora_rank, bool)
                                             or self.q_lora_rank <= 0 or self.q_lora_rank % 8):
            bad("q_lora_rank", f"must be null (no query compression) or a positive multiple of 8, got {self.q_lora_rank!r}")
        if self.mla_latent_norm_eps is not None and not float(self.mla_latent_norm_eps) > 0:
            bad("mla_latent_norm_eps", f"must be > 0 or null (= rms_norm_eps), got {self.mla_latent_norm_eps!r}")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", f"must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if not isinstance(self.rope_key_groups, int) or self.rope_key_groups < 1:
            bad("rope_key_groups", f"must be a positive integer, got {self.rope_key_groups!r}")
        if self.qk_rope_head_dim % (2 * self.rope_key_groups):
            bad("qk_rope_head_dim", (
                f"{self.qk_rope_head_dim} must be a multiple of 2 * rope_key_groups = {2 * self.rope_key_groups} "
                f"(each group of the shared roped key holds whole RoPE pairs)"))
        per_group_rope = self.qk_rope_head_dim // self.rope_key_groups
        if self.mla_qk_norm and self.rope_key_groups > 1 and (self.num_attention_heads % self.rope_key_groups
                                                              or self.kv_b_heads % self.rope_key_groups):
            bad("rope_key_groups", (
                f"with mla_qk_norm, rope_key_groups={self.rope_key_groups} must divide num_attention_heads="
                f"{self.num_attention_heads} and the kv_b_proj heads ({self.kv_b_heads}): each head's q/k norm runs "
                f"over its nope dims and its group's block of the roped key"))
        if self.base_head_dim is not None and self.qk_nope_head_dim + per_group_rope != self.base_head_dim:
            bad("qk_nope_head_dim", (
                f"qk_nope_head_dim + qk_rope_head_dim / rope_key_groups = {self.qk_nope_head_dim} + {per_group_rope} "
                f"must equal the base model's head_dim {self.base_head_dim}"))
        for key in ("mamba2_num_heads", "mamba2_head_dim", "mamba2_state_size", "mamba2_n_groups"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                bad(key, f"must be a positive integer or null (derive from the attention shape), got {v!r}")
        m_heads, _, _, m_groups = self.mamba2_dims
        if m_heads % m_groups:
            bad("mamba2_n_groups", f"{m_groups} must divide the Mamba-2 head count {m_heads}")
        xb = self.mamba2_xb_groups
        if xb is not None and (not isinstance(xb, int) or isinstance(xb, bool) or xb <= 0 or m_heads % xb):
            bad("mamba2_xb_groups", f"must be null (x per head) or a positive divisor of the Mamba-2 head count "
                                    f"{m_heads}, got {xb!r}")
        if self.mamba2_norm_eps is not None and not float(self.mamba2_norm_eps) > 0:
            bad("mamba2_norm_eps", f"must be > 0 or null (= rms_norm_eps), got {self.mamba2_norm_eps!r}")
        if self.gdn_head_dim % 2:
            bad("gdn_head_dim", f"must be even, got {self.gdn_head_dim}")
        if self.gdn_value_dim <= 0 or self.gdn_head_dim * self.gdn_expand_v != self.gdn_value_dim:
            bad("gdn_expand_v", f"gdn_head_dim * gdn_expand_v must be a positive integer, got {self.gdn_head_dim} * {self.gdn_expand_v}")
        if self.rope_scaling is not None:
            rtype = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rtype not in ("yarn", "default", "linear", None):
                bad("rope_scaling", f"rope_type {rtype!r} is not supported; allowed: yarn, linear, default")
            if rtype == "yarn" and float(self.rope_scaling.get("factor", 0)) < 1.0:
                bad("rope_scaling", "yarn needs factor >= 1")
        # what every model file is checked for (hylo/model_files.py): finite numbers, sizes within the caps
        fields = {k: getattr(self, k) for k in MODEL_FIELDS if k in self.__dict__ and k != "num_hidden_layers"}
        check_model_config({**fields, "rope_parameters": self.rope_parameters}, "HybridConfig", HybridConfigError,
                           ranks_within_hidden=False)

    # ------------------------------------------------------------------ accounting
    def mla_cache_values_per_token(self) -> int:
        """Cached values per token of one MLA layer: latent + shared roped key, plus with `mla_qk_norm` one
        key 1/RMS per kv_b_proj head (the key norm's per-token factor, which the absorbed decode cannot rebuild)."""
        return self.kv_lora_rank + self.qk_rope_head_dim + (self.kv_b_heads if self.mla_qk_norm else 0)

    def kv_cache_values_per_token(self) -> int:
        """Cached values per token over all layers: MLA layers as `mla_cache_values_per_token`; linear layers none."""
        return len(self.mla_layers) * self.mla_cache_values_per_token()

    # ------------------------------------------------------------------ io
    def save_hybrid_config(self, directory: str | Path) -> Path:
        path = Path(directory) / HYBRID_CONFIG_NAME
        data = self.to_dict()
        for k in ("transformers_version", "architectures", "auto_map", "num_hidden_layers"):
            data.pop(k, None)
        atomic_write(path, json.dumps(data, indent=2, sort_keys=True))
        return path

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # type: ignore[override]
        """transformers' loader, plus: a local directory whose hybrid_config.json disagrees with config.json is refused."""
        if Path(str(pretrained_model_name_or_path)).is_dir():
            check_config_files(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_hybrid_json(cls, path: str | Path) -> HybridConfig:
        p = Path(path)
        if p.is_dir():
            check_config_files(p)
            p = p / HYBRID_CONFIG_NAME
        if not p.is_file():
            raise HybridConfigError(f"{p}: no {HYBRID_CONFIG_NAME} found (is this a HyLo checkpoint?)")
        data = read_json(p, HybridConfigError, mapping=True)
        if data.get("model_type") != "hylo" and any(k in data for k in ("use_lora_layer_norm", "use_full_kv_head", "ssm_cfg")):
            raise HybridConfigError(
                f"{p}: written by AMD's Hybrid-Models code (the released layout: their keys, the vocabulary in "
                f"config.json, `mla.*` weights); load the directory with hylo.io.load_hylo (it imports this layout) "
                f"or convert it with `python jobs/convert.py --from-released DIR --out OUT`")
        missing = [k for k in ("vocab_size", "hidden_size", "n_layer", "num_attention_heads", "mla_layers") if k not in data]
        if missing:
            # never fall back to the class defaults (SmolLM2's vocabulary, bos/eos 1/2) for a model's shape
            raise HybridConfigError(f"{p}: missing key(s) {', '.join(missing)}; not a complete HyLo hybrid config")
        data.pop("model_type", None)
        try:
            return cls(**data)
        except HybridConfigError as e:
            raise HybridConfigError(f"{p}: {e}") from None


def base_kv_values_per_token(base_config: Any) -> int:
    """Cached values per token of a GQA base model: 2 * n_kv_heads * head_dim per layer."""
    n_heads = base_config.num_attention_heads
    n_kv = getattr(base_config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // n_heads
    return base_config.num_hidden_layers * 2 * n_kv * head_dim


def _architecture(data: dict[str, Any], where: Path) -> dict[str, Any]:
    """Every architecture key of a config dict, defaults filled in (so an absent key compares as its default)."""
    data = {k: v for k, v in data.items() if k not in _BOOKKEEPING_KEYS}
    try:
        full = HybridConfig(**data).to_dict()
    except (HybridConfigError, TypeError) as e:
        raise HybridConfigError(f"{where}: {e}") from None
    return {k: v for k, v in full.items() if k not in _BOOKKEEPING_KEYS}


def check_config_files(directory: str | Path) -> None:
    """Raise when a checkpoint's config.json (the source of truth) and hybrid_config.json (its derived copy)
    describe different models; names every differing key with both values."""
    d = Path(directory)
    main, derived = d / "config.json", d / HYBRID_CONFIG_NAME
    if not (main.is_file() and derived.is_file()):
        return
    a, b = read_json(main, HybridConfigError, mapping=True), read_json(derived, HybridConfigError, mapping=True)
    if a.get("model_type") != HybridConfig.model_type:
        return
    arch_a, arch_b = _architecture(a, main), _architecture(b, derived)
    diff = sorted(k for k in set(arch_a) | set(arch_b) if arch_a.get(k) != arch_b.get(k))
    if diff:
        shown = "; ".join(f"{k}: config.json {arch_a.get(k)!r} vs {HYBRID_CONFIG_NAME} {arch_b.get(k)!r}"
                          for k in diff[:8])
        raise HybridConfigError(
            f"{d}: config.json and {HYBRID_CONFIG_NAME} disagree ({shown}). config.json is the source of truth and "
            f"{HYBRID_CONFIG_NAME} a copy written from it on save: make the same edit in both files")
