"""Importing a released directory: its tensors renamed and permuted into our state dict, loaded strictly into a
`HyLoForCausalLM`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from hylo.config import HYBRID_CONFIG_NAME, HybridConfig
from hylo.modeling import HyLoForCausalLM
from hylo.released.layout import (
    LAYER_KEY,
    LINEAR_PREFIXES,
    MAMBA_PREFIX,
    QK_NORM_NAMES,
    QK_NORM_PARTS,
    SHARED_LAYER_PARTS,
    ReleasedLayoutError,
    interleaved_to_half_perm,
    permute_kv_a,
    permute_norm_rope,
    permute_q_rope,
    read_layout_json,
    released_name,
)
from hylo.released.reading import read_released_tensors, released_hybrid_config, their_mamba2


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
        m = LAYER_KEY.match(key)
        if m is None:
            if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                out[key] = t
            else:
                unknown.append(key)
            continue
        i, part, rest = int(m.group(1)), m.group(2), m.group(3)
        if part in SHARED_LAYER_PARTS:
            out[key] = t
            continue
        if i in mla and (part == "mla" or (part in QK_NORM_PARTS and rest in QK_NORM_NAMES)):
            name = "o_proj." + rest.removeprefix("out_proj.") if rest.startswith("out_proj.") else rest
            if name in ("q_proj.weight", "q_proj.bias", "q_b_proj.weight"):
                _check_rows(t, H * (N + P), key, f"num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim) = "
                                                 f"{H} * ({N} + {P})", where)
                t = permute_q_rope(t, H, N, P, perm)
            elif name in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
                _check_rows(t, R + P, key, f"kv_lora_rank + qk_rope_head_dim = {R} + {P}", where)
                t = permute_kv_a(t, R, perm)
            elif name in QK_NORM_NAMES:
                if f"model.layers.{i}.mixer.{name}" in out:
                    raise ReleasedLayoutError(f"{where}: layer {i} holds {name} under both "
                                              f"{' and '.join(QK_NORM_PARTS)}")
                t = permute_norm_rope(t, N, perm)
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
    p = Path(path)
    tensors = read_released_tensors(p)
    hcfg = released_hybrid_config(p, tensors)
    d_xb = None
    if hcfg.linear_type == "mamba2" and hcfg.linear_layers:
        m2 = their_mamba2(read_layout_json(p / HYBRID_CONFIG_NAME), str(p / HYBRID_CONFIG_NAME))
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
        model.generation_config = GenerationConfig.from_pretrained(p)
    return model.eval()
