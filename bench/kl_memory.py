"""Peak extra memory and wall time of KL(teacher || student) forward + backward on CPU.

    python bench/kl_memory.py                      # N in {2048, 8192}, H=576, V=49,152, fp32
    python bench/kl_memory.py --n 1024 --vocab 8192  # a quick smaller run

Cases, side by side in one run: the naive reference (full logits + F.kl_div), ours with each teacher
form (hidden states, top-k k=64 with tail, streamed logits callback), and Liger-Kernel's chunked
`LigerFusedLinearJSDLoss(beta=0, compiled=False)` when it is installed.

How memory is measured: every case runs in a fresh subprocess (so no allocator state carries over).
After building its inputs the child records its resident set (VmRSS) as the baseline, resets the
kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs resets VmHWM), runs forward + backward
once, and reports VmHWM - baseline. This counts everything the step allocates, including the
gradients it produces ([V, H] and [N, H] fp32 for every case alike). Time is that same single step,
as wall time and as the process's CPU time (all threads; steadier when other jobs share the cores).
The top-k case computes a different (bucketed) loss, so its loss value differs from the others.
Setup (the top-k record, computed chunk by chunk from the teacher logits) is outside both figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from proc_status import status_kib  # noqa: E402  (bench/ is on sys.path when run as a script)

CASES = ["naive", "ours-hidden", "ours-topk64", "ours-logits-fn", "liger-chunked"]


def run_child(case: str, n: int, hidden: int, vocab: int, seed: int) -> dict:
    import torch  # lazy: torch
    import torch.nn.functional as F  # lazy: torch

    from hylo.kernels.fused_kl import fused_linear_kl_div, topk_from_logits  # lazy: torch
    from hylo.kernels.fused_kl.topk import TeacherTopK  # lazy: torch

    torch.manual_seed(seed)
    student_hidden = (torch.randn(n, hidden) * 0.5).requires_grad_()
    student_weight = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    teacher_hidden = torch.randn(n, hidden) * 0.5
    teacher_weight = torch.randn(vocab, hidden) * 0.05

    if case == "naive":

        def step():
            logits = student_hidden @ student_weight.t()
            with torch.no_grad():
                teacher_logits = teacher_hidden @ teacher_weight.t()
            return F.kl_div(F.log_softmax(logits, -1), F.softmax(teacher_logits, -1), reduction="batchmean")

    elif case == "ours-hidden":

        def step():
            return fused_linear_kl_div(
                student_hidden, student_weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight
            )

    elif case == "ours-topk64":
        parts = []
        with torch.no_grad():
            for i in range(0, n, 512):
                parts.append(topk_from_logits(teacher_hidden[i : i + 512] @ teacher_weight.t(), 64))
        record = TeacherTopK(*(torch.cat(p) for p in zip(*parts)))
        del parts

        def step():
            return fused_linear_kl_div(student_hidden, student_weight, teacher_topk=record)

    elif case == "ours-logits-fn":

        def teacher_logits_fn(i: int, j: int) -> torch.Tensor:
            return teacher_hidden[i:j] @ teacher_weight.t()

        def step():
            return fused_linear_kl_div(student_hidden, student_weight, teacher_logits_fn=teacher_logits_fn)

    elif case == "liger-chunked":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # optional: liger

        liger = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, compiled=False, chunk_size=1024
        )
        labels = torch.randint(0, vocab, (n,))

        def step():
            return liger(student_hidden, student_weight, teacher_hidden, teacher_weight, labels)

    else:
        raise ValueError(f"unknown case {case!r}; choose from {CASES}")

    gc.collect()
    baseline_kib = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = step()
    loss.backward()
    wall_s = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    peak_kib = status_kib("VmHWM")
    return {
        "case": case,
        "n": n,
        "loss": float(loss.detach()),
        "extra_peak_mib": (peak_kib - baseline_kib) / 1024,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "grad_norm": float(student_hidden.grad.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args.child, args.n[0], args.hidden, args.vocab, args.seed)))
        return

    from hylo.kernels.backend import importable  # lazy: torch

    cases = [c for c in args.cases if c != "liger-chunked" or importable("liger_kernel.chunked_loss")]
    if "liger-chunked" in args.cases and "liger-chunked" not in cases:
        print("liger-kernel not installed: its case is skipped (pip install liger-kernel --no-deps)")
    import torch  # lazy: torch

    print(
        f"fused KL bench: fp32, H={args.hidden}, V={args.vocab}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; peak = VmHWM - VmRSS after setup, one fresh process per case"
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    header = (
        f"{'N':>6} {'case':<16} {'extra peak MiB':>15} {'vs naive':>9} {'fwd+bwd s':>10} {'vs naive':>9} "
        f"{'cpu s':>7} {'vs naive':>9} {'loss':>10}"
    )
    print(header)
    print("-" * len(header))
    for n in args.n:
        naive = None
        for case in cases:
            cmd = [sys.executable, __file__, "--child", case, "--n", str(n), "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--seed", str(args.seed)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
            if proc.returncode != 0:
                why = proc.stderr.strip().splitlines()[-1:] or ["no message"]
                if proc.returncode == -9:
                    why = ["killed by SIGKILL (out of memory?)"]
                print(f"{n:>6} {case:<16} FAILED (exit {proc.returncode}): {why[0]}", flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if case == "naive":
                naive = r
            mem_ratio = f"{r['extra_peak_mib'] / naive['extra_peak_mib']:.1%}" if naive else "-"
            time_ratio = f"{r['wall_s'] / naive['wall_s']:.2f}x" if naive else "-"
            cpu_ratio = f"{r['cpu_s'] / naive['cpu_s']:.2f}x" if naive else "-"
            print(
                f"{n:>6} {case:<16} {r['extra_peak_mib']:>15.0f} {mem_ratio:>9} {r['wall_s']:>10.2f} "
                f"{time_ratio:>9} {r['cpu_s']:>7.2f} {cpu_ratio:>9} {r['loss']:>10.5f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
