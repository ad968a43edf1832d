"""Teacher pool throughput vs a direct in-process forward, and bytes per token on the wire.

    python bench/teacher.py [--rows 8] [--tokens 512] [--replicas 2] [--k 64]

Same model (the SmolLM2-135M asset, fp32), same rows, one run:
* direct: `TeacherModel.topk` in this process (torch's default threads);
* pool: `TeacherClient.topk` through a Serve pool of N replicas (1 CPU and 1 torch thread each);
* stream: full logits of one row through the pool in 512-token chunks;
* hidden: the final hidden states of one row through the pool (`exact_form: hidden`), the LM head read from the
  checkpoint here and checked against the replica's;
* bytes per token of the pickled response payloads (what Ray ships) for top-k, full logits and hidden states,
  and of the offline cache shard on disk; then per 64K row at this teacher's shapes and at Llama-3.1-8B's
  (hidden 4,096, vocab 128,256, bf16: computed, pipeline/estimate/wire.py).
Each row packs two documents, so document isolation is part of the measured work.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hylo.pipeline.data.rows import check_row  # noqa: E402
from hylo.pipeline.teacher.cache import ShardPlan, make_header, write_shard  # noqa: E402
from hylo.pipeline.teacher.client import TeacherClient  # noqa: E402
from hylo.pipeline.teacher.config import DEFAULT_TEACHER, TeacherModelConfig, TeacherPoolConfig  # noqa: E402
from hylo.pipeline.teacher.model import TeacherModel  # noqa: E402
from hylo.pipeline.teacher.serve import start_teacher_pool  # noqa: E402


def make_rows(n: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    g = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        split = int(g.integers(tokens // 4, 3 * tokens // 4))
        cu = np.array([0, split, tokens], np.int32)
        pos = np.concatenate([np.arange(split), np.arange(tokens - split)])
        rows.append({"input_ids": g.integers(0, vocab, tokens), "position_ids": pos, "cu_seqlens": cu})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=DEFAULT_TEACHER)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--k", type=int, default=64)
    args = ap.parse_args()

    teacher = TeacherModel(args.model, dtype="float32", device="cpu")

    rows = [check_row(r) for r in make_rows(args.rows, args.tokens, teacher.vocab_size)]
    total = args.rows * args.tokens
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other jobs share them)")
    print(f"model {teacher.teacher_id} (V={teacher.vocab_size}, H={teacher.hidden_size}), "
          f"{args.rows} rows x {args.tokens} tokens, k={args.k}, torch threads here: {torch.get_num_threads()}")

    teacher.topk(rows[0], args.k)
    t0 = time.perf_counter()
    direct = [teacher.topk(r, args.k) for r in rows]
    t_direct = time.perf_counter() - t0
    print(f"direct in-process : {total / t_direct:8.0f} tokens/s ({t_direct:.2f} s)")

    import ray  # lazy: ray
    from ray import serve  # lazy: ray

    from hylo.pipeline.ray_init import init_ray  # lazy: ray

    init_ray(None, max(2, args.replicas), log_to_driver=False)
    try:
        t0 = time.perf_counter()
        handle = start_teacher_pool(
            TeacherModelConfig(path=args.model, torch_threads=1),
            TeacherPoolConfig(app_name="teacher_bench", num_replicas=args.replicas, num_cpus=1.0,
                              max_batch_tokens=2 * args.tokens),
        )
        print(f"pool start        : {time.perf_counter() - t0:.1f} s ({args.replicas} replicas)")
        client = TeacherClient(handle, max_inflight_rows=2 * args.replicas, timeout_s=600)
        client.topk_all(rows[: args.replicas], args.k)
        t0 = time.perf_counter()
        pooled = client.topk_all(rows, args.k)
        t_pool = time.perf_counter() - t0
        print(f"pool ({args.replicas} replicas)  : {total / t_pool:8.0f} tokens/s ({t_pool:.2f} s); "
              f"pool/direct = {t_direct / t_pool:.2f}x")
        # Replicas run 1 thread, this process 2: float sums differ in the last bits, so near-tied
        # entries may swap places; the record is otherwise the same.
        agree = np.mean([(a.indices == b.indices).float().mean().item() for a, b in zip(direct, pooled)])
        dmax = max((a.logprobs.float() - b.logprobs.float()).abs().max().item() for a, b in zip(direct, pooled))
        print(f"pool vs direct    : top-k index agreement {agree:.5f}, max |logprob diff| {dmax:.4f}")

        t0 = time.perf_counter()
        chunks = list(client.stream(rows[0], chunk_tokens=min(512, args.tokens), window_chunks=2))
        t_stream = time.perf_counter() - t0
        print(f"stream 1 row      : {args.tokens / t_stream:8.0f} tokens/s ({len(chunks)} chunks)")

        from hylo.pipeline.teacher.head import load_head  # lazy: torch
        from hylo.pipeline.teacher.model import resolve_model_path  # lazy: torch

        client.head = load_head(resolve_model_path(args.model), torch.float32)
        client.check_head(args.model)
        t0 = time.perf_counter()
        (hidden,) = list(client.hidden(rows[:1]))
        t_hidden = time.perf_counter() - t0
        print(f"hidden 1 row      : {args.tokens / t_hidden:8.0f} tokens/s ([{hidden.shape[0]}, {hidden.shape[1]}] "
              f"{str(hidden.dtype).removeprefix('torch.')}); vs direct logits of the head: max |diff| "
              f"{(hidden @ client.head.T - torch.cat(chunks)).abs().max().item():.2e}")
    finally:
        serve.shutdown()
        ray.shutdown()

    rec = pooled[0]
    wire_topk = len(pickle.dumps({"logprobs": rec.logprobs, "indices": rec.indices,
                                  "tail_logmass": rec.tail_logmass})) / args.tokens
    wire_fp32 = len(pickle.dumps(chunks[0])) / chunks[0].shape[0]
    wire_bf16 = len(pickle.dumps(chunks[0].to(torch.bfloat16))) / chunks[0].shape[0]
    wire_hidden = len(pickle.dumps(hidden)) / hidden.shape[0]
    print(f"wire bytes/token  : top-k (k={args.k}, fp16 + int32 + fp32 tail) {wire_topk:.0f}; "
          f"full logits fp32 {wire_fp32:.0f}, bf16 {wire_bf16:.0f}; hidden states fp32 {wire_hidden:.0f}; "
          f"fp32 logits/top-k = {wire_fp32 / wire_topk:.0f}x, logits/hidden = {wire_fp32 / wire_hidden:.0f}x")
    from hylo.pipeline.estimate.wire import TeacherWire  # lazy: torch

    row = 65536
    for name, w, per_token in (
            (f"this teacher (H {teacher.hidden_size}, V {teacher.vocab_size}, fp32), measured", None,
             {"logits": wire_fp32, "hidden": wire_hidden, "topk": wire_topk}),
            ("this teacher, computed", TeacherWire(row, teacher.hidden_size, teacher.vocab_size, args.k, 4, 2), None),
            ("Llama-3.1-8B (H 4,096, V 128,256, bf16), computed", TeacherWire(row, 4096, 128256, args.k, 2, 2), None)):
        got = {f: per_token[f] * row for f in per_token} if per_token else {f: w.bytes(f) for f in ("logits", "hidden",
                                                                                                     "topk")}
        print(f"per 64K row       : {name}: logits {got['logits'] / 1e9:.2f} GB, hidden {got['hidden'] / 1e6:.1f} MB, "
              f"top-{args.k} {got['topk'] / 1e6:.1f} MB")

    with tempfile.TemporaryDirectory() as d:
        header = make_header(teacher.teacher_id, teacher.tokenizer_hash, args.k, "float16", teacher.vocab_size,
                             "bench", args.rows)
        size = write_shard(Path(d) / "s.parquet", header, ShardPlan("s", "bench", 0, args.rows),
                           [r.row_id for r in rows], direct)
    print(f"cache bytes/token : {size / total:.0f} (fp16 logprobs + {header['index_dtype']} indices, zstd)")


if __name__ == "__main__":
    main()
