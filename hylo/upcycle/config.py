"""The options of a conversion (`ConvertConfig`), a leaf module: it imports only hylo.rules (the `@rules` of
the config system, which states each option's range).

jobs/convert.py's flags, the convert job's YAML and the training config's `model.convert` are all this
class; `hylo.upcycle.options` (what the options give for a base model) and the converter import it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from hylo.rules import SEED, FieldError, above, at_least, between, field_rules, one_of, rules


class UpcycleError(ValueError):
    """The base model cannot be converted; the message says why and what is supported."""


class ConvertOptionError(FieldError, UpcycleError):
    """An option out of its range (its `@rules`): named with its flag, `kv_lora_rank (--kv-lora-rank) = 0:
    must be >= 1`; the config loader words it as every field error (`convert.kv_lora_rank=0: must be >= 1`)."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        ValueError.__init__(self, f"{field} ({_flag(field)}) = {value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason


# YaRN's factor stretches the original RoPE window: the released 64K models use 32 (2,048 -> 65,536 positions);
# 1,024 would take a 2K window to 2M positions, beyond any published long-context setting.
MAX_YARN_FACTOR = 1024

# How the mixers are initialised: from the attention weights, or their default init (an ablation).
INITS = ("attention", "random")


# ---------------------------------------------------------------------------------------------- options
@dataclass
@rules(kv_lora_rank=at_least(1), q_lora_rank=at_least(1), qk_rope_head_dim=at_least(1), qk_nope_head_dim=at_least(0),
       rope_key_groups=at_least(1), mla_latent_norm_eps=above(0), v_head_dim=at_least(1), mamba2_xb_groups=at_least(1),
       mamba2_norm_eps=above(0),
       gdn_num_heads=at_least(1), gdn_head_dim=at_least(1), gdn_expand_v=above(0), yarn_factor=between(1, MAX_YARN_FACTOR),
       yarn_original_max_position_embeddings=at_least(1), max_position_embeddings=at_least(1),
       init=one_of(*INITS), seed=SEED, dtype=one_of("float32", "bfloat16", "float16"))
class ConvertConfig:
    """Every option of a conversion; None = derive it from the base model."""

    # MLA layer indices: a list, 'even', 'odd', 'uniform:N', 'all', 'none' or '0,5,10' (the rest: linear).
    mla_layers: str | list[int] = "even"
    # Latent rank of the joint nope-key/value SVD; default: its full rank capped at 256.
    kv_lora_rank: int | None = None
    # Query latent rank; None keeps the queries whole (exact).
    q_lora_rank: int | None = None
    # Per-head dims of the roped and the un-roped parts of MLA's queries and keys.
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    # Blocks of the shared roped key: the number of KV heads (exact init) or 1 (one shared key).
    rope_key_groups: int | None = None
    # Keep DeepSeek's RMSNorm on the MLA latents (calibrated to their RMS); off for upcycling.
    mla_latent_norm: bool = False
    # Their epsilon (default: the base's RMSNorm epsilon; AMD's released MLA layers use 1e-6).
    mla_latent_norm_eps: float | None = None
    # kv_b_proj rows per KV head, read by the query heads of each group (the released layout).
    kv_b_per_kv_head: bool = False
    # Per-head value dim of MLA (default: the base's head dim).
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
    # Mamba-2: epsilon of the gated output RMSNorm (default: the base's RMSNorm epsilon; AMD's released Mamba-2
    # layers fix it at 1e-5, so a base with another one, e.g. Qwen3's 1e-6, exports exactly only with 1e-5).
    mamba2_norm_eps: float | None = None
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

    # The options of the conversion run; every other field shapes the HybridConfig.
    RUN_OPTIONS: ClassVar[tuple[str, ...]] = ("init", "seed", "calibrate", "dtype")

    # A broken range names the option and its flag, and is an UpcycleError too (ConvertOptionError).
    __field_error__ = ConvertOptionError

    def __post_init__(self) -> None:
        # The ranges are the @rules above (checked first); what rules do not check is the type of a value
        # given in code (the config loader checks it for YAML and --set).
        hints = typing.get_type_hints(ConvertConfig)
        for name in _NUMERIC:
            value = getattr(self, name)
            integer = int in (hints[name], *typing.get_args(hints[name]))
            if value is not None and (isinstance(value, bool) or not isinstance(value, int if integer else int | float)):
                raise ConvertOptionError(name, value, "must be an integer" if integer else "must be a number")
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# The options whose type code could get wrong (numbers), checked in __post_init__.
_NUMERIC = tuple(name for name, rule in field_rules(ConvertConfig).items() if rule.choices is None)
