"""The one driver of both training stages: config -> Ray -> TorchTrainer -> fit.

    python jobs/stage2.py --config configs/demo-smollm2.yaml [--set a.b=c ...] [--resume [PATH]]
    torchrun --nproc_per_node 2 jobs/stage2.py --config ... --set ray.launcher=torchrun

Design choices:
* Thin, like Ray's own training benchmarks: parse config, `ray.init` (a local Ray by default; the job's
  cluster when `RAY_ADDRESS` is set, as under `ray job submit`, or `ray.address`), build
  `TorchTrainer(train_worker, ScalingConfig, RunConfig(storage_path, name, FailureConfig,
  CheckpointConfig, callbacks=[metrics]))`, `fit()`. Everything per worker lives in loop.py.
* A run is `<ray.storage_path>/<ray.name>`. Starting a run whose directory already holds checkpoints
  needs `--resume` (continue it) or another name: nothing is silently continued or overwritten.
  `--resume` alone continues from the newest complete checkpoint; `--resume PATH` from that one.
  (`TorchTrainer(resume_from_checkpoint=...)` raises in Ray 2.60, so the path travels in the loop config;
  Ray Train itself restores its checkpoint bookkeeping from the same run directory.)
* Worker failures restart the worker group from the latest checkpoint, `ray.max_failures` times
  (under torchrun, `--max-restarts N` does the same: a relaunched rank resumes from the latest one).
* Stage 1 converts the base model first when `model.student` is unset and `model.convert` is given.
* Stage 2 with `teacher.source: serve` and `teacher.start_pool: true` deploys the teacher pool first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError, add_config_args, maybe_print_config
from pipeline.train import checkpoint as ckpt_lib
from pipeline.train.config import StageConfig, config_to_dict, load_stage_config, run_dir
from pipeline.train.inputs import check_stage_inputs
from pipeline.train.metrics import make_ray_callback, read_metrics
from pipeline.train.rows import open_rows


def build_parser(stage: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"HyLo stage {stage} training (Ray Train + DeepSpeed ZeRO-3)")
    add_config_args(p)
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue the run from its newest checkpoint, or from checkpoint directory PATH")
    return p


def torch_extensions_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "hylo" / "torch_extensions")


def check_run_dir(cfg: StageConfig, resume: str | None) -> None:
    rd = run_dir(cfg)
    latest = ckpt_lib.latest_checkpoint(rd)
    if latest is not None and resume is None:
        raise ConfigError(
            f"run directory {rd} already holds checkpoints (latest: {latest.name}); pass --resume to "
            f"continue it, or choose another ray.name / ray.storage_path")
    if resume == "latest" and latest is None:
        raise ConfigError(f"--resume: run directory {rd} holds no complete checkpoint to resume from")
    if resume not in (None, "latest") and not ckpt_lib.is_complete(Path(resume)):
        raise ConfigError(f"--resume {resume}: not a complete checkpoint directory (needs {ckpt_lib.STATE_FILE} "
                          f"and every rank's state)")


def convert_if_needed(cfg: StageConfig) -> StageConfig:
    """Stage 1 without a converted student: convert `model.base` with `model.convert` options, once."""
    if cfg.stage != 1 or cfg.model.student:
        return cfg
    if cfg.model.convert is None:
        raise ConfigError("stage 1 needs model.student (a HyLo checkpoint from jobs/convert.py) or model.convert "
                          "(conversion options, e.g. {mla_layers: even, kv_lora_rank: 128})")
    out = run_dir(cfg) / "converted"
    if not (out / "hybrid_config.json").is_file():
        from hylo.io import save_hylo
        from hylo.upcycle import load_base_model, upcycle
        from pipeline.train.stage1 import resolve_model_dir

        base_dir = resolve_model_dir(cfg.model.base)
        print(f"[convert] {base_dir} -> {out} with {cfg.model.convert}", flush=True)
        model = upcycle(load_base_model(base_dir), calibration_ids=_calibration_ids(base_dir), **cfg.model.convert)
        save_hylo(model, out, tokenizer_from=base_dir)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, student=str(out)))


def _calibration_ids(base_dir: str | Path):
    """The converter's calibration tokens (as jobs/convert.py uses them); None when the base has no tokenizer."""
    from hylo.upcycle import calibration_ids_for

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    except (OSError, ValueError) as e:
        print(f"[convert] no tokenizer in {base_dir} ({type(e).__name__}); linear gates keep their random init",
              flush=True)
        return None
    return calibration_ids_for(tokenizer)


def planned_steps(cfg: StageConfig) -> int:
    from pipeline.train.loop import total_steps_for

    rows = open_rows(cfg.data, cfg.train.seed, 0, cfg.ray.num_workers)
    total = total_steps_for(cfg, rows.num_rows)
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def loop_config(cfg: StageConfig, resume: str | None, launcher: str) -> dict[str, Any]:
    resume_from = resume
    if resume == "latest":
        latest = ckpt_lib.latest_checkpoint(run_dir(cfg))
        resume_from = str(latest) if latest is not None else None
    return {"config": config_to_dict(cfg), "resume_from": resume_from, "launcher": launcher,
            "torch_extensions_dir": torch_extensions_dir()}


def init_ray(cfg: StageConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # A local Ray for this job only: no dashboard (saves ~1 GiB), workers find this checkout.
        repo = str(Path(__file__).resolve().parents[2])
        env = {"TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
               "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        ray.init(include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True)


def start_teacher_pool(cfg: StageConfig):
    if cfg.stage != 2 or cfg.teacher.source != "serve" or not cfg.teacher.start_pool:
        return None
    from pipeline.teacher.serve import start_teacher_pool as start

    print(f"[teacher] deploying pool {cfg.teacher.pool.app_name!r} ({cfg.teacher.pool.num_replicas} replicas)",
          flush=True)
    return start(cfg.teacher.model, cfg.teacher.pool)


def fit_with_ray(cfg: StageConfig, resume: str | None) -> dict[str, Any]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.train.loop import train_worker

    init_ray(cfg)
    pool = start_teacher_pool(cfg)
    resources = {"CPU": cfg.ray.cpus_per_worker, **(cfg.ray.resources_per_worker or {})}
    if cfg.ray.use_gpu:
        resources.setdefault("GPU", 1)
    rd = run_dir(cfg)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config=loop_config(cfg, resume, "ray"),
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=cfg.ray.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            # rd.name, not cfg.ray.name: with a nested name ("a/b") Ray would write its checkpoints to
            # <storage>/a/a/b, outside the run directory that resume, metrics and cleanup read
            name=rd.name, storage_path=str(rd.parent),
            failure_config=FailureConfig(max_failures=cfg.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            callbacks=[make_ray_callback(rd, planned_steps(cfg), cfg.metrics.log_every, cfg.metrics.tensorboard)],
        ),
    )
    try:
        result = trainer.fit()
    finally:
        if pool is not None:
            from ray import serve

            serve.delete(cfg.teacher.pool.app_name)
    return {"checkpoint": result.checkpoint.path if result.checkpoint else None}


def run(stage: int, argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser(stage).parse_args(argv)
    cfg = load_stage_config(stage, args.config, args.overrides)
    maybe_print_config(cfg, args)
    launcher = cfg.ray.launcher
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    if launcher == "torchrun" and "RANK" not in os.environ:
        raise ConfigError("ray.launcher=torchrun: start this job with `torchrun --nproc_per_node N ...`")
    if launcher == "torchrun" and int(os.environ["WORLD_SIZE"]) != cfg.ray.num_workers:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but ray.num_workers="
                          f"{cfg.ray.num_workers}; they must agree")
    resume = args.resume
    if launcher == "torchrun" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # torchrun --max-restarts relaunched the ranks after a failure: continue from the latest checkpoint.
        resume = "latest" if ckpt_lib.latest_checkpoint(run_dir(cfg)) is not None else None
    else:
        check_run_dir(cfg, resume)
    if launcher == "torchrun" and cfg.stage == 1 and not cfg.model.student:
        raise ConfigError("ray.launcher=torchrun needs model.student: convert first (jobs/convert.py)")
    check_stage_inputs(cfg)
    cfg = convert_if_needed(cfg)
    rd = run_dir(cfg)
    rd.mkdir(parents=True, exist_ok=True)
    if is_rank0:
        ckpt_lib.write_json_atomic(rd / f"config_stage{stage}.json", config_to_dict(cfg))
    t0 = time.time()
    if launcher == "torchrun":
        from pipeline.train.loop import train_worker

        train_worker(loop_config(cfg, resume, "torchrun"))
        info: dict[str, Any] = {}
    else:
        info = fit_with_ray(cfg, resume)
    if is_rank0 and cfg.checkpoint.delete_after_consolidate:
        if (rd / "model" / "hybrid_config.json").is_file():
            n, freed = ckpt_lib.delete_checkpoints(rd)
            print(f"[train] checkpoint.delete_after_consolidate: removed {n} checkpoint(s), "
                  f"{freed / 2**30:.2f} GiB; the run's output is {rd / 'model'}", flush=True)
        else:
            print(f"[train] checkpoint.delete_after_consolidate: kept the checkpoints, {rd / 'model'} "
                  "was not written (checkpoint.consolidate=false?)", flush=True)
    metrics = read_metrics(rd)
    summary = {"stage": stage, "run_dir": str(rd), "model_dir": str(rd / "model"), "seconds": time.time() - t0,
               "last_step": max(metrics) if metrics else 0, **info}
    if metrics and is_rank0:
        last = metrics[max(metrics)]
        print(f"[train] stage {stage} done: step {summary['last_step']}, loss {last['loss']:.4f}, "
              f"model {summary['model_dir']}", flush=True)
    return summary


def main(stage: int) -> None:
    try:
        run(stage, sys.argv[1:])
    except (ConfigError, ckpt_lib.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
