"""Stage 2 of the HyLo recipe: end-to-end KL distillation from the teacher.

    python jobs/stage2.py --config configs/demo-smollm2.yaml [--set optim.lr=1e-4 ...] [--resume [PATH]]
    RAY_AUTH_MODE=disabled ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python jobs/stage2.py --config configs/demo-smollm2.yaml --set ray.storage_path=$PWD/runs

All options: pipeline/train/config.py. The step: pipeline/train/stage2.py. The loop: pipeline/train/loop.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main, leave
from hylo.pipeline.train.args import stage_args


@job_main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # --help, a bad flag or config and --print-config answer before the training stack is imported
    stage_args(2, argv)
    from hylo.pipeline.train import driver  # lazy: torch

    with driver.exit_status() as status:
        driver.run(2, argv)
    return status.code


if __name__ == "__main__":
    leave(main())
