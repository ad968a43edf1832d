"""Memory per GPU and FLOPs of one training step of a config, without the hardware (the step on fake tensors).

    hylo estimate --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --tokens 8192,65536
    hylo estimate --config configs/demo-smollm2.yaml --stage 1 --world-size 1 --tokens 512
    python jobs/estimate.py --config configs/qwen3-1.7b-7mla21gdn-64k.yaml --world-size 8 --json est.json
    hylo estimate --config configs/llama-3.2-3b-14mla14gdn-64k.yaml --tokens 131072 --sequence-parallel 4

Per GPU: the student's parameters, gradients and optimizer states (ZeRO-3 over --world-size, default the
config's ray.num_workers, as arithmetic on their real sizes), the activations and temporaries at the peak,
the fused loss's own peak, the teacher's weights where it runs in the trainer, the peak and which GPUs
(H100, H200, B200, MI300X, MI355X) it fits; the step's FLOPs by phase and by the dtype each product runs at
(bf16, tf32, fp32) and their time at each GPU's dense peak of that dtype (a lower bound). With the Serve pool's teacher, one teacher replica GPU too. With --sequence-parallel N
(default: the config's train.sequence_parallel; N divides the training workers and every row length), each row
is split by tokens over N GPUs: per GPU the rank's step at T/N tokens, what splitting adds (the last rank's
MLA keys from the row's start, the gathered GDN / Mamba-2 states), the extra FLOPs, and the bytes each layer
sends per step (MLA's latent gather against Ulysses, state passing). The teacher (stage 1: the base) per GPU
too, run whole on every GPU (today) against split with the row (train.sequence_parallel_teacher, or
--teacher-split allgather|ulysses), and the bytes each teacher layer sends by either scheme. How it is measured
and what it leaves out: pipeline/estimate/ (its package docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.estimate.args import estimate_args


@job_main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # --help, a bad flag or config and --print-config answer before the estimator (torch) is imported
    estimate_args(argv, description=__doc__)
    from hylo.pipeline.estimate.cli import main as estimate_main  # lazy: torch

    return estimate_main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
