"""KV cache actually allocated during generation, and decode speed, at growing context.

Design choices:
* Measured, not computed: after prefilling a context of L tokens and decoding n more, the bytes
  of every tensor held by the generation cache are summed (`decode.cache_nbytes`). For HyLo that
  is `HyLoCache.nbytes()` (MLA latents + roped keys, which grow with length, apart from the
  linear layers' fixed-size state); for an HF model, the DynamicCache's K/V tensors.
* Bytes per token are reported two ways: `growing_bytes_per_token` (the length-proportional part
  divided by cached tokens: what the converter's `kv_cache_ratio` predicts) and `bytes_per_token`
  (everything, including the constant state, which a long context amortises).
* Prompts are seeded random token ids (content does not change the cache size) and decoding
  ignores EOS, so every model decodes the same number of steps; tokens/s counts decode steps only.
* The comparison checks the hybrid's growing bytes per token against `kv_cache_ratio` times the
  base's bytes per token (tolerance 5 %), and the base's linear growth (bytes per token constant
  over lengths).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hylo.pipeline.eval.decode import EvalError, cache_nbytes, greedy_decode, is_hylo
from hylo.pipeline.eval.progress import progress
from hylo.upcycle import kv_summary

TOLERANCE = 0.05


def measure(model: nn.Module, lengths: list[int], decode_tokens: int = 16, seed: int = 0,
            desc: str | None = None) -> list[dict[str, Any]]:
    """One record per context length: cache bytes after prefill + decode, prefill time, decode tok/s.
    `desc`: show a progress bar with this label."""
    if decode_tokens < 2:
        raise EvalError(f"kvcache.decode_tokens must be >= 2 (one step is the prefill's), got {decode_tokens}")
    vocab = model.get_output_embeddings().weight.shape[0]
    out = []
    bar = progress(lengths, desc=desc or "kvcache", unit="length", disable=desc is None)
    for length in bar:
        bar.set_postfix_str(f"context {length}")
        if length < 1:
            raise EvalError(f"kvcache.lengths: {length} must be a positive token count")
        g = torch.Generator().manual_seed(seed * 1_000_003 + length)
        ids = torch.randint(0, vocab, (length,), generator=g)
        res = greedy_decode(model, ids, decode_tokens, ignore_eos=True)
        cb = cache_nbytes(res.cache)
        out.append({
            "context": length,
            "cached_tokens": cb.tokens,
            "total_bytes": cb.total,
            "growing_bytes": cb.per_token_part,
            "constant_bytes": cb.constant_part,
            "bytes_per_token": cb.bytes_per_token,
            "growing_bytes_per_token": cb.growing_bytes_per_token,
            "prefill_s": res.prefill_s,
            "prefill_tokens_per_s": length / res.prefill_s if res.prefill_s > 0 else None,
            "decode_steps": res.decode_steps,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "detail": cb.detail,
        })
        del res
    return out


def expected_ratio(base: nn.Module | None, hybrid: nn.Module) -> float | None:
    """The converter's kv_cache_ratio for this pair (None without a base model)."""
    if base is None or not is_hylo(hybrid):
        return None

    return float(kv_summary(base.config, hybrid.config)["kv_cache_ratio"])


def hybrid_expected_bytes_per_token(hybrid: nn.Module) -> float | None:
    """Cached bytes per token the HybridConfig predicts at the model's dtype."""
    if not is_hylo(hybrid):
        return None
    elt = next(hybrid.parameters()).element_size()
    return float(hybrid.config.kv_cache_values_per_token() * elt)


def compare(base_rows: list[dict[str, Any]] | None, hybrid_rows: list[dict[str, Any]],
            ratio: float | None, hybrid_expected_bpt: float | None = None) -> dict[str, Any]:
    """Per-length ratios and the two checks of the acceptance criterion."""
    per_length = []
    base_by_len = {r["context"]: r for r in base_rows or []}
    for h in hybrid_rows:
        b = base_by_len.get(h["context"])
        row: dict[str, Any] = {"context": h["context"], "hybrid_growing_bytes_per_token": h["growing_bytes_per_token"],
                               "hybrid_bytes_per_token": h["bytes_per_token"]}
        if hybrid_expected_bpt:
            row["hybrid_vs_config"] = h["growing_bytes_per_token"] / hybrid_expected_bpt
        if b is not None:
            row["base_bytes_per_token"] = b["bytes_per_token"]
            row["measured_ratio"] = h["growing_bytes_per_token"] / b["bytes_per_token"]
            row["measured_ratio_total"] = h["bytes_per_token"] / b["bytes_per_token"]
            if b["decode_tokens_per_s"] and h["decode_tokens_per_s"]:
                row["decode_speedup"] = h["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            if ratio:
                row["ratio_deviation"] = row["measured_ratio"] / ratio - 1.0
        per_length.append(row)
    result: dict[str, Any] = {"kv_cache_ratio": ratio, "tolerance": TOLERANCE, "per_length": per_length}
    devs = [abs(r["ratio_deviation"]) for r in per_length if "ratio_deviation" in r]
    result["hybrid_within_tolerance"] = bool(devs) and max(devs) <= TOLERANCE
    if base_rows:
        bpts = [r["bytes_per_token"] for r in base_rows]
        spread = (max(bpts) - min(bpts)) / max(min(bpts), 1e-30)
        result["base_bytes_per_token_spread"] = spread
        # linear growth: total bytes proportional to cached tokens at every length
        result["base_grows_linearly"] = spread <= 0.01 and len(base_rows) >= 2
    return result
