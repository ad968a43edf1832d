"""The student's step eager and with compiled blocks (`train.compile: blocks`) side by side, on packed rows.

    python bench/compile_step.py [--layers 4] [--T 1024] [--rows 10] [--threads 2] [--backend inductor]

The demo's student shapes (SmolLM2-135M converted as configs/demo-smollm2.yaml converts it: MLA on even layers,
GDN on odd ones, kv_lora_rank 256) cut to `--layers` layers, random weights, fp32. `--rows` packed rows of
`--T` tokens, each of 1 to 6 documents of random lengths (seeded). A step is the student's forward, its
cross-entropy over the row and the backward. Both models start from the same weights; each row runs on
both, the eager step first.

Prints one JSON object: per row the seconds of each step and the loss difference; the compiled step's
first row (compilation) apart; the median time ratio (compiled / eager) over the later rows; the graphs
compiled in the first row and after it (recompiles), the graph breaks by the call they stop at, dynamo's
logged recompiles; the largest relative gradient difference; host reads per step on each path
(`kernels/host_reads.HostReadLog`, counted over two more rows after the timed ones). `measure` is also
bench/gpu_check.py's case 8 (`compile`), on a GPU with CUDA's sync counter instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.kernels.compile_count import count_dynamo  # noqa: E402
from hylo.kernels.host_reads import HostReadLog, cuda_sync_log  # noqa: E402
from hylo.kernels.varlen import DocBounds  # noqa: E402
from hylo.modeling import HyLoForCausalLM  # noqa: E402
from hylo.pipeline.train.compile import compile_blocks  # noqa: E402

# SmolLM2-135M's published config.json (the demo's base): the student's shapes follow from it
SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


def demo_student(layers: int):
    """The demo's student config at `layers` layers (configs/demo-smollm2.yaml's conversion options)."""
    from transformers import LlamaConfig

    from hylo.pipeline.train.config import load_stage_config
    from hylo.upcycle.options import hybrid_config_from_base

    convert = load_stage_config(1, Path(__file__).resolve().parents[1] / "configs" / "demo-smollm2.yaml").model.convert
    base = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(base, convert)


def random_rows(T: int, n: int, seed: int = 0, max_docs: int = 6) -> list[list[int]]:
    """`n` boundaries of rows of T tokens, each of 1 to `max_docs` documents of random lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        docs = rng.randint(1, max_docs)
        rows.append([0, *sorted(rng.sample(range(1, T), docs - 1)), T])
    return rows


def step(model: torch.nn.Module, ids: torch.Tensor, bounds: DocBounds) -> torch.Tensor:
    """The student's step on one row: forward, cross-entropy, backward; the loss (no host read)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, cu_seqlens=bounds, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.detach()


def grad_rel_diff(ref: torch.nn.Module, got: torch.nn.Module) -> float:
    """The largest ||g - g_ref|| / ||g_ref|| over the parameters."""
    worst = 0.0
    for p, q in zip(ref.parameters(), got.parameters()):
        if p.grad is None:
            continue
        denom = float(p.grad.double().norm()) or 1.0
        worst = max(worst, float((q.grad.double() - p.grad.double()).norm()) / denom)
    return worst


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(make_model: Callable[[], torch.nn.Module], rows: list[list[int]], device: torch.device,
            backend: str = "inductor", vocab: int = 512, count_rows: int = 2) -> dict[str, Any]:
    """The side-by-side figures of the module docstring for `rows` (boundaries) on `device`."""
    torch.manual_seed(0)
    eager = make_model().to(device).train()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend)
    T = rows[0][-1]
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (1, T), generator=gen).to(device) for _ in rows]
    per_row = []
    grad_diff = 0.0
    with count_dynamo() as log:
        for i, (cu, x) in enumerate(zip(rows, ids)):
            bounds = DocBounds.from_host(cu, T, device)
            times = {}
            losses = {}
            for name, model in (("eager", eager), ("compiled", compiled)):
                synchronize(device)
                t0 = time.perf_counter()
                losses[name] = step(model, x, bounds)
                synchronize(device)
                times[name] = time.perf_counter() - t0
            grad_diff = max(grad_diff, grad_rel_diff(eager, compiled))
            per_row.append({"docs": len(cu) - 1, "eager_s": times["eager"], "compiled_s": times["compiled"],
                            "loss": float(losses["eager"]),
                            "loss_diff": abs(float(losses["compiled"]) - float(losses["eager"]))})
            if i == 0:
                log.next_phase()
    later = per_row[1:]
    out: dict[str, Any] = {
        "backend": backend, "T": T, "rows": len(rows), "docs_per_row": [r["docs"] for r in per_row],
        "first_row_compiled_s": per_row[0]["compiled_s"], "first_row_eager_s": per_row[0]["eager_s"],
        "eager_s_median": statistics.median(r["eager_s"] for r in later) if later else None,
        "compiled_s_median": statistics.median(r["compiled_s"] for r in later) if later else None,
        "time_ratio_compiled_over_eager": (statistics.median(r["compiled_s"] / r["eager_s"] for r in later)
                                           if later else None),
        "max_loss_diff": max(r["loss_diff"] for r in per_row),
        "max_grad_rel_diff": grad_diff,
        "graphs_first_row": log.graphs[0], "graphs_after_first_row": log.graphs_since(1),
        "graph_breaks_by_call": log.break_calls(), "recompiles_logged": [m.splitlines()[0] for _, m in log.recompiles],
        "per_row": per_row,
    }
    out.update(host_reads_per_step(eager, compiled, rows[-count_rows:], ids[-count_rows:], device))
    return out


def host_reads_per_step(eager: torch.nn.Module, compiled: torch.nn.Module, rows: list[list[int]],
                        ids: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Host reads (CPU: `HostReadLog`, every read made from Python) or CUDA synchronisations (a GPU: CUDA's
    sync debug mode) of each path's step, per row, the row's `DocBounds` made before each step."""
    out: dict[str, Any] = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        counts, where = [], set()
        for cu, x in zip(rows, ids):
            bounds = DocBounds.from_host(cu, cu[-1], device)
            if device.type == "cuda":
                with cuda_sync_log() as syncs:
                    step(model, x, bounds)
                    synchronize(device)
                counts.append(max(0, len(syncs) - 1))  # the final synchronize is the bench's own
            else:
                with HostReadLog() as reads:
                    step(model, x, bounds)
                counts.append(len(reads))
                where.update(f"{op} at {caller}" for op, caller in reads.reads)
        out[f"host_reads_per_step_{name}"] = counts
        out[f"host_reads_where_{name}"] = sorted(where)
    out["host_reads_counted_with"] = "cuda_sync_log" if device.type == "cuda" else "HostReadLog"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = demo_student(args.layers)
    report = measure(lambda: HyLoForCausalLM(cfg), random_rows(args.T, args.rows, args.seed), torch.device("cpu"),
                     args.backend, cfg.vocab_size)
    report.update(layers=args.layers, threads=args.threads, torch=torch.__version__,
                  mixers=[cfg.layer_type(i) for i in range(cfg.n_layer)])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
