"""Offline teacher top-k cache: run the teacher over a packed dataset and write versioned shards.

    hylo teacher-cache --set data=DIR --set out=DIR [--config X.yaml] [--set teacher.k=64 ...]

Resumable: rerun the same command after a kill; finished shards are kept, the rest are computed.
Smoke variant (this machine): --set teacher.model.path=<tiny HF dir> --set num_actors=1 --set cpus_per_actor=1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # python jobs/NAME.py of a checkout, installed or not: use the hylo/ beside jobs/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hylo.pipeline.cli import job_main
from hylo.pipeline.config import add_config_args, config_from_args
from hylo.pipeline.paths import resolve_paths
from hylo.pipeline.ray_init import check_ray_address, ray_running
from hylo.pipeline.teacher.config import TeacherCacheConfig
from hylo.pipeline.teacher.sources.base import check_model_weights


@job_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(parser, example="teacher.k=64")
    cfg = resolve_paths(config_from_args(TeacherCacheConfig, parser.parse_args(argv)))
    # Every input check (data shards, teacher files, an existing cache's header) before Ray starts; the cache's
    # stack (torch, pyarrow) after --help and --print-config answered.
    from hylo.pipeline.teacher.cache import check_cache_output, prepare_cache, run_cache_job  # lazy: torch

    # the cluster it joins answers (a stale RAY_ADDRESS is named now, before the cache directory is made)
    check_ray_address(cfg.ray.address)
    if cfg.data and cfg.out:
        check_cache_output(cfg)  # out is no input and no directory of the user's: before the teacher is fetched
        check_model_weights(cfg.teacher.model)
    prepare_cache(cfg)

    # On a cluster, submit with `ray job submit --working-dir . -- python jobs/teacher_cache.py ...`.
    with ray_running(cfg.ray.address, cfg.ray.num_cpus):
        result = run_cache_job(cfg)
    print(json.dumps(result))
    return 0 if result["complete"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
