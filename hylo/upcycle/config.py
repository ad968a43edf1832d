"""The options of a conversion (`ConvertConfig`), a leaf module: it imports nothing of the project.

jobs/convert.py's flags, the convert job's YAML and the training config's `model.convert` are all this
class; `hylo.upcycle.options` (what the options give for a base model) and the converter import it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar


class UpcycleError(ValueError):
    """The base model cannot be converted; the message says why and what is supported."""


# ---------------------------------------------------------------------------------------------- options
@dataclass
class ConvertConfig:
    """Every option of a conversion; None = derive it from the base model."""

    # MLA layer indices: a list, 'even', 'odd', 'uniform:N', 'all', 'none' or '0,5,10' (the rest: linear).
    mla_layers: str | list[int] = "even"
    # Latent rank of the joint nope-key/value SVD; default: its full rank capped at 256.
    kv_lora_rank: int | None = None
    # Query latent rank; None keeps the queries whole (exact).
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    # Blocks of the shared roped key: the number of KV heads (exact init) or 1 (one shared key).
    rope_key_groups: int | None = None
    # Keep DeepSeek's RMSNorm on the MLA latents (calibrated to their RMS); off for upcycling.
    mla_latent_norm: bool = False
    mla_latent_norm_eps: float | None = None
    # kv_b_proj rows per KV head, read by the query heads of each group (the released layout).
    kv_b_per_kv_head: bool = False
    v_head_dim: int | None = None
    gdn_num_heads: int | None = None
    gdn_head_dim: int | None = None
    # GDN value dims = gdn_head_dim * gdn_expand_v (default 1.0).
    gdn_expand_v: float | None = None
    # The linear blocks: gdn (Gated DeltaNet) or mamba2.
    linear_type: str = "gdn"
    # Mamba-2: x and B in this many groups read by consecutive heads (the number of KV heads gives Zebra-Llama's
    # / AMD's released layout, d_xb = KV heads x head_dim); None: x per head (mamba_ssm's layout).
    mamba2_xb_groups: int | None = None
    # The MLA RoPE scaling (a transformers rope_scaling mapping); None: the base's, when MLA can carry it.
    rope_scaling: dict[str, Any] | None = None
    # YaRN on the MLA RoPE with this factor (the released 64K models: 32), over an original window
    # (default: max positions / factor; the released models: 2048).
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    # None keeps the base's choice; false gives the hybrid its own LM head (a copy of the base's).
    tie_word_embeddings: bool | None = None
    # attention: mixers from the attention weights; random: their default init (an ablation).
    init: str = "attention"
    # Seed of what conversion does not set (the linear blocks' decay/step/beta rows), per layer.
    seed: int = 0
    # The calibration pass (MLA latent norms, linear blocks' gates and output norms) on a built-in text
    # tokenised with the base's tokenizer; turning it off is the only way to skip it.
    calibrate: bool = True
    # The dtype the base is loaded in and the hybrid is written in.
    dtype: str = "float32"

    # What each field accepts (pipeline's config loader turns these into its field rules).
    RANGES: ClassVar[dict[str, dict[str, Any]]] = {
        "kv_lora_rank": {"ge": 1}, "q_lora_rank": {"ge": 1}, "qk_rope_head_dim": {"ge": 1},
        "qk_nope_head_dim": {"ge": 0}, "rope_key_groups": {"ge": 1}, "mla_latent_norm_eps": {"gt": 0},
        "v_head_dim": {"ge": 1}, "mamba2_xb_groups": {"ge": 1}, "gdn_num_heads": {"ge": 1}, "gdn_head_dim": {"ge": 1}, "gdn_expand_v": {"gt": 0},
        "yarn_factor": {"ge": 1}, "yarn_original_max_position_embeddings": {"ge": 1},
        "max_position_embeddings": {"ge": 1}, "init": {"choices": ("attention", "random")}, "seed": {"ge": 0},
        "dtype": {"choices": ("float32", "bfloat16", "float16")},
    }
    # The options of the conversion run; every other field shapes the HybridConfig.
    RUN_OPTIONS: ClassVar[tuple[str, ...]] = ("init", "seed", "calibrate", "dtype")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(ConvertConfig)
        for name, allowed in self.RANGES.items():
            why = _range_problem(getattr(self, name), allowed, hints[name])
            if why:
                raise UpcycleError(f"{name} ({_flag(name)}) = {getattr(self, name)!r}: {why}")
        spec = self.mla_layers
        items = spec if isinstance(spec, list | tuple) else [spec]
        if not (isinstance(spec, str) or all(isinstance(i, int) and not isinstance(i, bool) for i in items)):
            raise UpcycleError(f"mla_layers (--mla-layers) = {spec!r}: must be a placement name ('even', 'odd', "
                               "'uniform:N', 'all', 'none'), '0,5,10' or a list of layer indices")

    def hybrid_options(self) -> dict[str, Any]:
        """The shape options (what `hybrid_config_from_base` reads)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.RUN_OPTIONS}

    def non_defaults(self) -> dict[str, Any]:
        """The options that differ from the defaults (what a user set), for messages and fingerprints."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


def _range_problem(value: Any, allowed: dict[str, Any], hint: Any) -> str | None:
    """Why `value` breaks its range (None values mean 'the default' and are not checked)."""
    if value is None:
        return None
    if "choices" in allowed:
        return None if value in allowed["choices"] else f"must be one of {', '.join(allowed['choices'])}"
    optional = type(None) in typing.get_args(hint)
    default = "; omit it for the default" if optional else ""
    if int in (hint, *typing.get_args(hint)):
        low = allowed["ge"]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return ("must be a positive integer" if low == 1 else f"must be an integer >= {low}") + default
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "must be a finite number"
    if "gt" in allowed and not value > allowed["gt"]:
        return f"must be > {allowed['gt']}{default}"
    if "ge" in allowed and not value >= allowed["ge"]:
        return f"must be >= {allowed['ge']}{default}"
    return None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
