"""Choose which layers keep full attention (MLA) by measurement: the sensitivity search.

    hylo place-layers --n-mla 15 --data-from runs/demo [--compare even uniform:15]
    hylo place-layers --n-mla 15 --data-from runs/demo --proxy-only      # seconds, no training
    hylo place-layers --config my-search.yaml --set compare_seeds=[0,1,2] [--print-config]

Data: packed-row directories from jobs/prepare_data.py: `--data-from RUN` takes RUN/data/{stage1,stage2,
heldout} (what `make demo` writes), or give `--stage1-data`, `--stage2-data`, `--heldout-data`. Options:
`PlacementConfig` (the flags are shorthands for its keys; `--train-config` is the training config of the
short stages); the method, its design choices and the workflow: pipeline/placement/.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.paths import resolve_paths
from hylo.pipeline.placement.cli import placement_config, run_placement


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    return run_placement(resolve_paths(placement_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
