"""The step estimate (`hylo estimate`, pipeline/estimate/) beside the same step measured on this CPU.

    python bench/estimate_check.py                            # 2K, 4K, 8K tokens (about 10 minutes)
    python bench/estimate_check.py --tokens 2048 --repeat 2   # quicker
    python bench/estimate_check.py --baseline-tree /tmp/old   # before/after: the same step from another checkout

The step: stage 2 of configs/demo-smollm2.yaml (SmolLM2-135M converted: 15 MLA + 15 GDN layers; the
in-process SmolLM2 teacher, fused KL over its hidden states, activation checkpointing, AdamW), fp32, on
one packed row of ShareGPT-like documents (256-2,048 tokens), world size 1, with `PlainEngine` (DeepSpeed's
part of the step in plain torch; the estimate runs the same engine). Weights are random: memory and time
do not depend on their values.

For each length, side by side:
* memory: the measured extra resident memory of one step over the memory live at its start (a fresh child
  per measurement, RssAnon sampled every 5 ms, glibc's mmap threshold lowered so that freed buffers go back
  to the system; bench/step_memory.py's method), beside the estimate's peak minus its start (the fake-tensor
  step, CPU rules: `gpu=False`). Target: within 10 %.
* FLOPs: the estimate's count (FlopCounterMode's formulas) beside an analytic count of the same step:
  (6 + 2 with checkpointing) x linear parameters x tokens for the student's layers, 2 x for the teacher's,
  the four [tokens, V] products of the fused loss on its unmasked rows, attention dense within each document
  (4 x heads x head dim x sum of squared document lengths per forward, twice that per backward) and the GDN
  chunk products. Target: within 5 %.
* rate: counted FLOPs / the measured step's wall time, beside this machine's fp32 GEMM rate at the step's
  own matrix shapes (each distinct shape of the step's products timed in the same child right after the
  step, into preallocated outputs, weighted by its FLOPs; the best child's rate is every tree's reference at
  that length): the achieved fraction. The timed child is set up
  as that checkout's training worker sets up a CPU worker (its host-allocator setting, where it has one)
  and times the second step at its length, a steady-state step; the memory child is a separate one. With `--baseline-tree` each length runs in both checkouts alternately
  (`--repeat` times each), so the before/after fractions come from the same minutes.
  Where the time that is not matrix products goes: bench/step_profile.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from proc_status import PeakSampler  # noqa: E402  (bench/ is on sys.path when run as a script)

from hylo.pipeline.train.config import load_stage_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo-smollm2.yaml"
OVERRIDES = ["train.global_batch_sequences=1", "ray.num_workers=1"]
MIB = 1 << 20


def configs():
    return load_stage_config(2, CONFIG, OVERRIDES), load_stage_config(1, CONFIG)


def demo_step(cfg, shapes):
    """The measured step's task and context: `stage2.build` with random weights at the estimate's shapes (the
    student, the in-process teacher), fp32 on this CPU, `PlainEngine`, one rank."""
    import torch  # lazy: torch

    from hylo.pipeline.estimate import ShapeTeacher, build_model  # lazy: torch
    from hylo.pipeline.train import stage2  # lazy: torch
    from hylo.pipeline.train.plain_engine import plain_engine  # lazy: torch
    from hylo.pipeline.train.worker import SoloContext  # lazy: torch

    ctx = SoloContext(cfg=cfg, rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                      run_dir=Path("."), grad_accum=1)
    task = stage2.build(ctx, student=lambda: build_model(shapes.student, torch.float32),
                        engine=plain_engine(cfg.optim), teacher=ShapeTeacher(cfg, shapes))
    return task, ctx


# ------------------------------------------------------------------------------------ the child
def replay_gemms(gemms: list, repeats: int = 3) -> dict:
    """fp32 time of each distinct matrix product of the step (its shapes, median of `repeats` calls),
    weighted by the step's FLOPs of that shape -> this machine's GEMM rate at the step's shapes."""
    import torch  # lazy: torch

    flops = seconds = cpu_seconds = 0.0
    for op, shapes, calls, n in gemms:
        args = [torch.randn(*s) for s in shapes]
        a, b = args[-2], args[-1]
        out = torch.empty(*a.shape[:-1], b.shape[-1])  # outputs preallocated: the products alone are timed

        def run(op=op, args=args, out=out):
            if op in ("mm", "bmm"):
                return (torch.mm if op == "mm" else torch.bmm)(args[0], args[1], out=out)
            if op == "addmm" or op == "addmm_":
                return torch.addmm(args[0], args[1], args[2], out=out)
            return torch.baddbmm(args[0], args[1], args[2], out=out)

        run()
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        flops += n
        seconds += statistics.median(times) * calls
        cpu_seconds += statistics.median(cpu) * calls
    return {"gemm_flops": flops, "gemm_seconds": seconds, "gemm_gflops": flops / seconds / 1e9,
            "gemm_cpu_gflops": flops / max(cpu_seconds, 1e-9) / 1e9}


def allocator_peaks(fn, mark: str = "hylo::optimizer") -> tuple[float, float]:
    """Peak bytes the CPU allocator held beyond what was live at the start of `fn`, over all of it and up to
    the first `mark` range: torch.profiler's memory events (every allocation and free, in order), the CPU
    analogue of torch.cuda.max_memory_allocated; exact whatever else runs on the machine."""
    from torch.profiler import ProfilerActivity, profile  # lazy: torch

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = list(prof.profiler.kineto_results.events())
    cut = min((e.start_ns() for e in events if e.name() == mark), default=None)
    cur = peak = before = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
        if cut is None or e.start_ns() < cut:
            before = max(before, cur)
    return float(peak), float(before)


def run_child(tokens: int, threads: int, gemms: list, memory: bool = True) -> dict:
    """One step measured in this process: its memory (`memory`: malloc returning freed memory, so that RssAnon
    tracks live tensors) or its time (the process set up as the checkout's training worker sets up a CPU
    worker: `keep_freed_host_memory` where that checkout has it), then the GEMM reference."""
    import torch  # lazy: torch

    torch.set_num_threads(threads)
    host_malloc = None
    if not memory:
        try:
            from hylo.kernels.backend import keep_freed_host_memory  # lazy: torch
        except ImportError:  # a checkout from before the setting
            host_malloc = "system (this checkout has no keep_freed_host_memory)"
        else:
            host_malloc = "keep" if keep_freed_host_memory() else "system"
    from hylo.pipeline.estimate import DOC_TOKENS, shapes_of, synthetic_row  # lazy: torch
    from hylo.pipeline.train import stage2  # lazy: torch

    cfg, s1 = configs()
    shapes = shapes_of(cfg, s1)
    torch.manual_seed(0)
    task, ctx = demo_step(cfg, shapes)
    vocab = shapes.student.vocab_size
    stage2.train_step(task, [synthetic_row(min(256, tokens), vocab, (64, 128), seed=1)], ctx)
    row = synthetic_row(tokens, vocab, DOC_TOKENS)
    if not memory:
        # the timed step is a steady-state one, as every step of a run after its first: one step at this
        # length before it (what a process keeps from it, e.g. its heap, is kept from a run's earlier steps)
        stage2.train_step(task, [row], ctx)
    gc.collect()
    with PeakSampler("RssAnon") as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        out = stage2.train_step(task, [row], ctx)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    res = {"tokens": tokens, "docs": len(row.host) - 1, "rss_extra_mib": (rss.peak_kib - rss.base_kib) / 1024,
           "seconds": seconds,
           "cpu_seconds": cpu_seconds, "kl": out.sums["kl_sum"] / max(out.sums["loss_tokens"], 1),
           "host_malloc": host_malloc}
    if memory:
        # the same step again under the profiler's memory events (its time is not the step's)
        from torch.profiler import record_function  # lazy: torch

        gc.collect()
        engine_step = task.engine.step

        def marked_step() -> None:
            with record_function("hylo::optimizer"):
                engine_step()

        task.engine.step = marked_step
        peak_b, fwd_bwd_b = allocator_peaks(lambda: stage2.train_step(task, [row], ctx))
        res["allocator_extra_mib"], res["allocator_fwd_bwd_extra_mib"] = peak_b / MIB, fwd_bwd_b / MIB
    else:
        res.update(replay_gemms(gemms))
    return res


# ------------------------------------------------------------------------------------ analytic count
def analytic_flops(tokens: int, row, shapes, checkpointing: bool, valid_rows: int) -> dict[str, float]:
    """The step's FLOPs by hand (see the module docstring); attention dense within each document."""
    s, t = shapes.student, shapes.teacher
    lens = [e - b for b, e in zip(row.host[:-1], row.host[1:])]
    sq = sum(n * n for n in lens)
    D, F = s.hidden_size, s.intermediate_size
    mla = set(s.mla_layers)
    n_mla, n_lin = len(mla), s.n_layer - len(mla)
    # linear parameters of one layer of each kind (biases aside)
    H, E, Vd, R, P = s.num_attention_heads, s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank, \
        s.qk_rope_head_dim
    kv_b_heads = s.num_key_value_heads if getattr(s, "kv_b_per_kv_head", False) else H
    q = D * H * E if s.q_lora_rank is None else D * s.q_lora_rank + s.q_lora_rank * H * E
    mla_lin = q + D * (R + P) + R * kv_b_heads * (s.qk_nope_head_dim + Vd) + H * Vd * D
    Hg, K, Vg = s.gdn_num_heads, s.gdn_head_dim, s.gdn_value_dim
    gdn_lin = D * Hg * K * 2 + D * Hg * Vg * 2 + 2 * D * Hg + Hg * Vg * D
    mlp = 3 * D * F
    layer_lin = n_mla * (mla_lin + mlp) + n_lin * (gdn_lin + mlp)
    passes = 6 + (2 if checkpointing else 0)  # forward, backward (2x), recompute
    out = {"student linear": passes * layer_lin * tokens}
    # MLA attention: q.k and p.v per head at the padded head dim, per document; backward twice the forward
    d = max(E, Vd)
    fwd = 4 * H * d * sq
    out["student attention"] = n_mla * (fwd * (2 if checkpointing else 1) + 2 * fwd)
    # GDN chunk products per chunk and head (kernels/gdn/chunk.py): K K^T, the triangular solve for U and W,
    # V' = U - W S, the state update, Q S and the intra-chunk Q K^T (.) V'; backward twice the forward
    C = min(s.gdn_chunk_size, max(lens))
    chunks = sum(math.ceil(n / C) for n in lens)
    per_chunk = 2 * C * C * K + C * C * (Vg + K) + 2 * C * K * Vg * 3 + 2 * C * C * K + 2 * C * C * Vg
    out["student GDN chunks"] = n_lin * Hg * chunks * per_chunk * ((2 if checkpointing else 1) + 2)
    V = s.vocab_size
    Dt, Ft, Lt = t.hidden_size, t.intermediate_size, t.num_hidden_layers
    Ht, Hkv, dh = t.num_attention_heads, t.num_key_value_heads, getattr(t, "head_dim", None) or Dt // t.num_attention_heads
    t_lin = Lt * (Dt * Ht * dh + 2 * Dt * Hkv * dh + Ht * dh * Dt + 3 * Dt * Ft)
    out["teacher linear"] = 2 * t_lin * tokens
    out["teacher attention"] = Lt * 4 * Ht * dh * sq
    # fused loss: student and teacher logits, d(hidden), d(weight) on its rows
    out["fused loss"] = 2 * valid_rows * V * (D + Dt + D + D)
    return out


# ------------------------------------------------------------------------------------ driver
def print_memory(est_extra: float, est_fb: float, m: list[dict]) -> None:
    meas = statistics.median(r["allocator_extra_mib"] for r in m)
    meas_fb = statistics.median(r["allocator_fwd_bwd_extra_mib"] for r in m)
    rss = statistics.median(r["rss_extra_mib"] for r in m)
    print(f"  memory   step peak: estimate {est_extra:7.0f} MiB  measured (allocator) {meas:7.0f} MiB  "
          f"ratio {est_extra / meas:5.3f}  (RssAnon sampled: {rss:.0f} MiB)   fwd+bwd: estimate {est_fb:7.0f}  "
          f"measured {meas_fb:7.0f}  ratio {est_fb / meas_fb:5.3f}")


def measure(tree: Path, tokens: int, threads: int, gemm_file: Path, memory: bool) -> dict:
    """One child measuring the step of checkout `tree` (this file's child code, that checkout's step)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if memory:  # freed buffers go back to the system, so that RssAnon tracks what is live
        env.update(MALLOC_MMAP_THRESHOLD_="131072", HYLO_HOST_MALLOC="system")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(tokens), "--threads", str(threads),
           "--gemms", str(gemm_file)] + ([] if memory else ["--no-memory"])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"child ({tree}, {tokens} tokens) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="measured steps per length (and per tree)")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout whose step is measured alternately beside this one's (before/after)")
    p.add_argument("--rate-only", action="store_true",
                   help="measure the step's time only (no memory profile): the before/after comparison")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--gemms", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-memory", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        gemms = json.loads(args.gemms.read_text())
        print("RESULT " + json.dumps(run_child(args.child, args.threads, gemms, not args.no_memory)), flush=True)
        return

    sys.path.insert(0, str(REPO))
    import torch  # lazy: torch

    from hylo.pipeline.estimate import DOC_TOKENS, estimate_step, shapes_of, synthetic_row  # lazy: torch

    torch.set_num_threads(args.threads)
    cfg, s1 = configs()
    shapes = shapes_of(cfg, s1)
    trees = [("after", REPO)] + ([("before", args.baseline_tree.resolve())] if args.baseline_tree else [])
    print(f"stage-2 step of the demo student, fp32 CPU, {args.threads} threads, world size 1; "
          f"trees: {', '.join(f'{n}={t}' for n, t in trees)}", flush=True)
    rows_out = []
    for T in args.tokens:
        est = estimate_step(cfg, T, 1, torch.float32, gpu=False, shapes=shapes, stage1=s1)
        row = synthetic_row(T, shapes.student.vocab_size, DOC_TOKENS)
        ana = analytic_flops(T, row, shapes, cfg.model.activation_checkpointing, row.loss_tokens)
        gemm_file = Path(f"/tmp/estimate_check_gemms_{os.getpid()}_{T}.json")
        gemm_file.write_text(json.dumps(est.gemms))
        runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
        mem = [] if args.rate_only else [measure(REPO, T, args.threads, gemm_file, memory=True)]
        for _ in range(args.repeat):
            for name, tree in trees:
                runs[name].append(measure(tree, T, args.threads, gemm_file, memory=False))
        gemm_file.unlink()
        est_extra = (est.peak_bytes - est.start_bytes) / MIB
        est_fb = (est.phase_peaks.get("forward/backward", 0) - est.start_bytes) / MIB
        rec = {"tokens": T, "docs": len(row.host) - 1, "estimate_extra_mib": est_extra,
               "estimate_fwd_bwd_extra_mib": est_fb, "estimate_seconds": est.seconds, "flops": est.flops,
               "counted_flops": est.total_flops, "analytic": ana, "analytic_flops": sum(ana.values()), "runs": runs,
               "memory_runs": mem}
        rows_out.append(rec)
        print(f"\n{T} tokens, {rec['docs']} documents (estimate in {est.seconds:.0f} s)")
        if mem:
            print_memory(est_extra, est_fb, mem)
        print(f"  FLOPs    counted {est.total_flops / 1e12:7.3f} T  analytic {rec['analytic_flops'] / 1e12:7.3f} T  "
              f"ratio {est.total_flops / rec['analytic_flops']:5.3f}   "
              + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in est.flops.items()))
        # one GEMM reference per length for every tree: the best rate a child reached at the step's shapes (a
        # process's malloc setting moves MKL's own workspace allocations, hence the reference, a little)
        ref = {gem: max(r[gem] for rs in runs.values() for r in rs) for gem in ("gemm_gflops", "gemm_cpu_gflops")}
        rec["gemm_reference_gflops"] = ref
        for name, _ in trees:
            rs = runs[name]
            for clock, sec, gem in (("wall", "seconds", "gemm_gflops"), ("CPU", "cpu_seconds", "gemm_cpu_gflops")):
                secs = [r[sec] for r in rs]
                rates = [est.total_flops / x / 1e9 for x in secs]
                gemm = [r[gem] for r in rs]
                fracs = [rate / ref[gem] for rate in rates]
                rec.setdefault("fraction", {}).setdefault(name, {})[clock] = fracs
                print(f"  rate     {name:6s} {clock:4s} step {', '.join(f'{x:.1f}' for x in secs)} s -> "
                      f"{', '.join(f'{x:.1f}' for x in rates)} GFLOP/s; GEMMs at the step's shapes "
                      f"{', '.join(f'{g:.0f}' for g in gemm)} GFLOP/s (reference {ref[gem]:.0f}); achieved fraction "
                      f"{', '.join(f'{x:.3f}' for x in fracs)} (median {statistics.median(fracs):.3f}); "
                      f"KL {rs[0]['kl']:.6f}; host malloc: {rs[0]['host_malloc']}", flush=True)
        if len(trees) == 2:
            for clock, sec in (("wall", "seconds"), ("CPU", "cpu_seconds")):
                a = statistics.median(r[sec] for r in runs["after"])
                b = statistics.median(r[sec] for r in runs["before"])
                print(f"  before/after step {clock} time {b:.1f} / {a:.1f} s = {b / a:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=1))


if __name__ == "__main__":
    main()
