"""The whole HyLo recipe on SmolLM2-135M-Instruct and real ShareGPT, on local Ray, on CPU.

    hylo demo [--run-dir runs/demo] [--steps 8] [--records 300] [--force] [--full-eval]
    hylo demo --config my-demo.yaml --set heldout_rows=16 [--print-config]

fetch assets -> decontaminate ShareGPT against HumanEval -> prepare stage-1 / stage-2 / held-out rows ->
convert (MLA on even layers, GDN elsewhere) -> stage 1 (Enhanced-ILD) -> stage 2 (KL from the teacher)
-> evaluate. Each step runs the project's own job as a subprocess and logs to <run-dir>/logs/<step>.log;
a re-run skips finished steps. Options: `DemoConfig` in pipeline/demo.py (the flags are shorthands
for its keys); the workflow, report and plots: pipeline/demo.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.demo import demo_config, run_demo
from hylo.pipeline.paths import resolve_paths


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    return run_demo(resolve_paths(demo_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
