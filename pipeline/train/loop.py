"""The per-worker training loop shared by both stages, under Ray Train or torchrun.

Legend: W workers (ranks), G gradient-accumulation micro-steps per optimiser step (one packed row each).

    train_worker(stage, loop_config)   # each torchrun rank; under Ray Train, partial(train_worker, stage)
                                       # is the train_loop_per_worker

Design choices:
* The stage (`stage1.STAGE`, `stage2.STAGE`, a `worker.Stage`: build + THE step) is handed in by the
  driver; it owns model building and the step, and does not import this file. This file owns what
  both stages share: process group, seeding, data position, resume, metrics reduction, checkpoint
  cadence, fault injection (a hook) and the final consolidation.
* A `Session` hides the launcher: under Ray, checkpoints go through `ray.train.report(checkpoint=...)`
  (each worker hands its scratch directory; our upload function copies it into `<run>/step_N`, local
  or a URI, retrying a storage outage as `checkpoint.upload_retries` / `upload_backoff_s` say);
  under torchrun, ranks write `<run dir>/.tmp-step_N` and rank 0 renames it. Either way every rank
  lists size + sha256 of its files, and after a barrier rank 0 checks them and writes the manifest
  last (checkpoint.py). Both produce the same layout, so either resumes the other.
* Resume is collective: the candidates (the checkpoints this launch already wrote, newest first, so a
  group relaunched after a failure scans storage instead of trusting Ray's record, which lags behind
  the manifests; then the `--resume` choice) are checked by every rank (sizes; checksums shared out,
  or of each rank's own download for remote storage) and the newest intact one wins; every skipped
  one is printed with its reason. Then the metrics file is cut back to the resumed step.
* Rank 0 writes each step's metrics record itself, before reporting it; a checkpoint also holds the
  records of its steps since the previous one, and a resume puts back any of them the file lost (a
  torn last line, a stale local copy), so each finished step is in metrics.jsonl exactly once.
* Preemption, checked at every step boundary (`Session.preemption`, collective): SIGTERM to the driver
  (its handler writes `<run>/.preempt.json` with a deadline `checkpoint.preempt_grace_s` ahead) makes
  the workers write a final checkpoint when the last checkpoint took less than the time left, then
  stop; a Ray drain notice of one of the run's nodes (`ray.train.get_preemption_info`) makes them write
  one checkpoint and go on until the node is gone, when Ray Train restarts them from it.
* Loss normalisation: every step's loss is a mean over all loss tokens of the global batch. Each
  micro-batch contributes `sum / n_global * W` (DeepSpeed averages gradients over W ranks and we skip
  its 1/G scaling), so packed rows with different numbers of loss tokens weigh by their tokens.
* Fault injection (`fault.*`) is a hook on the worker context, called at named points ("mid_step" by
  the step, "after_checkpoint" here): it SIGKILLs one worker once (a marker file in the run directory
  makes it one-shot), for the recovery tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.ray_init import kill_this_node
from hylo.pipeline.train import checkpoint as ckpt_lib
from hylo.pipeline.train.config import FaultSection, StageConfig, config_from_dict
from hylo.pipeline.train.deepspeed_cfg import resolve_dtype
from hylo.pipeline.train.metrics import METRICS_FILE, TB_DIR, MetricsWriter, peak_memory_mib
from hylo.pipeline.train.row_sources import open_rows
from hylo.pipeline.train.storage import (
    Loc,
    fresh_local_dir,
    is_uri,
    local_copy,
    local_mirror,
    remove_local,
    run_loc,
    upload_with_retries,
)
from hylo.pipeline.train.worker import Stage, StepResult, WorkerContext

PARTITION_FILE = "zero_partition.json"


# ------------------------------------------------------------------------------------ fault injection
class FaultInjection:
    """A hook (`ctx.hooks`) that SIGKILLs this worker (or its Ray node) once, at the step, point and rank
    `fault.*` name."""

    def __init__(self, fault: FaultSection) -> None:
        self.fault = fault

    def __call__(self, point: str, ctx: WorkerContext) -> None:
        f = self.fault
        if f.kill_at_step != ctx.step or f.kill_when != point or f.kill_rank != ctx.rank:
            return
        # in the run's storage, so that it is one-shot whichever node the relaunched worker lands on
        marker = (ctx.run_loc or Loc.of(ctx.run_dir)) / f".fault-step{ctx.step}-{point}-rank{ctx.rank}"
        if marker.exists():
            return
        marker.write_text("killed\n")
        if f.kill_target == "node":
            print(f"[fault] rank {ctx.rank}: SIGKILL of its node at step {ctx.step} ({point})", flush=True)
            kill_this_node()
        print(f"[fault] rank {ctx.rank}: SIGKILL at step {ctx.step} ({point})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------------ preemption
PREEMPT_FILE = ".preempt.json"


def read_preempt_request(run: Loc) -> dict[str, Any] | None:
    """The driver's preemption request in the run's storage (written by its SIGTERM handler), or None."""
    loc = run / PREEMPT_FILE
    try:
        if not loc.is_file():
            return None
        request = json.loads(loc.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"[train] warning: {run / PREEMPT_FILE} is unreadable ({e}); taken as a preemption request", flush=True)
        return {}
    return request if isinstance(request, dict) else {}


# ------------------------------------------------------------------------------------ sessions
class Session:
    """Launcher-specific checkpoint storage and reporting; rank 0 also writes the metrics."""

    def __init__(self, ctx: WorkerContext, loop_config: dict[str, Any], total_steps: int) -> None:
        self.ctx = ctx
        self.resume_from: str | None = loop_config.get("resume_from")
        self.resume_latest = bool(loop_config.get("resume_latest"))
        # the driver invocation (Ray: one fit(); torchrun: one rendezvous), recorded in every manifest
        self.launch_id: str | None = loop_config.get("launch_id")
        self.run_loc: Loc = loop_config.get("run_loc") or run_loc(ctx.cfg)
        self._downloads: list[Path] = []
        self._drains_seen: set[str] = set()
        self.writer: MetricsWriter | None = None
        if ctx.rank == 0:
            m = ctx.cfg.metrics
            self.writer = MetricsWriter(ctx.run_dir, total_steps, m.log_every, m.tensorboard)

    # ---------------------------------------------------------------- resume
    def candidates(self) -> list[tuple[Loc, bool]]:
        """(checkpoint, whether a broken one may be skipped), to try newest first.

        First the checkpoints this launch wrote (after a worker failure, Ray or torchrun relaunched the
        group: the newest intact one in storage wins, whatever Ray registered), then the launch's own
        starting point: `--resume` walks the whole run, `--resume PATH` is exactly that one."""
        own = ckpt_lib.launch_checkpoints(self.run_loc, self.launch_id) if self.launch_id else []
        start: list[tuple[Loc, bool]] = []
        if self.resume_latest:
            start = [(c, True) for c in ckpt_lib.resume_candidates(self.run_loc)]
        elif self.resume_from:
            start = [(Loc.of(self.resume_from), False)]
        return [(c, True) for c in own] + [(c, skip) for c, skip in start if c not in own]

    def check(self, ckpt: Loc) -> tuple[Path | None, str | None]:
        """Collective: (local directory to load from, None) when every rank finds `ckpt` intact, else
        (None, reason). Local storage: every rank checks sizes, each hashes every W-th file; remote
        storage: every rank downloads the checkpoint and checks its own copy in full."""
        rank, world = self.ctx.rank, self.ctx.world_size
        local: Path | None = None
        try:
            problem = ckpt_lib.checkpoint_problem(ckpt)
            if problem is None and ckpt.is_local:
                local = ckpt.local()
                problem = ckpt_lib.checkpoint_problem(local, deep=True, only=lambda i: i % world == rank)
            elif problem is None:
                local = ckpt.download(fresh_local_dir(f"hylo-resume-{ckpt.name}-r{rank}-"))
                self._downloads.append(local)
                problem = ckpt_lib.checkpoint_problem(local, deep=True)
        except (OSError, ckpt_lib.CheckpointError) as e:
            problem = f"cannot be read ({type(e).__name__}: {e})"
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            return None, bad[0][1] + (f" (found by rank {bad[0][0]})" if world > 1 and bad[0][0] else "")
        return local, None

    def resume_checkpoint(self) -> tuple[Loc, Path] | None:
        """Collective: the checkpoint to resume from and its local directory, walking back past broken ones."""
        cands = self.candidates()
        skipped = []
        for c, walk in cands:
            local, problem = self.check(c)
            if problem is None:
                if skipped and self.ctx.rank == 0:
                    print(f"[resume] resuming from {c.name}, the newest intact checkpoint", flush=True)
                return c, local
            skipped.append(f"{c.name}: {problem}")
            if self.ctx.rank == 0:
                print(f"[resume] skipping {c.name}: {problem}", flush=True)
            if not walk:
                raise ckpt_lib.CheckpointError(f"--resume {c}: cannot resume from it: {problem}")
        if cands:
            raise ckpt_lib.CheckpointError(f"no intact checkpoint to resume from in {self.run_loc}:\n  "
                                           + "\n  ".join(skipped))
        return None

    # ---------------------------------------------------------------- preemption
    def drain_notice(self) -> dict[str, Any] | None:
        """Launcher-specific, collective: a notice that a node of this run is about to go (None: none)."""
        return None

    def preemption(self, ckpt_seconds: float | None) -> dict[str, Any] | None:
        """Collective, at a step boundary: None, or what to do about a preemption, the same on every
        rank: {"source", "final": write a checkpoint now, "stop": leave the loop, "why"}.

        The driver's SIGTERM handler writes `<run>/.preempt.json` (its deadline: now +
        `checkpoint.preempt_grace_s`): the workers write a final checkpoint when the last one took
        less than the time left, then stop. A drain notice of a node (Ray's preemption signal) asks
        for one checkpoint, once, and training goes on until the node is gone (Ray Train then
        restarts the workers from that checkpoint)."""
        drain = self.drain_notice()
        notice = None
        if self.ctx.rank == 0:
            request = read_preempt_request(self.run_loc)
            if request is not None:
                notice = {"source": f"preempted ({request.get('signal', 'SIGTERM')} to the driver)",
                          "deadline": request.get("deadline"), "stop": True}
            elif drain is not None and drain["key"] not in self._drains_seen:
                self._drains_seen.add(drain["key"])
                notice = {"source": drain["source"], "deadline": drain["deadline"], "stop": False}
            if notice is not None:
                left = None if notice["deadline"] is None else notice["deadline"] - time.time()
                notice["final"] = left is None or ckpt_seconds is None or ckpt_seconds <= left
                notice["why"] = ("" if notice["final"] else
                                 f"no time for a final checkpoint ({max(0.0, left):.0f} s left, the last one "
                                 f"took {ckpt_seconds:.0f} s); the newest intact checkpoint is resumed from")
        box = [notice]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---------------------------------------------------------------- checkpoints + metrics
    def scratch_dir(self, step: int) -> Path:
        raise NotImplementedError

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None, metrics: bool = True) -> None:
        """Report step's record (written to the metrics file unless `metrics` is false: a second
        report of the same step) and, with `ckpt_dir`, its checkpoint."""
        raise NotImplementedError

    def write_metrics(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def after_checkpoint(self) -> None:
        """Rank 0, once a checkpoint is final: prune old ones; for remote storage upload the metrics."""
        removed = ckpt_lib.prune(self.run_loc, self.ctx.cfg.checkpoint.keep)
        if removed:
            print(f"[train] checkpoint.keep={self.ctx.cfg.checkpoint.keep}: removed {', '.join(removed)}", flush=True)
        self.sync_outputs()

    def sync_outputs(self) -> None:
        """Remote storage, rank 0: upload what is written locally first (metrics, TensorBoard, partition report)."""
        if self.run_loc.is_local or self.ctx.rank != 0:
            return
        if self.writer is not None:
            self.writer.flush()
        local = self.ctx.run_dir
        for name in (METRICS_FILE, PARTITION_FILE):
            if (local / name).is_file():
                (self.run_loc / name).write_bytes((local / name).read_bytes())
        if (local / TB_DIR).is_dir():
            (self.run_loc / TB_DIR).upload_dir(local / TB_DIR)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.sync_outputs()
        for d in self._downloads:
            remove_local(d)


class RaySession(Session):
    def upload_files(self, checkpoint, dir_name: str):
        """Ray Train's `checkpoint_upload_fn`: this worker's files into `<run>/<dir_name>`, where Ray's
        own copy would put them, retried as `checkpoint.upload_*` say (storage.upload_with_retries)."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        dest = storage.build_checkpoint_path_from_name(dir_name)
        c = self.ctx.cfg.checkpoint
        upload_with_retries(Path(checkpoint.path), Loc(storage.storage_filesystem, dest, self.run_loc.scheme),
                            c.upload_retries, c.upload_backoff_s, f"rank {self.ctx.rank}: ")
        return ray.train.Checkpoint(path=dest, filesystem=storage.storage_filesystem)

    def drain_notice(self) -> dict[str, Any] | None:
        import ray.train

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
        return {"key": ",".join(info.preempted_node_ids),
                "source": f"Ray drains node(s) {nodes} of rank(s) {info.preempted_ranks} (preemption)",
                "deadline": info.deadline_ms / 1000 if info.deadline_ms else None}

    def scratch_dir(self, step: int) -> Path:
        return fresh_local_dir(f"hylo-ckpt-{step}-r{self.ctx.rank}-")

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None, metrics: bool = True) -> None:
        import ray.train

        if metrics:
            self.write_metrics(record)
        if ckpt_dir is None:
            ray.train.report(record)
            return
        ckpt_lib.write_rank_files(ckpt_dir, self.ctx.rank, self.ctx.world_size, shared=False)
        target = self.run_loc / ckpt_lib.step_dir_name(step)
        if self.ctx.rank == 0 and target.exists():
            # left by an abandoned attempt (a crash, or a resume from an older checkpoint): Ray would
            # merge the new files into it
            target.rmtree()
        dist.barrier()
        self.upload(record, ckpt_dir, target, step)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        # every worker has uploaded its files: rank 0 checks them and writes the manifest
        dist.barrier()
        if self.ctx.rank == 0:
            try:
                ckpt_lib.finalize_checkpoint(target, step, self.ctx.world_size, self.launch_id)
            except OSError as e:
                if not ckpt_lib.is_disk_full(e):
                    raise
                raise ckpt_lib.upload_error(target, None, e, step, 0, file=ckpt_lib.MANIFEST) from e
            self.after_checkpoint()


    def upload(self, record: dict[str, Any], ckpt_dir: Path, target: Loc, step: int) -> None:
        """Ray Train reports the checkpoint and copies this rank's scratch directory into `target` with
        `upload_files`; a full storage is reported with the checkpoint, the file and the space left
        (Ray's own error says only "No space left on device")."""
        import ray.train

        try:
            ray.train.report(record, checkpoint=ray.train.Checkpoint.from_directory(str(ckpt_dir)),
                             checkpoint_dir_name=target.name, checkpoint_upload_fn=self.upload_files)
        except Exception as e:
            if not ckpt_lib.is_disk_full(e):
                raise
            raise ckpt_lib.upload_error(target, ckpt_dir, e, step, self.ctx.rank) from e


class TorchrunSession(Session):
    def scratch_dir(self, step: int) -> Path:
        tmp = self.run_loc.local() / f".tmp-{ckpt_lib.step_dir_name(step)}"
        if self.ctx.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        return tmp

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None, metrics: bool = True) -> None:
        if metrics:
            self.write_metrics(record)
        if ckpt_dir is None:
            return
        dist.barrier()
        ckpt_lib.write_rank_files(ckpt_dir, self.ctx.rank, self.ctx.world_size, shared=True)
        dist.barrier()
        if self.ctx.rank == 0:
            ckpt_lib.finalize_local(ckpt_dir, self.run_loc.local() / ckpt_lib.step_dir_name(step), step,
                                    self.ctx.world_size, self.launch_id)
            self.after_checkpoint()
        dist.barrier()

    def close(self) -> None:
        super().close()
        # Leave together and tear the process group down explicitly: a rank that exits while another is
        # still writing the consolidated model destroys gloo's threads at interpreter exit, which aborts
        # ("terminate called without an active exception", SIGABRT) and fails the whole torchrun job.
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------ helpers
def set_aside_other_lines(session: Session, ckpt: Loc, step: int) -> None:
    """Rank 0, after resuming from `ckpt` at `step`: the run's checkpoints after it (a resume from an older
    step) belong to the line of checkpoints this run leaves; they are moved aside, once, with a copy of the
    metrics file as it was (checkpoint.set_aside_other_lines), and never pruned or resumed from."""
    moved = ckpt_lib.set_aside_other_lines(session.run_loc, ckpt, step, copies=(METRICS_FILE,))
    if moved is not None:
        folder, names = moved
        print(f"[resume] resuming from {ckpt.name} starts a new line of checkpoints: the run's other "
              f"checkpoints ({', '.join(names)}) and a copy of {METRICS_FILE} as it was are set aside in "
              f"{folder}; they are kept, never pruned or resumed from (delete that folder once you do not "
              f"need it)", flush=True)


def total_steps_for(cfg: StageConfig, rows_in_split: int) -> int:
    if cfg.train.total_steps:
        return cfg.train.total_steps
    return max(1, math.floor(rows_in_split * cfg.train.epochs / cfg.train.global_batch_sequences))


def cosine_with_warmup(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """LR multiplier for the optimiser step that follows `s` completed steps."""
    warmup = max(1, math.ceil(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def zero_partition_report(engine, ctx: WorkerContext) -> dict[str, Any]:
    """How much of the model each rank holds (ZeRO-3: ~1/W of every parameter)."""
    module = engine.module
    total = held = 0
    seen: set[int] = set()
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if hasattr(p, "ds_tensor"):
            total += p.ds_numel
            held += p.ds_tensor.numel()
        else:
            total += p.numel()
            held += p.numel()
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, {"rank": ctx.rank, "held": held, "total": total})
    report = {"world_size": ctx.world_size, "zero_stage": ctx.cfg.deepspeed.zero_stage, "ranks": per_rank,
              "fractions": [r["held"] / max(1, r["total"]) for r in per_rank]}
    print(f"[zero] rank {ctx.rank}: holds {held:,} of {total:,} parameters "
          f"({100.0 * held / max(1, total):.1f}%, 1/W = {100.0 / ctx.world_size:.1f}%)", flush=True)
    if ctx.rank == 0:
        ckpt_lib.write_json_atomic(ctx.run_dir / PARTITION_FILE, report)
    return report


def setup_distributed(cfg: StageConfig) -> tuple[int, int, torch.device]:
    import deepspeed

    use_gpu = cfg.ray.use_gpu and torch.cuda.is_available()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_gpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return rank, world, device


def watch_stale_build_locks(stop: threading.Event, max_age_s: float = 300.0, poll_s: float = 10.0) -> None:
    """Remove torch JIT-extension build locks older than `max_age_s` until `stop` is set.

    Every load of DeepSpeed's shm_comm op takes `<TORCH_EXTENSIONS_DIR>/<op>/lock` while ninja checks the
    build; a process killed in that window (OOM killer, SIGKILL) leaves the lock behind and every later
    load waits on it forever. A build takes ~45 s here, so a lock minutes old has no live owner.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return
    while not stop.wait(poll_s):
        for lock in Path(root).glob("*/lock"):
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                continue
            if age > max_age_s:
                print(f"[train] removing stale build lock {lock} ({age:.0f} s old; its owner died)", flush=True)
                lock.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ the loop
def train_worker(stage: Stage, loop_config: dict[str, Any]) -> None:
    """Train `stage` on this worker; all workers run this in lockstep."""
    if loop_config.get("torch_extensions_dir"):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", loop_config["torch_extensions_dir"])
    cfg = config_from_dict(loop_config["config"])
    if stage.number != cfg.stage:
        raise ValueError(f"train_worker got stage {stage.number} with a stage-{cfg.stage} config")
    if cfg.model.student and is_uri(cfg.model.student):
        # a student that lives in the run storage (stage 1's output at a URI): a local copy to load
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, student=str(local_copy(cfg.model.student))))

    # DeepSpeed loads its compiled ops during setup; guard against a lock left by a killed process.
    stop_watch = threading.Event()
    threading.Thread(target=watch_stale_build_locks, args=(stop_watch,), daemon=True).start()
    rank, world, device = setup_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    run: Loc = loop_config.get("run_loc") or run_loc(cfg)
    ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=device,
                        dtype=resolve_dtype(cfg.model.dtype, device.type == "cuda"),
                        run_dir=local_mirror(run), run_loc=run,
                        grad_accum=cfg.grad_accum,
                        hooks=[FaultInjection(cfg.fault)])
    rows: RowReader = open_rows(cfg.data, cfg.train.seed, rank, world)
    total = total_steps_for(cfg, rows.global_rows)
    last = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    session: Session = (RaySession(ctx, loop_config, total) if loop_config["launcher"] == "ray"
                        else TorchrunSession(ctx, loop_config, total))

    task = stage.build(ctx, cosine_with_warmup(total, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio))
    stop_watch.set()
    zero_partition_report(task.engine, ctx)

    start = 0
    saved_records: list[dict[str, Any]] = []
    resume = session.resume_checkpoint()
    if resume is not None:
        ckpt, local = resume
        state = ckpt_lib.check_compatible(local, cfg, world, rows.fingerprint)
        saved_records = checkpoint_records(state)
        rank_state = ckpt_lib.load_checkpoint(task.engine, local, rank)
        rows.seek(rank_state["data"]["position"])
        start = int(rank_state["step"])
        if rank == 0:
            print(f"[train] resumed from {ckpt} at step {start}", flush=True)
            set_aside_other_lines(session, ckpt, start)
    if session.writer is not None:
        # the metrics file continues from the resumed step: later records (and a torn last line) go
        # (the records the checkpoint holds come back when the file lost them: a torn last line, a
        # relaunch on a node whose local copy is older than the checkpoint)
        remote = None if session.run_loc.is_local else session.run_loc / METRICS_FILE
        session.writer.restart_at(start, remote, restore=saved_records)

    since_checkpoint: list[dict[str, Any]] = []

    def checkpoint(step: int, record: dict[str, Any], metrics: bool = True) -> float:
        """Collective: save and report step's checkpoint; returns how long that took (the slowest rank)."""
        t_ckpt = time.perf_counter()
        ckpt_dir = session.scratch_dir(step)
        # the checkpoint holds the records of its steps since the previous one: a resume rebuilds
        # any of them metrics.jsonl lost, so every finished step is in the file exactly once
        ckpt_lib.save_checkpoint(task.engine, ckpt_dir, rank, world, step, cfg,
                                 {"data": rows.state()}, {"metrics": record, "metrics_since_previous":
                                  list(since_checkpoint), "total_steps": total,
                                  "data_fingerprint": rows.fingerprint})
        since_checkpoint.clear()
        session.report(record, step, ckpt_dir, metrics=metrics)
        return ctx.all_max([time.perf_counter() - t_ckpt])[0]

    ckpt_seconds: float | None = None
    for step in range(start + 1, last + 1):
        ctx.step = step
        t0 = time.perf_counter()
        batch = [rows.next_row() for _ in range(ctx.grad_accum)]
        result = stage.train_step(task, batch, ctx)
        record = reduce_record(ctx, result, batch, rows, time.perf_counter() - t0, total)
        record["resumed_from"] = start
        since_checkpoint.append(record)
        save = step % cfg.checkpoint.every_steps == 0 or step == last
        if save:
            ckpt_seconds = checkpoint(step, record)
            ctx.hook("after_checkpoint")
        else:
            session.report(record, step, None)
        if step == last:
            break
        notice = session.preemption(ckpt_seconds)
        if notice is None:
            continue
        if notice["final"] and not save:
            ckpt_seconds = checkpoint(step, record, metrics=False)
        if rank == 0:
            print(f"[train] {notice['source']}: " + (f"final checkpoint {ckpt_lib.step_dir_name(step)} written"
                  if notice["final"] else notice["why"]), flush=True)
        if notice["stop"]:
            session.close()
            return

    if cfg.checkpoint.consolidate:
        consolidate(task, ctx, session.run_loc, cfg.model.student)
    session.close()


def checkpoint_records(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The metrics records a checkpoint's trainer state holds (its steps since the previous checkpoint;
    older checkpoints hold only their own step's record)."""
    records = state.get("metrics_since_previous") or []
    if not records and isinstance(state.get("metrics"), dict):
        records = [state["metrics"]]
    return [r for r in records if isinstance(r, dict) and "step" in r]


def consolidate(task, ctx: WorkerContext, run: Loc, source: str | None) -> None:
    """Collective: the trained model as an HF-format HyLo checkpoint in `<run>/model` (uploaded when
    the run lives at a URI)."""
    out = ctx.run_dir / "model" if run.is_local else fresh_local_dir("hylo-model-") / "model"
    written = ckpt_lib.consolidate_hylo(task.student, out, ctx.rank, tokenizer_from=source)
    if written is None:
        return
    if not run.is_local:
        # hybrid_config.json last: it is what makes a directory a HyLo checkpoint (load_hylo checks it),
        # so a reader never takes a half-uploaded model for a whole one
        target, marker = run / "model", written / "hybrid_config.json"
        data = marker.read_bytes()
        marker.unlink()
        target.rmtree()
        target.upload_dir(written)
        (target / marker.name).write_bytes(data)
        remove_local(written.parent)
        written = target
    print(f"[train] consolidated HF checkpoint: {written}", flush=True)


def reduce_record(ctx: WorkerContext, result: StepResult, batch: list[PackedRow], rows: RowReader,
                  seconds: float, total: int) -> dict[str, Any]:
    """One record per step, identical on every rank: global sums / maxima of the local numbers."""
    keys = sorted(result.sums)
    sums = dict(zip(keys, ctx.all_sum([float(result.sums[k]) for k in keys])))
    mem, sec = ctx.all_max([peak_memory_mib(ctx.device), seconds])
    row_ids: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(row_ids, [r.key for r in batch])
    positions: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(positions, rows.position)
    # A step whose rows hold no loss token (e.g. windows of a split user turn) reports loss 0.
    loss_tokens = sums.pop("loss_tokens")
    n_loss = max(1.0, loss_tokens)
    tokens = sums.pop("tokens")
    record: dict[str, Any] = {
        "step": ctx.step, "stage": ctx.cfg.stage, "total_steps": total,
        "loss": sums.pop("loss_sum") / n_loss,
        "lr": result.lr, "grad_norm": result.grad_norm,
        "tokens": int(tokens), "loss_tokens": int(loss_tokens),
        "tokens_per_s": tokens / max(sec, 1e-9), "step_time_s": sec,
        "mem_peak_mib": mem, "rows": row_ids, "data_position": positions,
    }
    for k, v in sums.items():
        record[k.removesuffix("_sum")] = v / n_loss
    return record
