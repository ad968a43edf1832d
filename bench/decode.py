"""Decode and prefill on CPU, torch path: the 1B recipe's HyLo student (MLA + GDN) against Llama of the same shape.

    python bench/decode.py [--layers 2] [--vocab 32000] [--contexts 4096 16384 32768 65536] [--new-tokens 16]
                           [--repeats 2] [--threads 1] [--json decode.json]

Both models are built with random weights from the Llama-3.2-1B shape (hidden 2048, 32 query / 8 KV heads,
MLP 8192) and the recipe's conversion options (configs/llama-3.2-1b-8mla8gdn-64k.yaml: MLA on even layers,
R = 128, GDN 6 heads x 256), cut to `--layers` layers and a `--vocab` vocabulary so that a CPU prefill of
the longest context stays within minutes. Each measurement is one greedy decode through the eval's loop
(`hylo.pipeline.eval.decode.greedy_decode`, the model's own cache): the prefill of the context (timed apart,
and by decoder layer), then decode tokens/s over `--new-tokens` steps, and the cache bytes (`cache_nbytes`).
fp32, batch 1.

The two models are timed interleaved, so that the machine's load falls on both alike: at each context,
`--repeats` rounds, the order alternating (HyLo, Llama, then Llama, HyLo, ...). Each figure is the median over
the rounds; the HyLo / Llama ratio is also given per round (its spread shows the load's effect), and the load
average (`os.getloadavg`) before and after each context. Every line says CPU: the GPU figure (the full shape,
8K-64K) is gpu-check's case `decode`.

What it shows on CPU (docs/results.md): a decode step reads the weights and the cache; Llama's cache (K and V of
every layer) grows by 4 KiB a token a layer here, HyLo's by the MLA layers' latent alone, and its GDN layers
hold a fixed state. So HyLo's decode overtakes Llama's as the context grows. Its prefill is slower on CPU:
with a cache, the MLA layer's prompt attends in the latent space (`_attend_latent`: keys and queries of R + P =
160 values a head against Llama's 64), and the GDN layer runs the torch chunked scan (fla's kernels are GPU
only); the by-layer times show each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
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
CONTEXTS = [4096, 16384, 32768, 65536]
NAMES = ("hylo", "llama")


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


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """Each decoder layer's kind: "MLA" / "GDN" for HyLo (its config), "attention" for Llama."""
    cfg = model.config
    if getattr(cfg, "model_type", None) == "hylo":
        return ["MLA" if cfg.layer_type(i) == "mla" else cfg.layer_type(i).upper() for i in range(cfg.n_layer)]
    return ["attention"] * cfg.num_hidden_layers


class LayerClock:
    """Wall seconds each decoder layer spends in the prefill (the first forward after `arm`), by layer kind."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.kinds = layer_kinds(model)
        self.seconds: dict[str, float] = {}
        self.armed = False
        self._t0 = 0.0
        for layer, kind in zip(model.model.layers, self.kinds):
            layer.register_forward_pre_hook(self._start)
            layer.register_forward_hook(lambda *a, kind=kind: self._stop(kind))

    def arm(self) -> None:
        self.seconds, self.armed = {}, True

    def _start(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _stop(self, kind: str) -> None:
        if self.armed:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - self._t0

    def disarm(self) -> dict[str, float]:
        self.armed = False
        return self.seconds


def measure(model: torch.nn.Module, clock: LayerClock, context: int, new_tokens: int, vocab: int) -> dict[str, Any]:
    """One greedy decode of a `context`-token prompt: prefill seconds (and by layer kind), decode tokens/s,
    cache bytes."""
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(context))
    # the prefill is the first forward: the clock counts it, and is off before the decode steps
    clock.arm()
    first = [True]

    def stop_after_prefill(*_: Any) -> None:
        if first[0]:
            first[0] = False
            clock.armed = False

    handle = model.register_forward_hook(stop_after_prefill)
    try:
        res = greedy_decode(model, ids, new_tokens, ignore_eos=True)
    finally:
        handle.remove()
    by_layer = clock.disarm()
    nb = cache_nbytes(res.cache)
    return {"prefill_s": res.prefill_s, "prefill_s_by_layer": by_layer, "decode_tokens_per_s": res.decode_tokens_per_s,
            "cache_bytes": nb.total, "cache_bytes_per_token": nb.bytes_per_token}


def filled_decode(model: torch.nn.Module, context: int, new_tokens: int, vocab: int, prefix: int) -> dict[str, Any]:
    """Decode at `context` tokens without timing (or running) its prefill: a real prefill of the first `prefix`
    tokens (the model makes its own cache objects), then each cache tensor that grows with the tokens extended to
    `context` with random entries of its shape and dtype (HyLo: the MLA layer's latent + roped key; Llama: K and V),
    the linear layers' fixed state as the prefill left it; then `new_tokens` decode steps timed as `greedy_decode`
    times them. A decode step's work depends on the cache's size, not on its values."""
    from hylo.cache import MLALayerCache
    from hylo.pipeline.eval.decode import cache_kwarg, is_hylo, new_cache

    ids = torch.randint(0, vocab, (1, prefix), generator=torch.Generator().manual_seed(context))
    cache = new_cache(model, max_length=context + max(new_tokens - 1, 0))
    kw = cache_kwarg(model)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    n = context - prefix
    gen = torch.Generator().manual_seed(1)
    if is_hylo(model):
        for layer in cache.layers:
            if isinstance(layer, MLALayerCache):
                layer.update(torch.randn(1, n, layer.rank, generator=gen), torch.randn(1, n, layer.rope, generator=gen))
            else:
                layer.seen += n
        cache.advance(n)
    else:
        for i, layer in enumerate(cache.layers):
            _, heads, _, dim = layer.keys.shape
            cache.update(torch.randn(1, heads, n, dim, generator=gen), torch.randn(1, heads, n, dim, generator=gen), i)
    assert cache.get_seq_length() == context, (cache.get_seq_length(), context)
    nxt = int(out.logits[0, -1].argmax())
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, logits_to_keep=1, **{kw: cache})
        nxt = int(out.logits[0, -1].argmax())
    seconds = time.perf_counter() - t0
    nb = cache_nbytes(cache)
    return {"prefill_s": None, "prefill_s_by_layer": {}, "decode_tokens_per_s": (new_tokens - 1) / seconds,
            "cache_bytes": nb.total, "cache_bytes_per_token": nb.bytes_per_token, "filled_from": prefix}


def median(rounds: list[dict[str, Any]], key: str) -> float | None:
    if any(r[key] is None for r in rounds):
        return None
    return statistics.median(r[key] for r in rounds)


def one_context(models: dict[str, torch.nn.Module], clocks: dict[str, LayerClock], context: int, new_tokens: int,
                vocab: int, repeats: int, fill_from: int | None = None) -> dict[str, Any]:
    """`repeats` rounds at one context, the two models' order alternating; the medians and each round's ratio.
    `fill_from`: decode only, on a cache filled from a real prefill of that many tokens (`filled_decode`)."""
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in NAMES}
    for r in range(repeats):
        order = NAMES if r % 2 == 0 else NAMES[::-1]
        for name in order:
            if fill_from is None:
                rounds[name].append(measure(models[name], clocks[name], context, new_tokens, vocab))
            else:
                rounds[name].append(filled_decode(models[name], context, new_tokens, vocab, fill_from))
    out: dict[str, Any] = {"context": context, "load_before": load_before, "load_after": os.getloadavg(),
                           "rounds": rounds}
    for name in NAMES:
        rs = rounds[name]
        kinds = rs[0]["prefill_s_by_layer"]
        out[name] = {"prefill_s": median(rs, "prefill_s"), "decode_tokens_per_s": median(rs, "decode_tokens_per_s"),
                     "cache_bytes": rs[0]["cache_bytes"],
                     "prefill_s_by_layer": {k: statistics.median(x["prefill_s_by_layer"][k] for x in rs) for k in kinds}}
    out["decode_ratio_by_round"] = [h["decode_tokens_per_s"] / ll["decode_tokens_per_s"]
                                    for h, ll in zip(rounds["hylo"], rounds["llama"])]
    out["prefill_ratio_by_round"] = [h["prefill_s"] / ll["prefill_s"] for h, ll in zip(rounds["hylo"], rounds["llama"])
                                     if h["prefill_s"] is not None]
    out["filled_from"] = fill_from
    return out


def format_row(r: dict[str, Any]) -> str:
    h, ll = r["hylo"], r["llama"]
    d = h["decode_tokens_per_s"] / ll["decode_tokens_per_s"]
    rounds = ", ".join(f"{x:.2f}" for x in r["decode_ratio_by_round"])
    by = lambda m: " + ".join(f"{k} {v:.1f}" for k, v in m["prefill_s_by_layer"].items())  # noqa: E731
    if r["filled_from"] is None:
        prefill = (f"prefill s HyLo {h['prefill_s']:.1f} ({by(h)})  Llama {ll['prefill_s']:.1f} ({by(ll)}) "
                   f"(HyLo / Llama {h['prefill_s'] / ll['prefill_s']:.2f}x)")
    else:
        prefill = f"prefill not timed (the cache filled from a {r['filled_from']}-token prefill)"
    return (f"CPU context {r['context']:>6}: decode tokens/s HyLo {h['decode_tokens_per_s']:7.2f}  Llama "
            f"{ll['decode_tokens_per_s']:7.2f}  (HyLo / Llama {d:.2f}x; by round {rounds}); cache MB HyLo "
            f"{h['cache_bytes'] / 1e6:,.1f}  Llama {ll['cache_bytes'] / 1e6:,.1f} ({ll['cache_bytes'] / h['cache_bytes']:.1f}x "
            f"less); {prefill}; load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--layers", type=int, default=2, help="layers of both models (MLA on the even ones)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds per context, the two models' order alternating (default 2: HyLo, Llama, Llama, HyLo)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine more threads made the figures noise)")
    ap.add_argument("--prefill-upto", type=int, default=None, metavar="T",
                    help="time the prefill of contexts up to T tokens only; above T, decode on a cache filled to the "
                         "context from a real prefill of --fill-from tokens (default: every prefill timed)")
    ap.add_argument("--fill-from", type=int, default=256, help="the real prefill a filled cache starts from")
    ap.add_argument("--json", default=None, help="also write every round's figures to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    base, hybrid = configs(args.layers, args.vocab)
    kinds = [hybrid.layer_type(i) for i in range(hybrid.n_layer)]
    print(f"CPU decode, torch path, fp32, batch 1, {torch.get_num_threads()} threads; Llama-3.2-1B shape cut to "
          f"{args.layers} layers, vocab {args.vocab}; HyLo layers {kinds}; {args.new_tokens} new tokens; "
          f"{args.repeats} rounds per context, the order alternating; medians", flush=True)
    rows = []
    with forced_mode("torch"), torch.no_grad():
        models = {}
        for name, make in (("hylo", lambda: HyLoForCausalLM(hybrid)), ("llama", lambda: LlamaForCausalLM(base))):
            torch.manual_seed(0)
            models[name] = make().float().eval()
        clocks = {name: LayerClock(m) for name, m in models.items()}
        for c in args.contexts:
            fill = args.fill_from if args.prefill_upto is not None and c > args.prefill_upto else None
            row = one_context(models, clocks, c, args.new_tokens, args.vocab, args.repeats, fill)
            rows.append(row)
            print(format_row(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "contexts": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
