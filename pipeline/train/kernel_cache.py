"""Where a training run keeps its compiled Triton kernels and fla's autotune choices, and the environment that
points every worker there.

    kernel_cache_dir(cfg)            # the directory: ray.kernel_cache, else <run dir>/kernel_cache, else node-local
    kernel_cache_env(directory)      # {"TRITON_CACHE_DIR": <directory>/triton, "FLA_CACHE_RESULTS": "1"}
    worker_cache_env(cfg)            # both together: what every training worker's environment gets

Triton compiles each kernel on its first launch and keeps the binary under `TRITON_CACHE_DIR`. With
`FLA_CACHE_RESULTS=1` fla's autotuner keeps its choices there too. One shared directory lets a resumed run, a
relaunched worker group and a later run load kernels instead of compiling and tuning them again.

Which directory (`kernel_cache_dir`):
* `ray.kernel_cache` when set: a path every node sees, e.g. one `hylo kernels-check --warm-cache DIR` filled;
* else `<run dir>/kernel_cache` when the run lives in a directory;
* else, for a run at a URI, `~/.cache/hylo/kernel_cache` on each node: Triton needs a filesystem.

The layout below the directory (`kernel_cache_env`) is the one contract with `hylo kernels-check --warm-cache`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hylo.pipeline.train.storage import run_loc

TRITON_SUBDIR = "triton"
RUN_SUBDIR = "kernel_cache"


def node_local_kernel_cache() -> Path:
    """The per-node default for runs stored at a URI."""
    return Path.home() / ".cache" / "hylo" / RUN_SUBDIR


def kernel_cache_dir(cfg: Any) -> Path:
    """The kernel cache directory of the run of stage config `cfg` (see the module docstring), absolute."""
    if cfg.ray.kernel_cache:  # a filesystem path (RaySection refuses a URI)
        return Path(cfg.ray.kernel_cache).expanduser().absolute()
    run = run_loc(cfg)
    if run.is_local:
        return run.local().absolute() / RUN_SUBDIR
    return node_local_kernel_cache()


def kernel_cache_env(directory: str | Path) -> dict[str, str]:
    """The environment variables that make Triton and fla read and write the kernel cache at `directory`."""
    return {"TRITON_CACHE_DIR": str(Path(directory) / TRITON_SUBDIR), "FLA_CACHE_RESULTS": "1"}


def worker_cache_env(cfg: Any) -> dict[str, str]:
    """What every training worker's environment gets for the kernel cache of the run of `cfg`."""
    return kernel_cache_env(kernel_cache_dir(cfg))
