"""Decode tokens/s on CPU, torch path: the 1B recipe's HyLo student (MLA + GDN) against Llama of the same shape.

    python bench/decode.py [--layers 2] [--vocab 32000] [--contexts 1024 4096 8192] [--new-tokens 16] [--threads 1]

Both models are built with random weights from the Llama-3.2-1B shape (hidden 2048, 32 query / 8 KV heads,
MLP 8192) and the recipe's conversion options (configs/llama-3.2-1b-8mla8gdn-64k.yaml: MLA on even layers,
R = 128, GDN 6 heads x 256), cut to `--layers` layers and a `--vocab` vocabulary so that a CPU prefill of
the longest context stays within minutes. Each context: one greedy decode through the eval's loop
(`hylo.pipeline.eval.decode.greedy_decode`, the model's own cache, prefill timed apart), decode tokens/s over
`--new-tokens` steps and the cache bytes (`cache_nbytes`). fp32, batch 1.

Every line says CPU: on a CPU the decode step is bound by reading the weights, not the cache, so the two
models stay close at these lengths. The GPU figure (the full shape, 8K-64K) is gpu-check's case `decode`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.kernels.backend import forced_mode  # noqa: E402
from hylo.modeling import HyLoForCausalLM  # noqa: E402
from hylo.pipeline.eval.decode import cache_nbytes, greedy_decode  # noqa: E402
from hylo.pipeline.train.config import load_stage_config  # noqa: E402
from hylo.upcycle.options import hybrid_config_from_base  # noqa: E402

CONFIG_1B = REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"


def configs(layers: int, vocab: int) -> tuple[Any, Any]:
    """The Llama-3.2-1B shape cut to `layers` layers and `vocab` tokens, and its HyLo student (the recipe's
    conversion options)."""
    base = LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                       max_position_embeddings=131072, tie_word_embeddings=True)
    base._attn_implementation = "sdpa"
    convert = dataclasses.replace(load_stage_config(1, CONFIG_1B).model.convert)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the base's RoPE scaling is replaced by YaRN in the MLA layers
        return base, hybrid_config_from_base(base, convert)


def measure(model: torch.nn.Module, context: int, new_tokens: int, vocab: int) -> dict[str, float]:
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(context))
    res = greedy_decode(model, ids, new_tokens, ignore_eos=True)
    nb = cache_nbytes(res.cache)
    return {"prefill_s": res.prefill_s, "decode_tokens_per_s": res.decode_tokens_per_s,
            "cache_bytes": nb.total, "cache_bytes_per_token": nb.bytes_per_token}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--layers", type=int, default=2, help="layers of both models (MLA on the even ones)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine more threads made the figures noise)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    base, hybrid = configs(args.layers, args.vocab)
    kinds = [hybrid.layer_type(i) for i in range(hybrid.n_layer)]
    print(f"CPU decode, torch path, fp32, batch 1, {torch.get_num_threads()} threads; Llama-3.2-1B shape cut to "
          f"{args.layers} layers, vocab {args.vocab}; HyLo layers {kinds}; {args.new_tokens} new tokens")
    with forced_mode("torch"), torch.no_grad():
        models = {}
        for name, make in (("hylo", lambda: HyLoForCausalLM(hybrid)), ("llama", lambda: LlamaForCausalLM(base))):
            torch.manual_seed(0)
            models[name] = make().float().eval()
        for c in args.contexts:
            h, ll = (measure(models[name], c, args.new_tokens, args.vocab) for name in ("hylo", "llama"))
            print(f"CPU context {c:>6}: decode tokens/s HyLo {h['decode_tokens_per_s']:7.2f}  Llama "
                  f"{ll['decode_tokens_per_s']:7.2f}  (HyLo / Llama "
                  f"{h['decode_tokens_per_s'] / ll['decode_tokens_per_s']:.2f}x); cache bytes HyLo "
                  f"{h['cache_bytes']:,}  Llama {ll['cache_bytes']:,}; prefill s HyLo {h['prefill_s']:.1f}  "
                  f"Llama {ll['prefill_s']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
