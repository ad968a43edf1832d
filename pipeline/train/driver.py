"""The one driver of both training stages: config, checks, lock, then Ray Train or torchrun.

    python jobs/stage2.py --config configs/demo-smollm2.yaml [--set optim.lr=1e-4 ...] [--resume [PATH]]
    torchrun --nproc_per_node 2 jobs/stage2.py --config ... --set ray.launcher=torchrun

It is thin, like Ray's own training benchmarks: `run` reads the config, checks it, takes the run's lock
and hands the typed config to `loop.train_worker`. Under Ray Train that is a `TorchTrainer`; under torchrun
each rank calls the loop itself.

Design choices:
* A run is `<ray.storage_path>/<ray.name>`: a local directory or a URI that Ray Train supports (storage.py).
* One run owns its directory at a time (runlock.py). A second run with the same name stops at once.
* A directory that holds checkpoints needs `--resume` or another name: nothing is continued silently.
* Ray Train's own checkpoint record is reset at every start. The checkpoints' manifests are the record.
* Everything that can refuse a run is checked before its directory is made or Ray starts (`check_run`): the
  lock, the cluster's address, the teacher pool's port, inputs, outputs, a resume. A run that stops after it
  made its directory but before its training began removes it again (`remove_unstarted_run_dir`).
* Ray Train is handed `loop.train_worker` by name (`WORKER`): neither the driver nor Ray's controller
  imports the training stack for it. The controller sees only the small launch dict.
* A worker's input error is not retried (failures.py); faults restart from the newest intact checkpoint.
* SIGTERM asks the workers for a final checkpoint (session.py); the job then exits 143 with a resume line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import pkgutil
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hylo import logs
from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.outputs import check_not_an_input
from hylo.ownership import OUTPUT_RECORD, check_own_directory, check_replaceable, real_path, record_files
from hylo.pipeline.cli import _stop_ray_logs, input_error_message, report_error
from hylo.pipeline.config import ConfigError, config_file_of
from hylo.pipeline.paths import job_inputs, resolve_paths
from hylo.pipeline.ray_init import check_ray_address, init_ray, resolve_address, torch_extensions_dir
from hylo.pipeline.teacher.sources import source_kind
from hylo.pipeline.teacher.sources.base import ResourceDemand
from hylo.pipeline.train import stage1, stage2
from hylo.pipeline.train.args import stage_args
from hylo.pipeline.train.checkpoint.layout import (
    STEP_DIR,
    checkpoint_problem,
    delete_checkpoints,
    describe_skips,
    is_complete,
    latest_checkpoint,
    sweep_scratch,
)
from hylo.pipeline.train.checkpoint.resume import check_student_fits
from hylo.pipeline.train.collective import collective_backend
from hylo.pipeline.train.config import StageConfig, config_to_dict
from hylo.pipeline.train.inputs import check_stage_inputs
from hylo.pipeline.train.kernel_cache import worker_cache_env
from hylo.pipeline.train.metrics import make_ray_callback, read_metrics
from hylo.pipeline.train.runlock import LOCK_FILE, check_unlocked, run_lock
from hylo.pipeline.train.session import PREEMPT_FILE, read_preempt_request
from hylo.pipeline.train.startup import StartupClock, is_job_process, process_start_time
from hylo.pipeline.train.storage import Loc, StorageError, check_storage_path, is_uri, run_dir, run_loc
from hylo.pipeline.train.worker import Stage

logger = get_logger(__name__)

RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
# Ray Train's switch for its print() patch in the workers (see run_config)
PRINT_PATCH = "RAY_TRAIN_ENABLE_PRINT_PATCH"
# the exit status of a process ended by SIGTERM (128 + 15): schedulers take it for a preemption, not a bug
PREEMPTED_EXIT = 143


def check_run_dir(cfg: StageConfig, resume: str | None) -> None:
    rd = run_loc(cfg)
    latest = latest_checkpoint(rd)
    if latest is not None and resume is None:
        raise ConfigError(
            f"run directory {rd} already holds checkpoints (latest: {latest.name}); pass --resume to "
            f"continue it, or choose another ray.name / ray.storage_path")
    if resume == "latest" and latest is None:
        skipped = describe_skips(rd)
        raise ConfigError(f"--resume: run directory {rd} holds no intact checkpoint to resume from"
                          + (":\n  " + "\n  ".join(skipped) if skipped else ""))
    if resume not in (None, "latest"):
        problem = checkpoint_problem(resume_path(cfg, resume))
        if problem is not None:
            raise ConfigError(f"--resume {resume}: cannot resume from it: {problem}")


def resume_path(cfg: StageConfig, resume: str) -> Loc:
    """`--resume PATH`: a checkpoint directory or URI, or the name of a checkpoint of this run (step_N)."""
    if STEP_DIR.match(resume) and not Path(resume).exists():
        return run_loc(cfg) / resume
    return Loc.of(resume)


def reset_ray_snapshot(run: Loc) -> str | None:
    """Remove Ray Train's checkpoint bookkeeping from the run directory (see module docstring); returns
    a note when it pointed at a checkpoint that cannot be resumed from."""
    snap = run / RAY_SNAPSHOT
    if not snap.is_file():
        return None
    note = None
    try:
        latest = (read_json(snap).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    except (ValueError, OSError, AttributeError):
        latest = None
    if latest:
        problem = checkpoint_problem(run / latest)
        if problem is not None:
            note = (f"[train] Ray's checkpoint record ({RAY_SNAPSHOT}) points at {latest}, which is {problem}; "
                    f"reset it: the run resumes from its newest intact checkpoint")
    snap.rmtree()
    return note


def check_outputs(cfg: StageConfig) -> None:
    """Before Ray starts: the directories the run will replace (`<run>/model` at the end, with
    checkpoint.consolidate) hold nothing this project did not write (hylo.ownership.check_replaceable), so a
    user's file there stops the run now, not after the training."""
    run = run_loc(cfg)
    if cfg.checkpoint.consolidate and run.is_local:
        what = "the run's model directory (checkpoint.consolidate)"
        check_replaceable(run.local() / "model", what)
        # nothing the run reads is the model it replaces at the end (nor inside or around it)
        check_not_an_input(run.local() / "model", job_inputs(cfg), what)


RUN_WHAT = "the run directory (ray.storage_path/ray.name)"
# what a run records in its directory's .hylo-output.json when it claims it (the lock, the config it wrote)
RUN_ENTRIES = ("run.lock",)


def check_run_output(cfg: StageConfig) -> None:
    """Before the run directory is made or locked: it is none of what the run reads (its config file,
    model.student, model.base, data.path, teacher.cache_path, teacher.model.path: `job_inputs`; nor inside or
    around one: hylo.outputs.check_not_an_input), and, when it exists, it is a run directory of this project (its
    .hylo-output.json; never guessed from the names it holds) or empty: checkpoints are never written into a
    directory of the user's. The run's own conversion (<run>/converted, stage 1 without model.student) is its
    output, not a conflict."""
    run = run_loc(cfg)
    if not run.is_local:
        return
    d = run.local()
    # the config may be one a run wrote there (its config_stage2.json given back as --config)
    config = config_file_of(cfg)
    own = [d / "converted", *([config] if config is not None and real_path(config).is_relative_to(real_path(d)) else [])]
    check_not_an_input(d, job_inputs(cfg), RUN_WHAT, own=own)
    check_own_directory(d, RUN_WHAT, "ray.name / ray.storage_path")


def claim_run_dir(cfg: StageConfig) -> None:
    """Record the (local) run directory as this project's (.hylo-output.json), so that a later run or resume
    of it passes `check_run_output`."""
    run = run_loc(cfg)
    if run.is_local:
        record_files(run.local(), [*RUN_ENTRIES, f"config_stage{cfg.stage}.json"])


def check_resume_fits(cfg: StageConfig, resume: str | None) -> None:
    """Before Ray starts: the student a resume loads (model.student, which may change across a resume) has
    the parameter shapes of the checkpoint it continues (`--resume`: the newest intact one; `--resume PATH`:
    that one), so that a student of another width stops here, not inside DeepSpeed's load in every worker
    (where it would be retried as a fault)."""
    if resume is None or not cfg.model.student or is_uri(cfg.model.student):
        return
    ckpt = latest_checkpoint(run_loc(cfg)) if resume == "latest" else resume_path(cfg, resume)
    if ckpt is not None and is_complete(ckpt):
        check_student_fits(ckpt, Path(cfg.model.student).expanduser())


def convert_if_needed(cfg: StageConfig) -> StageConfig:
    """Stage 1 without a converted student: convert `model.base` with `model.convert` options, once
    (`hylo.upcycle.convert`, as jobs/convert.py does)."""
    if cfg.stage != 1 or cfg.model.student:
        return cfg
    if cfg.model.convert is None:
        raise ConfigError("stage 1 needs model.student (a HyLo checkpoint from jobs/convert.py) or model.convert "
                          "(conversion options, e.g. {mla_layers: even, kv_lora_rank: 128})")
    run = run_loc(cfg)
    out = run_dir(cfg) / "converted"
    target = run / "converted"
    if not (target / "hybrid_config.json").is_file():
        from hylo.upcycle import convert  # lazy: transformers

        logger.info(f"[convert] {cfg.model.base} -> {target} with {cfg.model.convert.non_defaults()}")
        convert(cfg.model.base, cfg.model.convert).save(out)
        if not run.is_local:
            target.upload_dir(out)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, student=target.uri()))


def launch_id(launcher: str) -> str:
    """Names this driver invocation in the manifests it writes, so that a relaunched worker group finds
    its own newest checkpoint (checkpoint/resume.py launch_checkpoints). Ray: one per fit(); torchrun: the
    rendezvous (every rank computes it, and `--max-restarts` relaunches keep it)."""
    if launcher == "torchrun":
        return "torchrun:" + ":".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                                                        "MASTER_PORT"))
    return f"ray:{uuid.uuid4().hex}"


def loop_config(cfg: StageConfig, resume: str | None, launcher: str) -> dict[str, Any]:
    """What every worker gets beside the config: where the run lives and where to resume from.

    `resume_latest` means the newest intact checkpoint, `resume_from` exactly that one. After a relaunch,
    the newest intact checkpoint that `launch_id` wrote comes first."""
    resume_from = None
    if resume not in (None, "latest"):
        resume_from = resume_path(cfg, resume).uri()
    return {"resume_from": resume_from, "resume_latest": resume == "latest",
            "run_loc": run_loc(cfg), "launcher": launcher, "launch_id": launch_id(launcher),
            "torch_extensions_dir": torch_extensions_dir(), "kernel_cache_env": worker_cache_env(cfg)}


@dataclasses.dataclass(frozen=True)
class ByName:
    """A function named by its import path (`module:name`), handed to Ray Train without importing its module.

    The loop imports DeepSpeed and the models: seconds a Ray driver does not need. A worker unpickles this
    as the function itself, so no frame of ours stands between Ray and the loop."""

    path: str

    def __call__(self, stage: Stage, cfg: StageConfig, loop_config: dict[str, Any]) -> None:
        # the signature Ray Train reads; a worker calls the function itself
        pkgutil.resolve_name(self.path)(stage, cfg, loop_config)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return pkgutil.resolve_name, (self.path,)


WORKER = ByName("hylo.pipeline.train.loop:train_worker")


def stage_for(number: int) -> Stage:
    """The stage (build + step) the workers train: stage1.STAGE or stage2.STAGE."""
    return (stage1 if number == 1 else stage2).STAGE


def start_teacher(cfg: StageConfig) -> Callable[[], None] | None:
    """Deploy what stage 2's teacher source runs beside the workers (the Serve pool of `teacher.source: serve`
    with `start_pool: true`); returns what stops it, or None."""
    if cfg.stage != 2:
        return None
    return source_kind(cfg.teacher.source).start(cfg.teacher, cfg.fault.teacher)


def worker_resources(cfg: StageConfig) -> dict[str, float]:
    resources = {"CPU": cfg.ray.cpus_per_worker, **(cfg.ray.resources_per_worker or {})}
    if cfg.ray.use_gpu:
        resources.setdefault("GPU", 1)
    return resources


def resource_demand(cfg: StageConfig) -> list[ResourceDemand]:
    """Everything this run asks Ray for: the train workers, and what stage 2's teacher source runs beside them."""
    out = [ResourceDemand("train worker", cfg.ray.num_workers, worker_resources(cfg),
                          "ray.num_workers / ray.cpus_per_worker")]
    if cfg.stage == 2:
        out += source_kind(cfg.teacher.source).resources(cfg.teacher)
    return [dataclasses.replace(d, resources={k: float(v) for k, v in d.resources.items() if v}) for d in out]


def check_resources(cfg: StageConfig, cluster: dict[str, float], nodes: list[dict[str, float]],
                    available: dict[str, float] | None = None) -> None:
    """Refuse a run that can never be scheduled on this cluster (Ray would wait for it forever); warn
    when it fits the cluster but not what is free now."""
    demand = resource_demand(cfg)
    need: dict[str, float] = {}
    for d in demand:
        for k, v in d.resources.items():
            need[k] = need.get(k, 0.0) + d.count * v

    def parts(key: str) -> str:
        return " + ".join(f"{d.count} {d.what}{'s' if d.count != 1 else ''} x {d.resources[key]:g}" for d in demand
                          if key in d.resources)

    short = [k for k, v in sorted(need.items()) if v > cluster.get(k, 0.0) + 1e-9]
    if short:
        k = short[0]
        raise ConfigError(
            f"this run needs {need[k]:g} {k} ({parts(k)}) but the Ray cluster has {cluster.get(k, 0.0):g}: "
            f"lower {' or '.join(d.keys for d in demand)}, or add nodes")
    for d in demand:
        if d.count and nodes and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in d.resources.items())
                                         for node in nodes):
            raise ConfigError(f"one {d.what} needs {d.resources} but no node of the Ray cluster has that much "
                              f"(largest: {max(nodes, key=lambda nd: nd.get('CPU', 0.0))})")
    if available is not None:
        busy = [k for k, v in sorted(need.items()) if v > available.get(k, 0.0) + 1e-9]
        if busy:
            k = busy[0]
            logger.warning(f"[train] warning: this run needs {need[k]:g} {k} ({parts(k)}) and only "
                           f"{available.get(k, 0.0):g} are free now; it waits until other Ray work "
                           "releases them")


def check_cluster_resources(cfg: StageConfig) -> None:
    import ray  # lazy: ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    check_resources(cfg, ray.cluster_resources(), nodes, ray.available_resources())


def run_config(cfg: StageConfig, run: Loc):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig  # lazy: ray

    failures = cfg.ray.max_failures
    return RunConfig(
        # run.name, not cfg.ray.name: with a nested name ("a/b") Ray would write its checkpoints to
        # <storage>/a/a/b, outside the run directory that resume, metrics and cleanup read
        name=run.name, storage_path=run.parent.path,
        storage_filesystem=None if run.is_local else run.fs,
        # controller_failure_limit: Ray's retries of starting the worker group are unlimited by default
        # (a run that did not fit retried forever); they follow ray.max_failures too
        failure_config=FailureConfig(max_failures=failures, controller_failure_limit=failures),
        # the workers prune (the checkpoint.keep newest intact ones); Ray only keeps its bookkeeping
        checkpoint_config=CheckpointConfig(num_to_keep=None),
        callbacks=[make_ray_callback()],
        # Ray Train replaces print() in its workers by a logger call that also tees to the original print
        # whenever sys.stdout is not sys.__stdout__, which it never is in a Ray worker (Ray wraps it):
        # every line the workers print reached the driver (and `ray job submit`'s log) twice. A local Ray
        # this job started has the switch in every worker's environment already (ray_init.project_env);
        # the workers of a cluster it joined get it here. Every worker also gets the run's kernel cache
        # (pipeline/train/kernel_cache.py), set before it starts, so fla reads it at its import
        worker_runtime_env={"env_vars": worker_env(cfg)},
    )


def worker_env(cfg: StageConfig) -> dict[str, str]:
    """The environment variables every training worker of `cfg`'s run gets from the driver."""
    env = {} if os.environ.get(PRINT_PATCH) == "0" else {PRINT_PATCH: "0"}
    # the job's log level (hylo/logs.py), for the workers of a cluster this job joined
    return {**env, **worker_cache_env(cfg), **logs.child_env()}


class Preempted(RuntimeError):
    """The driver got SIGTERM (a preemption); the message says which checkpoint `--resume` continues from."""


@contextlib.contextmanager
def preemption_handler(cfg: StageConfig, run: Loc) -> Iterator[None]:
    """While training: SIGTERM asks the workers for a final checkpoint within `checkpoint.preempt_grace_s`
    (session.Session.preemption) and, once they stopped, raises `Preempted`; a second SIGTERM stops at once."""
    grace = cfg.checkpoint.preempt_grace_s
    flag = run / PREEMPT_FILE
    flag.rmtree()  # a request left by an earlier, preempted start of this run

    def on_sigterm(signum, frame) -> None:
        if flag.is_file():
            raise Preempted(f"a second {signal.Signals(signum).name}: stopping now; {resume_hint(run)}")
        flag.write_text(json.dumps({"signal": signal.Signals(signum).name, "deadline": time.time() + grace,
                                    "pid": os.getpid()}))
        logger.info(f"[train] {signal.Signals(signum).name}: the workers finish their step and write a final "
                    f"checkpoint if it fits in checkpoint.preempt_grace_s={grace:g} s, then stop")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    request = read_preempt_request(run)
    if request is not None:
        flag.rmtree()
        raise Preempted(f"preempted ({request.get('signal', 'SIGTERM')}): {resume_hint(run)}")


def resume_hint(run: Loc) -> str:
    latest = latest_checkpoint(run)
    where = f"from {latest.name}, its newest intact checkpoint" if latest is not None else "from the start"
    return f"run the same command with --resume to continue {where}"


def auto_torch_config() -> Any:
    """Ray Train's TorchConfig whose backend the first worker chooses (collective.collective_backend): NCCL where
    torch sees the GPUs Ray gave it, gloo with one line saying why where it sees none. Ray's own choice is
    NCCL whenever GPUs are requested, whose process group a torch without CUDA cannot create."""
    # lazy: ray. The classes are local so that cloudpickle sends them by value: Ray's controller unpickles
    # them, and a class of this module would make it import the training stack
    from ray.train.torch import TorchConfig  # lazy: ray
    from ray.train.torch.config import _TorchBackend  # lazy: ray

    class AutoBackend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            use_gpu = worker_group.get_resources_per_worker().get("GPU", 0) > 0
            backend, note = worker_group.execute_single(0, collective_backend, use_gpu)
            if note:
                logger.info(f"[train] {note}")
            super().on_start(worker_group, dataclasses.replace(backend_config, backend=backend))

    @dataclasses.dataclass
    class AutoTorchConfig(TorchConfig):
        backend: str | None = "auto"

        @property
        def backend_cls(self) -> type:
            return AutoBackend

    return AutoTorchConfig()


@contextlib.contextmanager
def ray_training(cfg: StageConfig, resume: str | None, clock: StartupClock) -> Iterator[Any]:
    """The Ray side of a run around its `fit()`: Ray started and checked, the teacher deployed and stopped.

    It yields the `TorchTrainer`. A preemption raises `Preempted`; any other failure of the fit is a
    `TrainingError`, and a worker's input error is not retried (failures.py)."""
    from ray.train import ScalingConfig  # lazy: ray
    from ray.train.torch import TorchTrainer  # lazy: ray

    from hylo.pipeline.train.failures import final_input_errors  # lazy: ray

    with clock.timed("ray start"):
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
    check_cluster_resources(cfg)
    run = run_loc(cfg)
    note = reset_ray_snapshot(run)
    if note:
        logger.warning(note)
    stop_teacher = start_teacher(cfg)
    trainer = TorchTrainer(
        # the typed config travels with the function, which only the workers unpickle
        functools.partial(WORKER, stage_for(cfg.stage), cfg),
        # the worker group's start-up is timed from here to the first line a worker runs
        train_loop_config={**loop_config(cfg, resume, "ray"), "startup": StartupClock(clock.phases).to_dict()},
        scaling_config=ScalingConfig(num_workers=cfg.ray.num_workers, use_gpu=cfg.ray.use_gpu,
                                     resources_per_worker=worker_resources(cfg)),
        run_config=run_config(cfg, run),
        torch_config=auto_torch_config(),
    )
    try:
        with preemption_handler(cfg, run):
            try:
                # Ray's retries (ray.max_failures) are for faults, not for a bad value or a full disk
                with final_input_errors():
                    yield trainer
            except Preempted:
                raise
            except Exception as e:
                raise TrainingError(e) from e
    finally:
        if stop_teacher is not None:
            stop_teacher()


def fit_interruptibly(trainer: Any) -> Any:
    """`trainer.fit()` in a thread of its own. Run in the main thread, Ray Train installs a SIGINT handler that
    ends the driver on Ctrl-C with a bare exit status (1, or 0) and no word of why; here Ctrl-C stays Python's
    KeyboardInterrupt in the main thread: `job_main` prints one line and exits 130, after the run lock and the
    job's Ray are released (which stops the training actors). SIGTERM (preemption_handler) still runs in the
    main thread, which waits here."""
    box: dict[str, Any] = {}

    def fit() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            box["error"] = e

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in box:
        raise box["error"]
    return box["result"]


class TrainingError(RuntimeError):
    """Ray Train gave up; the message is the first failed worker's own error (the cause: Ray's exception)."""

    def __init__(self, e: BaseException) -> None:
        super().__init__(f"training failed: {failure_message(e)}")


def failure_message(e: BaseException) -> str:
    """`Type: message` of the first worker's exception inside Ray's error (whose text is a traceback)."""
    failures = getattr(e, "worker_failures", None)
    first = next(iter(failures.values())) if isinstance(failures, dict) and failures else e
    text = str(first)
    found = list(re.finditer(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt)): ", text, re.M))
    if found:
        return f"{found[-1].group(1)}: {text[found[-1].end():].strip()}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return f"{type(first).__name__}: {lines[-1] if lines else ''}"


def run(stage: int, argv: list[str] | None = None) -> dict[str, Any]:
    """One run of `stage`: the config, the checks, the lock, then the training; returns the run's summary.

    Under torchrun this rank trains here. Raises `Preempted` after a SIGTERM and `TrainingError` when Ray
    Train gave up."""
    clock = StartupClock(since=process_start_time())
    if is_job_process(stage):
        clock.lap("import")
    else:  # called inside a longer-lived process (a test, a notebook): its start is not this run's
        clock = StartupClock()
    args, cfg = stage_args(stage, argv)
    launcher = cfg.ray.launcher
    is_rank0 = int(os.environ.get("RANK", "0")) == 0
    if launcher == "torchrun" and "RANK" not in os.environ:
        raise ConfigError("ray.launcher=torchrun: start this job with `torchrun --nproc_per_node N ...`")
    if launcher == "torchrun" and int(os.environ["WORLD_SIZE"]) != cfg.ray.num_workers:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but ray.num_workers="
                          f"{cfg.ray.num_workers}; they must agree")
    try:
        check_storage_path(cfg.ray.storage_path, launcher)
    except StorageError as e:
        raise ConfigError(str(e)) from None
    # every path of the config made absolute once, against this directory: the workers run elsewhere
    cfg = resolve_paths(cfg)
    # every check that can refuse the run, before its directory is made (the lock makes it) or Ray starts
    owner = launch_id(launcher) if launcher == "torchrun" else None
    check_run(cfg, args.resume, launcher, is_rank0, args.break_lock, owner)
    # the run directory is this run's until it ends (runlock.py); under torchrun rank 0 holds it
    made = is_rank0 and run_loc(cfg).is_local and not run_loc(cfg).local().exists()
    lock = run_lock(run_loc(cfg), break_lock=args.break_lock, owner=owner) if is_rank0 else contextlib.nullcontext()
    training = False
    try:
        with exit_on_sigterm(), lock:
            cfg = prepare_run(stage, args, cfg, launcher, is_rank0)
            t0 = time.time()
            if launcher == "torchrun":
                from hylo.pipeline.train.loop import train_worker  # lazy: deepspeed

                clock.phases["ray start"] = 0.0
                training = True
                train_worker(stage_for(cfg.stage), cfg, {**loop_config(cfg, args.resume, launcher),
                                                         "startup": StartupClock(clock.phases).to_dict()})
                info: dict[str, Any] = {}
            else:
                with ray_training(cfg, args.resume, clock) as trainer:
                    training = True
                    result = fit_interruptibly(trainer)
                info = {"checkpoint": result.checkpoint.path if result.checkpoint else None}
            return finish_run(stage, cfg, is_rank0, time.time() - t0, info)
    finally:
        if made and not training:
            # stopped before its training began (Ray did not start, the cluster is too small, the teacher pool's
            # port is taken, Ctrl-C): the directory it made goes with it
            remove_unstarted_run_dir(run_loc(cfg).local(), stage)


@contextlib.contextmanager
def exit_on_sigterm():
    """SIGTERM (a scheduler stopping the job, torchrun stopping the other ranks) exits through Python,
    so that the run lock is released; a handler someone else installed (Ray's) is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is stop:  # not replaced meanwhile (ray.init installs its own)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def check_run(cfg: StageConfig, resume: str | None, launcher: str, is_rank0: bool, break_lock: bool = False,
              owner: str | None = None) -> None:
    """Every check that can refuse a run, before its directory is made or locked, Ray starts or anything is
    converted or compiled (a refused run leaves nothing behind), in this order: no other run holds the directory
    (its lock); the cluster the run joins answers (a stale RAY_ADDRESS or ray.address is named in seconds:
    ray_init.check_ray_address) and, with a local Ray, the teacher pool's port is free; the directory is no
    input and holds no checkpoint without --resume; the inputs (train/inputs.py); the outputs the run replaces;
    the student a resume loads. `--print-config` runs the same checks of the inputs (`check_inputs_for_print`)."""
    if is_rank0:
        check_unlocked(run_loc(cfg), break_lock, owner)
    if launcher == "ray":
        check_ray_address(cfg.ray.address)
        if cfg.stage == 2:
            # what the teacher source deploys listens on this machine when the run starts a local Ray
            source_kind(cfg.teacher.source).check_ports(cfg.teacher, local=resolve_address(cfg.ray.address) is None)
    if is_rank0:
        check_run_output(cfg)
    # a torchrun --max-restarts relaunch resumes from the newest intact checkpoint without --resume
    if launcher != "torchrun" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        check_run_dir(cfg, resume)
    if launcher == "torchrun" and cfg.stage == 1 and not cfg.model.student:
        raise ConfigError("ray.launcher=torchrun needs model.student: convert first (jobs/convert.py)")
    check_stage_inputs(cfg)
    if is_rank0:
        check_outputs(cfg)
        check_resume_fits(cfg, resume)


def remove_unstarted_run_dir(d: Path, stage: int) -> None:
    """Remove run directory `d`, made by a run that stopped before its training began, when it holds nothing but
    what that run wrote: its config, its ownership record, its lock, and empty folders. Anything else (stage 1's
    conversion, a file someone put there meanwhile) keeps the whole directory as it is."""
    ours = {f"config_stage{stage}.json", OUTPUT_RECORD, LOCK_FILE}
    try:
        files = [(root, name) for root, _, names in os.walk(d) for name in names]
        if any(root != str(d) or name not in ours or os.path.islink(os.path.join(root, name))
               for root, name in files):
            return
        for _, name in files:
            os.unlink(d / name)
        for root, _, _ in sorted(os.walk(d), key=lambda w: -len(w[0])):
            os.rmdir(root)
    except OSError:
        pass  # what is left stays: the next run's checks say what it is


def prepare_run(stage: int, args: argparse.Namespace, cfg: StageConfig, launcher: str,
                is_rank0: bool) -> StageConfig:
    """Under the run's lock, after `check_run`: the run directory checked again (another run may have written
    checkpoints before this one took the lock), the conversion stage 1 may need, and the config written beside
    the checkpoints. Returns the config to train."""
    resume = args.resume
    if launcher != "torchrun" or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        check_run_dir(cfg, resume)
    cfg = convert_if_needed(cfg)
    if is_rank0:
        check_resume_fits(cfg, resume)
    run_dir(cfg).mkdir(parents=True, exist_ok=True)
    if is_rank0:
        claim_run_dir(cfg)
        # what a checkpoint write killed half-way left (torchrun's .tmp-step_N): removed before any rank writes
        for name in sweep_scratch(run_loc(cfg)):
            logger.info(f"[train] removed {name}: a checkpoint write that never finished (a killed run)")
        (run_loc(cfg) / f"config_stage{stage}.json").write_text(json.dumps(config_to_dict(cfg), indent=1,
                                                                           sort_keys=True))
    return cfg


def finish_run(stage: int, cfg: StageConfig, is_rank0: bool, seconds: float, info: dict[str, Any]) -> dict[str, Any]:
    """After the training: checkpoint.delete_after_consolidate, then the run's summary (and its line)."""
    run = run_loc(cfg)
    model = run / "model"
    if is_rank0 and cfg.checkpoint.delete_after_consolidate:
        if (model / "hybrid_config.json").is_file():
            n, freed = delete_checkpoints(run)
            logger.info(f"[train] checkpoint.delete_after_consolidate: removed {n} checkpoint(s), "
                        f"{freed / 2**30:.2f} GiB; the run's output is {model}")
        else:
            logger.info(f"[train] checkpoint.delete_after_consolidate: kept the checkpoints, {model} "
                        "was not written (checkpoint.consolidate=false?)")
    metrics = read_metrics(run)
    summary = {"stage": stage, "run_dir": str(run), "model_dir": str(model), "seconds": seconds,
               "last_step": max(metrics) if metrics else 0, **info}
    if metrics and is_rank0:
        last = metrics[max(metrics)]
        logger.info(f"[train] stage {stage} done: step {summary['last_step']}, loss {last['loss']:.4f}, "
                    f"model {summary['model_dir']}")
    return summary


@dataclasses.dataclass
class ExitStatus:
    code: int = 0


@contextlib.contextmanager
def exit_status() -> Iterator[ExitStatus]:
    """How the stage jobs end (jobs/stage1.py, jobs/stage2.py, under `cli.job_main`):

        with driver.exit_status() as status:
            driver.run(2, argv)
        return status.code

    * 0: the run finished;
    * 143 (`PREEMPTED_EXIT`): SIGTERM stopped it; the last line names the checkpoint `--resume` continues from;
    * 2: bad input, also when a worker raised it (`job_main` prints one `error: ...` line);
    * 1: Ray Train gave up for another reason: one `error: training failed: <the first worker's error>` line.
    A bug in the driver itself keeps its traceback."""
    status = ExitStatus()
    try:
        yield status
    except Preempted as e:
        _stop_ray_logs()
        sys.stdout.flush()
        print(f"[train] {e}", file=sys.stderr, flush=True)
        status.code = PREEMPTED_EXIT
    except TrainingError as e:
        if input_error_message(e) is not None:
            raise  # job_main reports it: one line, exit status 2
        _stop_ray_logs()
        report_error(str(e))
        status.code = 1
