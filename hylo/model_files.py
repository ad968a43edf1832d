"""Model files read from disk, checked field by field before anything is built from them.

Every reader of a model's own files uses this module: a base model's and a teacher's config.json, a released
layout's config.json + hybrid_config.json (hylo/released/reading.py), an X-EcoMLA directory's config.json +
MLA_config.json + mla_layer_config.json (hylo/released_xecomla.py) and our own HybridConfig. What they hold
reaches transformers' config classes, the shape arithmetic of the converter and torch's allocators; a
hostile value there gave a ZeroDivisionError (0 heads), a RecursionError, an IndexError (a rank larger than
its tensor) or minutes of work (10^6 layers) instead of one line naming the file and the field.

Design choices:
* `check_model_config(data, where, error)` checks every field of `MODEL_FIELDS` a file holds (absent keys are
  the reader's to default or demand), every number anywhere in the file is finite (JSON's NaN / Infinity,
  which Python's json module reads without a word), and the relations that would otherwise divide by zero
  or index past a tensor: query heads a multiple of KV heads, the hidden size a multiple of the heads where
  the head dim is derived from it, latent ranks within the hidden size they factor, an even RoPE dim.
* The caps are generous but finite (the largest published decoders have 126 layers, a hidden size of
  16,384, 128 heads and a vocabulary of 262,144): `MAX_LAYERS` 1,024, `MAX_HIDDEN` 65,536 (also the cap of a
  latent rank), `MAX_INTERMEDIATE` 1,048,576, `MAX_HEADS` 1,024, `MAX_HEAD_DIM` 1,024, `MAX_VOCAB` 4,194,304,
  `MAX_POSITIONS` 67,108,864. A value past one is refused in microseconds instead of building a model.
* Each reader passes its own error class (UpcycleError for a base, ReleasedLayoutError for an import,
  HybridConfigError for our config), so its callers and the command line's error contract (one line, exit
  status 2) are unchanged; `ModelFileError` is the class for files no reader class owns (a teacher's).
* Weights: `nonfinite_tensors` finds a tensor's NaN / inf values by one min/max reduction (NaN propagates,
  an inf is the min or max), about 2.4 GB/s of bf16 on one loaded CPU core against 0.06 GB/s for isfinite,
  and counts them (in chunks, no full-size boolean mask) only in a tensor that has some;
  `check_finite_tensors` runs it over tensors in memory (an import reads them all anyway),
  `check_finite_weights` streams a directory's .safetensors files one tensor at a time (a teacher before
  Ray starts: its memory is that of its largest tensor). Both name the file and the tensors.

This module imports torch only inside the weight checks, so config checks stay fast to import.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_LAYERS = 1024
MAX_HIDDEN = 65536
MAX_INTERMEDIATE = 1 << 20
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB = 1 << 22
MAX_POSITIONS = 1 << 26
# elements per isfinite() call of the weight checks (a bool mask of 64 MiB at most)
_CHUNK = 1 << 26


class ModelFileError(ValueError):
    """A model file holds a value no model can be built from; the message names the file and the field."""


@dataclass(frozen=True)
class Field:
    """The range of one field: an integer in [low, high], or (`real`) a finite number above `low`."""

    low: float
    high: float | None = None
    real: bool = False
    nullable: bool = False

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "must be set"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"must be {'a number' if self.real else 'an integer'}"
        if self.real:
            if not math.isfinite(value):
                return "must be a finite number"
            return None if value > self.low else f"must be > {self.low:g}"
        if not isinstance(value, numbers.Integral):
            return "must be an integer"
        if value < self.low:
            return f"must be >= {self.low:g}"
        if self.high is not None and value > self.high:
            return f"must be <= {int(self.high):,} (this project's cap; the largest published models are far below it)"
        return None


def _count(high: int, low: int = 1, nullable: bool = False) -> Field:
    return Field(low, high, nullable=nullable)


# The sizes every layout names the same way (transformers' config.json, AMD's hybrid_config.json, DeepSeek-V3's
# layer config, X-EcoMLA's MLA_config.json); null where a file may leave it to a default.
MODEL_FIELDS: dict[str, Field] = {
    "num_hidden_layers": _count(MAX_LAYERS), "n_layer": _count(MAX_LAYERS),
    "hidden_size": _count(MAX_HIDDEN), "d_model": _count(MAX_HIDDEN),
    "intermediate_size": _count(MAX_INTERMEDIATE),
    "num_attention_heads": _count(MAX_HEADS),
    "num_key_value_heads": _count(MAX_HEADS, nullable=True),
    "llama_num_key_value_heads": _count(MAX_HEADS), "mla_num_key_value_heads": _count(MAX_HEADS),
    "head_dim": _count(MAX_HEAD_DIM, nullable=True),
    "vocab_size": _count(MAX_VOCAB, nullable=True),
    "max_position_embeddings": _count(MAX_POSITIONS),
    "kv_lora_rank": _count(MAX_HIDDEN), "q_lora_rank": _count(MAX_HIDDEN, nullable=True),
    "qk_rope_head_dim": _count(MAX_HEAD_DIM), "qk_nope_head_dim": _count(MAX_HEAD_DIM, low=0),
    "v_head_dim": _count(MAX_HEAD_DIM),
    "d_inner": _count(MAX_INTERMEDIATE, nullable=True), "d_xb": _count(MAX_INTERMEDIATE, nullable=True),
    "gdn_num_heads": _count(MAX_HEADS), "gdn_head_dim": _count(MAX_HEAD_DIM),
    "rope_theta": Field(0, real=True), "rms_norm_eps": Field(0, real=True),
    "initializer_range": Field(-1e-300, real=True, nullable=True),
}


def _nonfinite(value: Any, key: str) -> Iterable[tuple[str, Any]]:
    """(dotted key, value) of every non-finite number in a JSON value."""
    if isinstance(value, float) and not math.isfinite(value):
        yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _nonfinite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _nonfinite(v, f"{key}[{i}]")


def check_model_config(data: Mapping[str, Any], where: str | Path, error: type[Exception] = ModelFileError,
                       derives_head_dim: bool = True, ranks_within_hidden: bool = True) -> None:
    """Raise `error("<where>: <field> = <value>: <why>")` for the first field of a model config file that no
    model can be built from. `derives_head_dim`: the file's layout takes the head dim as hidden_size / heads
    when `head_dim` is absent (transformers' decoders, our HybridConfig), so the heads must divide it.
    `ranks_within_hidden`: a file's latent ranks factor its hidden states (an imported SVD), so they are at
    most hidden_size (our own HybridConfig, and a config.json of `model_type: hylo`, allows a wider latent:
    the converter refuses one as an option)."""

    def bad(key: str, value: Any, why: str) -> None:
        raise error(f"{where}: {key} = {value!r}: {why}")

    for key, value in _nonfinite(data, ""):
        bad(key, value, "not a finite number")
    for key, field in MODEL_FIELDS.items():
        if key in data:
            why = field.problem(data[key])
            if why:
                bad(key, data[key], why)

    def given(key: str) -> int | None:
        v = data.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    heads, kv, hidden = given("num_attention_heads"), given("num_key_value_heads"), given("hidden_size")
    if heads is not None and kv is not None and heads % kv:
        bad("num_key_value_heads", kv, f"must divide num_attention_heads = {heads} (each KV head serves a whole "
                                       f"group of query heads)")
    # transformers' Llama config asserts it whatever head_dim says
    if derives_head_dim and heads is not None and hidden is not None and hidden % heads and (
            data.get("head_dim") is None or data.get("model_type") == "llama"):
        bad("hidden_size", hidden, f"must be a multiple of num_attention_heads = {heads} (the head dim is "
                                   f"hidden_size / num_attention_heads)")
    ranks_within_hidden = ranks_within_hidden and data.get("model_type") != "hylo"
    for key in ("kv_lora_rank", "q_lora_rank"):
        rank = given(key)
        if rank is not None and hidden is not None and ranks_within_hidden:
            check_rank(rank, key, hidden, where, error)
    rope = given("qk_rope_head_dim")
    if rope is not None and rope % 2:
        bad("qk_rope_head_dim", rope, "must be even (RoPE rotates pairs of dims)")
    for key in ("rope_scaling", "rope_parameters"):
        rs = data.get(key)
        if rs is None:
            continue
        if not isinstance(rs, Mapping):
            bad(key, rs, "must be an object (rope_type, factor, ...) or null")
        if "factor" in rs and rs["factor"] is not None and Field(0, real=True).problem(rs["factor"]):
            bad(f"{key}.factor", rs["factor"], Field(0, real=True).problem(rs["factor"]) or "")
        omp = rs.get("original_max_position_embeddings")
        if omp is not None and _count(MAX_POSITIONS).problem(omp):
            bad(f"{key}.original_max_position_embeddings", omp, _count(MAX_POSITIONS).problem(omp) or "")
        theta = rs.get("rope_theta")
        if theta is not None and MODEL_FIELDS["rope_theta"].problem(theta):
            bad(f"{key}.rope_theta", theta, MODEL_FIELDS["rope_theta"].problem(theta) or "")


def check_rank(rank: Any, key: str, hidden: int, where: str | Path, error: type[Exception] = ModelFileError) -> None:
    """A latent rank (kv_lora_rank, q_lora_rank, a per-layer rank): an integer in 1..hidden_size, the width of
    the hidden states it is a projection of (a larger one factors nothing and overruns its tensors)."""
    why = _count(MAX_HIDDEN).problem(rank)
    if why is None and rank > hidden:
        why = f"must be <= hidden_size = {hidden} (a latent of the hidden states is at most as wide as they are)"
    if why:
        raise error(f"{where}: {key} = {rank!r}: {why}")


def check_layer_indices(values: Iterable[Any], n_layer: int, key: str, where: str | Path,
                        error: type[Exception] = ModelFileError) -> list[int]:
    """Layer indices (ints, or their decimal strings as JSON object keys): each in 0..n_layer-1, no repeats."""
    out: list[int] = []
    for v in values:
        i = int(v) if isinstance(v, str) and v.removeprefix("-").isdecimal() else v
        if isinstance(i, bool) or not isinstance(i, int):
            raise error(f"{where}: {key}: {v!r} is not a layer index")
        if not 0 <= i < n_layer:
            raise error(f"{where}: {key}: layer {v!r} is out of range; the model has layers 0..{n_layer - 1}")
        if i in out:
            raise error(f"{where}: {key}: layer {v!r} is listed twice")
        out.append(i)
    return out


# ------------------------------------------------------------------------------------ weights
def nonfinite_count(t: Any) -> int:
    """NaN / inf values of one tensor (0 for integer tensors), counted in chunks."""
    import torch  # lazy: torch

    if not t.is_floating_point() or t.numel() == 0:
        return 0
    flat = t.reshape(-1)
    # one vectorised reduction first (NaN propagates through min/max, +-inf shows as the min or max: about 30x
    # the speed of isfinite on bf16 on CPU); the values are counted only when the tensor is not finite
    lo, hi = torch.aminmax(flat)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return 0
    return sum(int((~torch.isfinite(flat[i:i + _CHUNK])).sum()) for i in range(0, flat.numel(), _CHUNK))


def _report(bad: list[tuple[str, int]], shown: int = 5) -> str:
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    listed = ", ".join(f"{k} ({n} value{'s' if n > 1 else ''})" for k, n in bad[:shown])
    return f"non-finite (NaN/inf) weights in {len(bad)} tensor{'s' if len(bad) > 1 else ''}: {listed}{more}"


def nonfinite_tensors(named: Iterable[tuple[str, Any]]) -> list[tuple[str, int]]:
    """(name, count) of every tensor holding NaN / inf values."""
    return [(k, n) for k, t in named if (n := nonfinite_count(t))]


def check_finite_tensors(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], where: str | Path,
                         error: type[Exception] = ModelFileError, what: str = "") -> None:
    """Refuse tensors (a mapping or (name, tensor) pairs) holding NaN / inf values, naming them."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    bad = nonfinite_tensors(items)
    if bad:
        raise error(f"{where}: {what}{_report(bad)}; refusing a corrupt checkpoint")


def check_finite_weights(directory: str | Path, what: str, error: type[Exception] = ModelFileError) -> None:
    """Stream every .safetensors file of `directory`, one tensor at a time, and refuse NaN / inf values,
    naming `what` (e.g. "teacher model"), the file and its tensors."""
    from safetensors import safe_open  # lazy: torch

    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            bad = nonfinite_tensors((k, sf.get_tensor(k)) for k in sf.keys())
        if bad:
            raise error(f"{what} {directory}: {f.name} has {_report(bad)}; refusing a corrupt checkpoint")
