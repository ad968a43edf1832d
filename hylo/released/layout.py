"""What the released layout is: its keys, its error, how a directory is recognised, how our tensor names and
RoPE rows map onto it (shared by the import, the export and hylo/released_xecomla.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from hylo.config import HYBRID_CONFIG_NAME
from hylo.json_files import read_json
from hylo.released_facts import HYBRID_CONFIG_FIELDS, HYBRID_CONFIG_REMOVED

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
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.([A-Za-z_]+)\.(.+)$")
SHARED_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")
# where a Qwen HyLo MLA layer's per-head q/k RMSNorm weights may sit (their names are not public): Qwen3's own
# names under the mixer's prefix, or under Qwen3's attention prefix
QK_NORM_PARTS = ("mla", "self_attn")
QK_NORM_NAMES = ("q_norm.weight", "k_norm.weight")


class ReleasedLayoutError(ValueError):
    """A released-layout checkpoint cannot be imported, or a model cannot be exported to that layout exactly."""


# ---------------------------------------------------------------------------------------------- detection
def read_layout_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReleasedLayoutError(f"{path} does not exist")
    return read_json(path, ReleasedLayoutError, mapping=True)


def is_released_layout(path: str | Path) -> bool:
    """True when `path/hybrid_config.json` was written by AMD's code (their keys, no `model_type: hylo`); X-EcoMLA
    checkpoints (MLA_config.json + mla_layer_config.json) are `hylo.released_xecomla.is_xecomla_layout`."""
    p = Path(path) / HYBRID_CONFIG_NAME
    try:
        data = read_json(p, ValueError)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("model_type") != "hylo" and any(k in data for k in AMD_ONLY_KEYS)


# ---------------------------------------------------------------------------------------------- rope rows
def interleaved_to_half_perm(P: int) -> torch.Tensor:
    """Row order taking an interleaved rope block (pairs 2i, 2i+1) to rotate-half (pairs i, i + P/2):
    `ours = theirs[perm]`."""
    return torch.cat([torch.arange(0, P, 2), torch.arange(1, P, 2)])


def permute_q_rope(w: torch.Tensor, H: int, N: int, P: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the rope rows of every query head of a [H * (N + P), ...] weight or bias."""
    rest = w.shape[1:]
    w_H = w.reshape(H, N + P, *rest)
    return torch.cat([w_H[:, :N], w_H[:, N:][:, perm]], dim=1).reshape(H * (N + P), *rest)


def permute_kv_a(w: torch.Tensor, R: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the k_pe rows (after the R latent rows) of kv_a_proj_with_mqa's weight or bias."""
    return torch.cat([w[:R], w[R:][perm]], dim=0)


def permute_norm_rope(w: torch.Tensor, N: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the rope part (after the N nope entries) of a per-head [nope | rope] norm weight."""
    return torch.cat([w[:N], w[N:][perm]])


# ---------------------------------------------------------------------------------------------- names
def released_name(key: str, mla_layers: set[int] | list[int], linear_type: str = "gdn") -> str:
    """The released layout's name of one of our state-dict keys."""
    m = LAYER_KEY.match(key)
    if m is None or m.group(2) != "mixer":
        return key
    i, rest = int(m.group(1)), m.group(3)
    if i in set(mla_layers):
        rest = "out_proj." + rest.removeprefix("o_proj.") if rest.startswith("o_proj.") else rest
        return f"model.layers.{i}.mla.{rest}"
    return f"model.layers.{i}.{MAMBA_PREFIX if linear_type == 'mamba2' else 'gdn'}.{rest}"
