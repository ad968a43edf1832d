"""Every Triton kernel a config's step launches (ours and fla's), compiled for each target GPU, on this machine.

    hylo kernels-check --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --out kcheck/
    hylo kernels-check --config configs/demo-smollm2.yaml --targets gfx942,sm_90 --out kcheck/
    python jobs/kernels_check.py --config configs/qwen3-1.7b-7mla21gdn-64k.yaml --targets gfx950 --out kcheck/
    hylo kernels-check --config configs/demo-smollm2.yaml --targets sm_90 --out kcheck/ --warm-cache /shared/kc
        (/shared/kc: the job's ray.kernel_cache; its Triton binaries, compiled here, in /shared/kc/triton)

One child process per target (sm_90, sm_100, gfx942, gfx950) imports fla under that GPU's device properties
and compiles, without launching, every kernel of the config's launch sites (GDN chunk forward and backward
over a packed row, the decode step, Mamba-2's simple-GLA where the config has it, the fused KL's steps) at
the config's head sizes and dtypes, every autotune configuration. Writes OUT/kernels_check.json (one record
per kernel x configuration x target: warps, stages, shared memory against the target's, registers, spills,
the compiler's error, the compile's seconds and Triton cache hit; totals per target) and OUT/kernels_check.md
(the table); exit status 1 when a launch site has a kernel with no configuration that compiles and fits. How: pipeline/kernels_check.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.kernels_check import main as kernels_check_main


@job_main(stops=True)
def main(argv: list[str] | None = None) -> int:
    return kernels_check_main(sys.argv[1:] if argv is None else argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
