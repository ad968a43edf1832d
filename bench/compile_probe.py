"""Graphs, graph breaks and host reads of per-block compilation over 10 packed rows, on any tree of this project.

    python bench/compile_probe.py                              # this tree: compile_blocks (train.compile: blocks)
    PYTHONPATH=/path/to/old/checkout python bench/compile_probe.py   # an older tree: layer.compile() per block

A tiny student (4 layers, MLA / GDN alternating, hidden 64), 10 rows of 256 tokens with 1-6 documents (seeded),
backend "eager" (dynamo's capture and guards only; no code generation). Prints one JSON line: host reads of
the eager step (`HostReadLog`, 3 rows), graphs compiled per row, graph breaks and their reasons, and how
many times dynamo hit its recompile limit (after which it runs the block eagerly, silently, unless
`fail_on_recompile_limit_hit`). Where the tree has `hylo.pipeline.train.compile`, the blocks are compiled
through it; else each decoder layer through `nn.Module.compile` (the per-block compile of torchtitan).
"""

from __future__ import annotations

import json
import logging
import random

import torch
from torch._dynamo.utils import counters

from hylo.config import HybridConfig
from hylo.kernels.host_reads import HostReadLog
from hylo.kernels.varlen import DocBounds
from hylo.modeling import HyLoForCausalLM


def main() -> None:
    torch.set_num_threads(2)
    cfg = HybridConfig(vocab_size=512, hidden_size=64, intermediate_size=128, n_layer=4, mla_layers=[0, 2],
                       num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16, gdn_chunk_size=16,
                       tie_word_embeddings=False)
    T = 256
    rng = random.Random(0)
    rows = []
    for _ in range(10):
        d = rng.randint(1, 6)
        rows.append([0, *sorted(rng.sample(range(1, T), d - 1)), T])
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (1, T))
    eager = HyLoForCausalLM(cfg).train()
    reads = []
    for cu in rows[:3]:
        bounds = DocBounds.from_host(cu, T)
        with HostReadLog() as log:
            eager(input_ids=ids, cu_seqlens=bounds, labels=ids).loss.backward()
        reads.append(len(log))
    model = HyLoForCausalLM(cfg).train()
    try:
        from hylo.pipeline.train.compile import compile_blocks
    except ImportError:
        how = "layer.compile"
        for layer in model.model.layers:
            layer.compile(backend="eager")
    else:
        how = "compile_blocks"
        compile_blocks(model, "eager")
        torch._dynamo.config.fail_on_recompile_limit_hit = False  # count the hits as an older tree meets them
    hits = []

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "recompile_limit" in record.getMessage():
                hits.append(record.getMessage().splitlines()[0])

    logging.getLogger("torch._dynamo").addHandler(Hits())
    graphs = []
    for cu in rows:
        before = counters["stats"]["unique_graphs"]
        model(input_ids=ids, cu_seqlens=DocBounds.from_host(cu, T), labels=ids).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
    print(json.dumps({"compiled_with": how, "docs": [len(c) - 1 for c in rows], "host_reads_eager_step": reads,
                      "graphs_per_row": graphs, "graph_breaks": sum(counters["graph_break"].values()),
                      "break_reasons": sorted({k.splitlines()[0][:90] for k in counters["graph_break"]}),
                      "recompile_limit_hits": len(hits)}))


if __name__ == "__main__":
    main()
