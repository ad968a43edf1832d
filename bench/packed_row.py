"""Forward + backward of a small HyLo model on one packed row (MLA + GDN or Mamba-2 layers), CPU.

The packed row's boundaries are checked once at the model's entry and passed to the layers as host ints
(`hylo.kernels.varlen.DocBounds`); this times what a training step of the model costs on a packed row, with
and without activation-checkpoint recompute, so a change in that plumbing shows up here.

    python bench/packed_row.py [--T 4096] [--docs 8] [--repeats 3] [--threads 2]

Prints one JSON line per (linear type, recompute): the median seconds of `--repeats` timed runs after
one untimed warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.config import HybridConfig  # noqa: E402
from hylo.modeling import HyLoForCausalLM  # noqa: E402


def make_model(linear_type: str) -> HyLoForCausalLM:
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=512, hidden_size=256, intermediate_size=512, n_layer=4, mla_layers=[0],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=64, qk_rope_head_dim=32,
                       qk_nope_head_dim=32, v_head_dim=64, gdn_num_heads=4, gdn_head_dim=64, gdn_chunk_size=64,
                       linear_type=linear_type, max_position_embeddings=65536)
    return HyLoForCausalLM(cfg).train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bounds = torch.linspace(0, args.T, args.docs + 1).round().long().tolist()
    cu = torch.tensor(bounds, dtype=torch.int32)
    ids = torch.randint(0, 512, (1, args.T), generator=torch.Generator().manual_seed(1))
    for linear_type in ("gdn", "mamba2"):
        model = make_model(linear_type)
        for recompute in (False, True):
            if recompute:
                model.gradient_checkpointing_enable()
            times = []
            for i in range(args.repeats + 1):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                model(ids, cu_seqlens=cu).logits.float().square().mean().backward()
                if i:
                    times.append(time.perf_counter() - t0)
            print(json.dumps({"linear_type": linear_type, "recompute": recompute, "T": args.T, "docs": args.docs,
                              "fwd_bwd_s": round(statistics.median(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
