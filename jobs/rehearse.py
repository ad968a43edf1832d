"""Rehearse a recipe's Ray topology on a simulated cluster of GPU nodes, on CPU, with tiny models.

    hylo rehearse --config llama-3.2-1b-8mla8gdn-64k.yaml [--nodes 2 --gpus-per-node 8 --cpus-per-node 64]
    python jobs/rehearse.py --config configs/qwen3-1.7b-7mla21gdn-64k.yaml --nodes 1 --check-only

The fit arithmetic first (exit status 2 and one line when the workers and teacher replicas cannot fit the
nodes), then one optimiser step of the real stage driver on `ray.cluster_utils.Cluster` with the recipe's
scaling and teacher pool; every actor placed and nothing pending, or exit status 1. pipeline/rehearse.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.rehearse import main as rehearse_main


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    return rehearse_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
