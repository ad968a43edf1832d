"""Peak memory of ONE stage-2 training step of the demo model on CPU, at 2K, 4K, 8K and 16K tokens.

    python bench/step_memory.py                          # the demo student (SmolLM2-135M, 15 MLA + 15 GDN)
    python bench/step_memory.py --tokens 1024 2048       # a quicker run

The step is the real one (`pipeline/train/stage2.py`: DeepSpeed ZeRO-3 engine with a single rank,
activation checkpointing, in-process SmolLM2 teacher, fused KL over hidden states, AdamW step), on a
packed row of synthetic documents of 256-2,048 tokens (ShareGPT-like lengths), fp32, 2 threads.

How memory is measured: each length runs in a fresh subprocess. After the engine, the teacher and the
row are built (and one warm-up step at 256 tokens has allocated the optimiser state), the child
records its anonymous resident memory (RssAnon) as the baseline, runs one full step while a thread
samples RssAnon every 5 ms, and reports max - baseline: everything the step itself holds at once at
that length ("step peak"), and the same maximum up to the start of the optimiser step ("fwd+bwd
peak": activations, recomputation, teacher states, fused-KL buffers and gradients; the optimiser and
ZeRO gradient partitioning add a length-independent part after it). Two details make RSS track live tensors: the child runs with glibc's
MALLOC_MMAP_THRESHOLD_=131072 (otherwise glibc keeps freed activation buffers in its heap and the
dynamic threshold makes that retention depend on history), and only anonymous memory is counted
(file-backed pages of the safetensors weights come and go with the page cache when other processes
need memory; VmHWM, which counts them, gave non-monotonic figures on a busy machine).
Growth must be linear: extra(16K) <= 2.3 x extra(8K).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from proc_status import PeakSampler  # noqa: E402  (bench/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.assets import cache_root  # noqa: E402
from hylo.pipeline.train.config import load_stage_config  # noqa: E402


def demo_student(cache: Path) -> Path:
    """The demo's converted student (the conversion of configs/demo-smollm2.yaml's stage 1), cached."""
    from hylo.upcycle import convert  # lazy: torch

    out = cache / "hylo-smollm2-demo"
    if not (out / "hybrid_config.json").is_file():
        s1 = load_stage_config(1, REPO / "configs" / "demo-smollm2.yaml")
        convert(s1.model.base, s1.model.convert).save(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(tokens: int, student: str, threads: int, extra: list[str] | None = None) -> dict:
    import torch  # lazy: torch

    torch.set_num_threads(threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from hylo.pipeline.train import stage2  # lazy: torch
    from hylo.pipeline.train.deepspeed_cfg import resolve_dtype  # lazy: torch
    from hylo.pipeline.train.loop import cosine_with_warmup, setup_distributed  # lazy: torch
    from hylo.pipeline.train.row_sources import open_rows  # lazy: torch
    from hylo.pipeline.train.worker import WorkerContext  # lazy: torch

    overrides = [f"model.student={student}", "data.source=synthetic", f"data.seq_len={tokens}",
                 "data.synthetic.vocab_size=49152", "data.synthetic.min_doc_len=256",
                 "data.synthetic.max_doc_len=2048", "train.global_batch_sequences=1", "ray.num_workers=1",
                 "teacher.model.path=asset:smollm2-135m-instruct", "optim.lr=1e-5", *(extra or [])]
    cfg = load_stage_config(2, REPO / "configs" / "demo-smollm2.yaml", overrides)
    rank, world, device = setup_distributed(cfg)
    ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=device,
                        dtype=resolve_dtype("auto", False), run_dir=Path("/tmp"),
                        grad_accum=cfg.grad_accum)
    task = stage2.build(ctx, cosine_with_warmup(10, 0.0, 0.0))
    warm = open_rows(dataclasses.replace(cfg.data, seq_len=256), 1, 0, 1)
    stage2.train_step(task, [warm.next_row()], ctx)
    row = open_rows(cfg.data, 0, 0, 1).next_row()

    gc.collect()
    # The activation part of the step ends when the optimiser step starts: record the peak so far there.
    engine_step = task.engine.step
    marks: dict[str, int] = {}

    with PeakSampler("RssAnon") as rss:
        def step_and_mark() -> None:
            marks["fwd_bwd_kib"] = rss.mark()
            engine_step()

        task.engine.step = step_and_mark
        t0, c0 = time.perf_counter(), time.process_time()
        out = stage2.train_step(task, [row], ctx)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    base_kib, peak_kib = rss.base_kib, rss.peak_kib
    return {"tokens": tokens, "docs": len(row.host) - 1, "baseline_mib": base_kib / 1024,
            "extra_peak_mib": (peak_kib - base_kib) / 1024,
            "fwd_bwd_peak_mib": (marks["fwd_bwd_kib"] - base_kib) / 1024, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "kl": out.sums["kl_sum"] / max(out.sums["loss_tokens"], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the measured step, e.g. --set deepspeed.zero_stage=2")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--student", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(run_child(args.child, args.student, args.threads, args.overrides)), flush=True)
        return

    student = demo_student(cache_root() / "bench")
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hylo" / "torch_extensions"))
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env["HYLO_HOST_MALLOC"] = "system"  # freed memory must go back to the system for RSS to track it
    rows = []
    print(f"stage-2 step of the demo student ({student.name}), fp32 CPU, {args.threads} threads")
    print(f"{'tokens':>7} {'docs':>5} {'step peak MiB':>14} {'fwd+bwd peak MiB':>17} {'MiB / 1K tok':>13} "
          f"{'step s':>8} {'CPU s':>7} {'KL':>7}")
    for n in args.tokens:
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--student", str(student),
                               "--threads", str(args.threads), *(f"--set={o}" for o in args.overrides)],
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"child for {n} tokens failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        r = json.loads(line.removeprefix("RESULT "))
        rows.append(r)
        print(f"{n:>7} {r['docs']:>5} {r['extra_peak_mib']:>14.0f} {r['fwd_bwd_peak_mib']:>17.0f} "
              f"{1024 * r['fwd_bwd_peak_mib'] / n:>13.1f} "
              f"{r['seconds']:>8.1f} {r['cpu_seconds']:>7.1f} {r['kl']:>7.3f}", flush=True)
    for key, what in (("extra_peak_mib", "step peak"), ("fwd_bwd_peak_mib", "fwd+bwd peak")):
        by = {r["tokens"]: r[key] for r in rows}
        if 8192 in by and 16384 in by:
            ratio = by[16384] / by[8192]
            print(f"16K / 8K {what} = {ratio:.2f} (linear growth target: <= 2.3) -> "
                  f"{'OK' if ratio <= 2.3 else 'NOT MET'}")


if __name__ == "__main__":
    main()
