"""Model loading and one greedy decoding loop shared by every evaluation suite.

Legend: B batch (1 here), T prompt tokens, V vocabulary.

Design choices:
* One loop for HyLo and HF models: prefill once, then one token per step through the model's own
  cache object, which we create (`HyLoCache` or transformers' `DynamicCache`) so the caller can
  measure it afterwards. Logits are kept for the last position only (`logits_to_keep=1`): no
  [T, V] tensor at 64K context.
* Prefill and decode are timed separately (decode tokens/s excludes the prompt), with a device
  synchronise around each timed region.
* Cache bytes are counted on the cache tensors themselves: `HyLoCache.nbytes()` for HyLo; for
  other caches every tensor reachable from the cache's layers (deduplicated by storage). Bytes
  that grow with the sequence (MLA latents, K/V) are reported apart from constant state.
* Loading: a directory with `hybrid_config.json` (or a `config.json` of model_type hylo) is a HyLo
  checkpoint, loaded with this project's classes (never its bundled remote code); any other directory
  an HF causal LM, and a bare name an asset from `hylo.assets.fetch_asset`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.assets import AssetError, resolve_path_or_asset
from hylo.json_files import read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EvalError(ValueError):
    """Bad evaluation input; the message names the file, record or field."""


def is_hylo(model: nn.Module) -> bool:
    """A HyLo model, whether this project's class or the copy transformers loads with trust_remote_code."""
    return getattr(getattr(model, "config", None), "model_type", None) == "hylo" and hasattr(model, "model")


def resolve_path(spec: str | Path) -> Path:
    """A directory as is, or an asset (`asset:NAME` or NAME, e.g. smollm2-135m-instruct) fetched into the cache."""
    try:
        return resolve_path_or_asset(spec, "model", directory=True)
    except AssetError as e:
        raise EvalError(str(e)) from e


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(spec: str | Path, dtype: str = "float32", device: str = "auto") -> nn.Module:
    """Load a HyLo checkpoint or an HF causal LM for evaluation (eval mode, no grad)."""
    if dtype not in DTYPES:
        raise EvalError(f"dtype {dtype!r} is not valid; allowed: {', '.join(DTYPES)}")
    from hylo.io import CheckpointMismatchError, from_pretrained_checked  # lazy: transformers

    path = resolve_path(spec)
    if (path / "hybrid_config.json").is_file():
        from hylo.io import load_hylo  # lazy: transformers

        model = load_hylo(path, dtype=DTYPES[dtype])
    elif _model_type(path / "config.json") == "hylo":
        from hylo.config import HybridConfigError  # lazy: transformers
        from hylo.modeling import HyLoForCausalLM  # lazy: transformers

        try:
            model = from_pretrained_checked(HyLoForCausalLM, path, dtype=DTYPES[dtype])
        except (OSError, HybridConfigError, CheckpointMismatchError) as e:
            raise EvalError(f"{path}: could not load the HyLo model: {e}") from e
    elif (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM  # lazy: transformers

        try:
            model = from_pretrained_checked(AutoModelForCausalLM, path, dtype=DTYPES[dtype])
        except CheckpointMismatchError as e:
            raise EvalError(str(e)) from None
        except Exception as e:  # transformers raises many kinds for broken checkpoints
            raise EvalError(f"{path}: could not load the model: {type(e).__name__}: {e}") from e
    else:
        raise EvalError(f"{path}: neither hybrid_config.json (HyLo) nor config.json (HF) found")
    model = model.to(pick_device(device)).eval()
    model.requires_grad_(False)
    return model


def _model_type(config_json: Path) -> str | None:
    try:
        return read_json(config_json, ValueError).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(spec: str | Path | None):
    """The tokenizer saved beside a model (None when there is none)."""
    if spec is None:
        return None
    from transformers import AutoTokenizer  # lazy: transformers

    try:
        return AutoTokenizer.from_pretrained(resolve_path(spec))
    except Exception as e:
        raise EvalError(f"{spec}: could not load a tokenizer ({type(e).__name__}: {e})") from e


def eos_ids(model: nn.Module, tokenizer=None) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if val is None:
            continue
        ids += list(val) if isinstance(val, list | tuple) else [int(val)]
    return sorted(set(ids))


# ---------------------------------------------------------------------------------------- cache
def new_cache(model: nn.Module, max_length: int | None = None):
    """An empty generation cache; `max_length` (prompt + new tokens) lets HyLo allocate its MLA cache once."""
    if is_hylo(model):
        return model.new_cache(max_length=max_length)
    from transformers import DynamicCache  # lazy: transformers

    return DynamicCache(config=model.config)


def cache_kwarg(model: nn.Module) -> str:
    # transformers 5 renamed `past_key_values` to `cache`; HyLo accepts both
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _tensors_of(obj: Any, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 4 or obj is None or isinstance(obj, str | int | float | bool | torch.device):
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        if id(obj) in seen:
            return []
        seen.add(id(obj))
        items = list(vars(obj).values())
    else:
        return []
    out: list[torch.Tensor] = []
    for it in items:
        out += _tensors_of(it, seen, depth + 1)
    return out


@dataclass
class CacheBytes:
    total: int
    # bytes that scale with the number of cached tokens (MLA latent + roped key, or K/V)
    per_token_part: int
    # bytes independent of length (recurrent state, conv windows)
    constant_part: int
    tokens: int
    detail: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_per_token(self) -> float:
        return self.total / max(self.tokens, 1)

    @property
    def growing_bytes_per_token(self) -> float:
        return self.per_token_part / max(self.tokens, 1)


def cache_nbytes(cache: Any) -> CacheBytes:
    """Bytes held by a generation cache's tensors."""
    tokens = int(cache.get_seq_length())
    if callable(getattr(cache, "nbytes", None)):
        # HyLoCache (this project's or a trust_remote_code copy's)
        nb = cache.nbytes()
        return CacheBytes(nb["total"], nb["mla"], nb["linear"], tokens, dict(nb))
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise EvalError(f"cannot measure a cache of type {type(cache).__name__}")
    storages: set[int] = set()
    growing = constant = 0
    for layer in layers:
        for t in _tensors_of(layer, set()):
            key = t.untyped_storage().data_ptr()
            if key in storages or t.numel() == 0:
                continue
            storages.add(key)
            nbytes = t.numel() * t.element_size()
            # K/V tensors are [B, H, T, d]: their length axis is the cached token count
            if t.dim() >= 3 and t.shape[-2] == tokens:
                growing += nbytes
            else:
                constant += nbytes
    return CacheBytes(growing + constant, growing, constant, tokens, {"kv": growing, "state": constant})


# ---------------------------------------------------------------------------------------- decode
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeResult:
    tokens: list[int]
    cache: Any
    prefill_s: float
    decode_s: float
    # decode steps timed (tokens produced after the first one, which comes from the prefill)
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


@torch.no_grad()
def greedy_decode(
    model: nn.Module,
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int,
    eos: list[int] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
    ignore_eos: bool = False,
) -> DecodeResult:
    """Greedy continuation of one prompt with the model's cache; stops at EOS or when `stop(tokens)`."""
    device = next(model.parameters()).device
    ids_BT = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    if ids_BT.shape[1] == 0:
        raise EvalError("greedy_decode: empty prompt")
    # the last new token is never fed back: the cache ends at prompt + max_new_tokens - 1 tokens
    cache = new_cache(model, max_length=ids_BT.shape[1] + max(max_new_tokens - 1, 0))
    kw = cache_kwarg(model)
    eos_set = set() if ignore_eos else set(eos or [])
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids_BT, use_cache=True, logits_to_keep=1, **{kw: cache})
    nxt = int(out.logits[0, -1].float().argmax())
    _sync(device)
    t1 = time.perf_counter()
    tokens = [nxt]
    steps = 0
    while len(tokens) < max_new_tokens and nxt not in eos_set and not (stop and stop(tokens)):
        step_BT = torch.tensor([[nxt]], dtype=torch.long, device=device)
        out = model(input_ids=step_BT, use_cache=True, logits_to_keep=1, **{kw: cache})
        nxt = int(out.logits[0, -1].float().argmax())
        tokens.append(nxt)
        steps += 1
    _sync(device)
    t2 = time.perf_counter()
    return DecodeResult(tokens, cache, t1 - t0, t2 - t1, steps)


@torch.no_grad()
def final_hidden(model: nn.Module, ids_T: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Final normed hidden states [T, D] of one sequence (or one packed row for HyLo)."""
    ids_BT = ids_T.reshape(1, -1)
    if is_hylo(model):
        return model.model(input_ids=ids_BT, cu_seqlens=cu_seqlens).last_hidden_state[0]
    if cu_seqlens is not None:
        raise EvalError("final_hidden: packed rows need a HyLo model; run documents one at a time")
    return model.base_model(input_ids=ids_BT, use_cache=False).last_hidden_state[0]
