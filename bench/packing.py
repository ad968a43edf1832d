"""Packing efficiency and pipeline throughput on real ShareGPT with the real SmolLM2 tokenizer.

    python bench/packing.py [--limit 8000] [--num-actors 2]

Prints, from one run:
* the pipeline's tokens/s (mixture records -> Ray Data render + tokenise actor pool -> best-fit
  packing at 65,536), end to end (actor start-up included) and after the first document arrived;
* plain `tokenizers` batch encoding of the same rendered text in this one process (no template, no
  mask, no Ray), and the ratio (target >= 0.7x);
* packing efficiency (non-padding tokens / row capacity, every row counted) at 2,048, 8,192 and
  65,536 (targets >= 98 % at 2,048, >= 99 % at 65,536) and how many documents were split (only
  those longer than the row may be).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray
import ray.data
from tokenizers import Tokenizer

from hylo.assets import fetch_asset
from hylo.pipeline.data.config import PackingConfig, TokenizeConfig
from hylo.pipeline.data.mixture import mix
from hylo.pipeline.data.readers import SourceSpec, iter_records
from hylo.pipeline.data.render import ChatRenderer
from hylo.pipeline.data.streaming import PackedRun, make_packer, stream_packed_rows
from hylo.pipeline.ray_init import init_ray


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--limit", type=int, default=8000, help="ShareGPT items to read (records + rejects)")
    ap.add_argument("--num-actors", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    tok_dir = fetch_asset("smollm2-135m-instruct", progress=False)
    share = fetch_asset("sharegpt", progress=False)
    rejects: list[dict] = []
    spec = SourceSpec(name="sharegpt", path=str(share), limit=args.limit)
    records, _ = mix([("sharegpt", 1.0, iter_records(spec, rejects.append))], "all", seed=0)
    renderer = ChatRenderer.from_pretrained(str(tok_dir))
    print(f"ShareGPT: {args.limit} items read -> {len(records)} conversations, {len(rejects)} reader rejects")

    init_ray(None, 2, log_to_driver=False)

    ray.data.DataContext.get_current().enable_progress_bars = False
    tcfg = TokenizeConfig(num_actors=args.num_actors, batch_size=args.batch_size)
    pad_id = 2
    packer = make_packer(PackingConfig(max_len=65536, window=2048, max_open_rows=64), pad_id)
    run = PackedRun()
    docs = []
    t_first = None

    def on_doc(d):
        nonlocal t_first
        if t_first is None:
            t_first = time.perf_counter()
        docs.append(d)

    t0 = time.perf_counter()
    n_rows = sum(1 for _ in stream_packed_rows(records, renderer.spec(), tcfg, packer, run, on_document=on_doc))
    t1 = time.perf_counter()
    first_tokens = len(docs[0].input_ids) if docs else 0
    pipe_tps = run.doc_tokens / (t1 - t0)
    pipe_steady = (run.doc_tokens - first_tokens) / (t1 - t_first) if t_first else 0.0
    ray.shutdown()

    # Baseline: the same rendered text, encoded by plain `tokenizers` in this one process.
    kept = {d.doc_id for d in docs}
    texts = [renderer.render(r["messages"])[0] for r in records if r["doc_id"] in kept]
    plain = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tb = time.perf_counter()
    encs = plain.encode_batch(texts, add_special_tokens=False)
    n_plain = sum(len(e.ids) for e in encs)
    base_tps = n_plain / (time.perf_counter() - tb)

    print(f"\ndocuments {len(docs)}, tokens {run.doc_tokens:,} (plain encode: {n_plain:,}), "
          f"render rejects {len(run.render_rejects)}, rows at 65,536: {n_rows}")
    print(f"pipeline (Ray Data, {args.num_actors} actors, render + mask + tokenise + pack): "
          f"{pipe_tps:,.0f} tokens/s end to end ({t1 - t0:.1f} s), {pipe_steady:,.0f} tokens/s after first doc "
          f"({t_first - t0 if t_first else 0:.1f} s start-up)")
    print(f"plain tokenizers encode_batch, one process: {base_tps:,.0f} tokens/s")
    print(f"ratio pipeline / plain: {pipe_tps / base_tps:.2f}x end to end, {pipe_steady / base_tps:.2f}x "
          f"after start-up (target >= 0.7x)")

    lens = np.array([len(d.input_ids) for d in docs])
    print(f"\ndocument tokens: mean {lens.mean():.0f}, median {np.median(lens):.0f}, max {lens.max():,}")
    print(f"{'max_len':>8} {'rows':>6} {'efficiency':>10} {'docs > row':>10} {'docs split':>10} "
          f"{'pad tokens':>11} {'seconds':>8}")
    for max_len, window, open_rows in ((2048, 4096, 256), (8192, 4096, 128), (65536, 2048, 64)):
        p = make_packer(PackingConfig(max_len=max_len, window=window, max_open_rows=open_rows), pad_id)
        tp = time.perf_counter()
        for d in docs:
            p.add(d)
        p.flush()
        st = p.stats
        print(f"{max_len:>8,} {st.rows:>6,} {100 * st.efficiency:>9.2f}% {int((lens > max_len).sum()):>10,} "
              f"{st.docs_split:>10,} {st.pad_tokens:>11,} {time.perf_counter() - tp:>8.2f}")


if __name__ == "__main__":
    main()
