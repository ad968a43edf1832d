"""Memory per GPU and FLOPs of one training step of a config, without the hardware (the step on fake tensors).

    python jobs/estimate.py --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --tokens 8192,32768,65536,131072
    python jobs/estimate.py --config configs/demo-smollm2.yaml --stage 1 --world-size 1

How it is measured and what it leaves out: pipeline/train/estimate.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    # run as a file (python jobs/NAME.py): the packages are in the checkout beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main  # noqa: E402


@job_main
def main(argv: list[str] | None = None) -> int:
    from hylo.pipeline.train.estimate import main as estimate_main

    return estimate_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
