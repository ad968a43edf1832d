"""The per-worker training loop and THE step, shared by both stages, under Ray Train or torchrun.

Legend: W workers (ranks), G micro-batches (one packed row each) per optimiser step on a rank, N ranks of a
sequence-parallel group.

    train_worker(stage, cfg, loop_config)   # each torchrun rank; under Ray Train, driver.WORKER
      stage.train_step(task, rows)          # = train_step below: the stage's task supplies its inputs and losses

Design choices:
* The driver hands in the stage (`stage1.STAGE`, `stage2.STAGE`). It builds the model and supplies what its
  step differs in: module inputs, loss terms, counted tokens (`worker.Task`). The rest is here.
* The launcher (Ray Train or torchrun) is hidden behind a `session.Session`: checkpoint places, the
  collective resume check, metrics reporting and preemption notices.
* Rank 0 writes each step's metrics record before reporting it. A checkpoint also holds the records since
  the previous one, so a resume restores what the file lost: each finished step is in metrics.jsonl once.
* Preemption is checked at every step boundary (collective). A driver's SIGTERM gives a final checkpoint
  when it fits, then a stop; a Ray drain notice gives one checkpoint, then the run goes on.
* A non-finite loss or gradient norm stops every rank at the same step (after `train.nonfinite_patience`
  of them in a row). Nothing is saved from a non-finite state (nonfinite.py).
* Sequence parallelism (`train.sequence_parallel` = N): groups of N consecutive ranks read the same rows,
  and each row is split once, here (`row_part`). The data position is kept in global rows, so N may
  change on resume.
* Fault injection (`fault.*`) is a hook on the worker context, called at "mid_step" and
  "after_checkpoint": it SIGKILLs one worker once, for the recovery tests.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hylo import logs
from hylo.kernels.backend import check_fla_backward, keep_freed_host_memory
from hylo.kernels.fused_kl.inputs import check_deferred
from hylo.logs import get_logger
from hylo.modeling import linear_layer_kinds
from hylo.pipeline.data.reader import RowReader
from hylo.pipeline.data.rows import PackedRow
from hylo.pipeline.ray_init import kill_this_node
from hylo.pipeline.train.checkpoint.consolidate import consolidate_hylo
from hylo.pipeline.train.checkpoint.deepspeed_io import load_checkpoint, save_checkpoint
from hylo.pipeline.train.checkpoint.layout import step_dir_name, write_json_atomic
from hylo.pipeline.train.checkpoint.resume import check_compatible
from hylo.pipeline.train.collective import collective_backend
from hylo.pipeline.train.compile import apply_compile
from hylo.pipeline.train.config import FaultSection, StageConfig
from hylo.pipeline.train.deepspeed_cfg import current_lr, import_deepspeed, resolve_dtype
from hylo.pipeline.train.metrics import METRICS_FILE, peak_memory_mib
from hylo.pipeline.train.nonfinite import (
    CHECKED,
    NonFiniteError,
    NonFiniteGuard,
    nonfinite_keys,
    own_elements,
    saved_hint,
    weights_finite,
)
from hylo.pipeline.train.row_sources import open_rows, resume_position
from hylo.pipeline.train.session import PARTITION_FILE, RaySession, Session, TorchrunSession
from hylo.pipeline.train.startup import STARTUP_FILE, StartupClock
from hylo.pipeline.train.storage import (
    Loc,
    fresh_local_dir,
    is_uri,
    local_copy,
    local_mirror,
    remove_local,
    run_loc,
)
from hylo.pipeline.train.worker import (
    RowPart,
    Stage,
    StepResult,
    Task,
    WorkerContext,
    row_to_device,
    sequence_parallel_group,
)
from hylo.seq_parallel import shard_row

logger = get_logger(__name__)


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
            logger.warning(f"[fault] rank {ctx.rank}: SIGKILL of its node at step {ctx.step} ({point})")
            kill_this_node()
        logger.warning(f"[fault] rank {ctx.rank}: SIGKILL at step {ctx.step} ({point})")
        os.kill(os.getpid(), signal.SIGKILL)


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
            held += own_elements(p).numel()
        else:
            total += p.numel()
            held += p.numel()
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, {"rank": ctx.rank, "held": held, "total": total})
    report = {"world_size": ctx.world_size, "zero_stage": ctx.cfg.deepspeed.zero_stage, "ranks": per_rank,
              "fractions": [r["held"] / max(1, r["total"]) for r in per_rank]}
    logger.info(f"[zero] rank {ctx.rank}: holds {held:,} of {total:,} parameters "
                f"({100.0 * held / max(1, total):.1f}%, 1/W = {100.0 / ctx.world_size:.1f}%)")
    if ctx.rank == 0:
        write_json_atomic(ctx.run_dir / PARTITION_FILE, report)
    return report


def setup_distributed(cfg: StageConfig) -> tuple[int, int, torch.device]:
    deepspeed = import_deepspeed()
    backend, note = collective_backend(cfg.ray.use_gpu)
    use_gpu = backend == "nccl"
    if not dist.is_initialized():
        if note and int(os.environ.get("RANK", "0")) == 0:
            # under torchrun (under Ray Train the driver's backend said it already)
            logger.info(f"[train] {note}")
        deepspeed.init_distributed(dist_backend=backend)
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

    Every load of a DeepSpeed op compiled on first use takes `<TORCH_EXTENSIONS_DIR>/<op>/lock` while ninja
    checks the build; a process killed in that window (OOM killer, SIGKILL) leaves the lock behind and every later
    load waits on it forever. A build takes ~45 s here, so a lock minutes old has no live owner. (Training builds
    none of DeepSpeed's ops on CPU since `deepspeed_cfg.import_deepspeed`; the guard stays for any that loads.)
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
                logger.warning(f"[train] removing stale build lock {lock} ({age:.0f} s old; its owner died)")
                lock.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ the loop
def train_worker(stage: Stage, cfg: StageConfig, loop_config: dict[str, Any]) -> None:
    """Train `stage` with `cfg` on this worker; all workers run this in lockstep. `loop_config` is the launch:
    where the run lives and resumes from (driver.loop_config)."""
    clock = StartupClock.from_dict(loop_config.get("startup"))
    clock.lap("worker group")
    logs.setup()  # a Ray Train worker: the job's level (HYLO_LOG_LEVEL), its rank on every line
    if loop_config.get("torch_extensions_dir"):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", loop_config["torch_extensions_dir"])
    # the kernel cache (Ray workers have it from their runtime env already; torchrun ranks get it here)
    for k, v in (loop_config.get("kernel_cache_env") or {}).items():
        os.environ.setdefault(k, v)
    if stage.number != cfg.stage:
        raise ValueError(f"train_worker got stage {stage.number} with a stage-{cfg.stage} config")
    if cfg.model.student and is_uri(cfg.model.student):
        # a student that lives in the run storage (stage 1's output at a URI): a local copy to load
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, student=str(local_copy(cfg.model.student))))

    # DeepSpeed loads its compiled ops during setup; guard against a lock left by a killed process.
    stop_watch = threading.Event()
    threading.Thread(target=watch_stale_build_locks, args=(stop_watch,), daemon=True).start()
    with clock.timed("process group"):
        rank, world, device = setup_distributed(cfg)
    if device.type == "cpu":
        keep_freed_host_memory()  # CPU steps reuse freed host memory, as CUDA's caching allocator does
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    run: Loc = loop_config.get("run_loc") or run_loc(cfg)
    sequence_parallel = cfg.train.sequence_parallel
    sp_group, sp_rank = sequence_parallel_group(rank, world, sequence_parallel)
    ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=device,
                        dtype=resolve_dtype(cfg.model.dtype, device.type == "cuda"),
                        run_dir=local_mirror(run), run_loc=run,
                        grad_accum=cfg.grad_accum,
                        hooks=[FaultInjection(cfg.fault)],
                        sp_group=sp_group, sp_rank=sp_rank, sequence_parallel=sequence_parallel, startup=clock)
    N = sequence_parallel
    if sequence_parallel > 1 and rank == 0:
        logger.info(f"[train] sequence parallelism: each row split over {N} workers (ranks "
                    f"[g*{N}, (g+1)*{N}) form group g), {cfg.data_parallel} group(s), {ctx.grad_accum} "
                    "row(s) per worker per step")
    # the workers of a sequence-parallel group read the same rows: the reader strides over the groups
    rows: RowReader = open_rows(cfg.data, cfg.train.seed, rank // N, cfg.data_parallel, workers=world)
    total = total_steps_for(cfg, rows.global_rows)
    last = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    session: Session = (RaySession(ctx, loop_config, total) if loop_config["launcher"] == "ray"
                        else TorchrunSession(ctx, loop_config, total))

    with clock.timed("model load"):
        task = stage.build(ctx, cosine_with_warmup(total, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio))
    stop_watch.set()
    check_fla_backward(device, linear_layer_kinds(task.engine.module))
    # train.compile: the student's decoder blocks through torch.compile (compile.py); "off" leaves it eager
    apply_compile(task.student, cfg.train.compile)
    zero_partition_report(task.engine, ctx)

    start = 0
    saved_records: list[dict[str, Any]] = []
    resume = session.resume_checkpoint()
    if resume is not None:
        ckpt, local = resume
        state = check_compatible(local, cfg, world, rows.fingerprint)
        saved_records = checkpoint_records(state)
        rank_state = load_checkpoint(task.engine, local, rank)
        # the position in global rows, so a run saved at another train.sequence_parallel continues exactly
        rows.seek(resume_position(rank_state["data"], cfg.data_parallel))
        start = int(rank_state["step"])
        if rank == 0:
            logger.info(f"[train] resumed from {ckpt} at step {start}")
            session.start_new_line(ckpt, start)
    if session.writer is not None:
        # metrics.jsonl continues from the resumed step (0: a fresh run): records of later steps and torn
        # lines are dropped; the records the checkpoint holds are put back where the file lost them (a
        # torn last line; a relaunch on a node whose local copy is older than the checkpoint); for remote
        # storage the run's uploaded copy is the one read
        remote = None if session.run_loc.is_local else session.run_loc / METRICS_FILE
        session.writer.restart_at(start, remote, restore=saved_records)

    since_checkpoint: list[dict[str, Any]] = []
    # a non-finite loss or gradient norm stops the run (after train.nonfinite_patience of them in a row);
    # nothing is saved from a non-finite state (nonfinite.py)
    guard = NonFiniteGuard(cfg.train.nonfinite_patience)
    newest: list[str | None] = [resume[0].name if resume is not None else None]

    def stop(record: dict[str, Any], message: str, metrics: bool = True) -> None:
        """Collective: the step's record, saying why, to the metrics; then every rank stops with `message`."""
        if metrics:
            session.report(record, record["step"], None)
        session.close()
        raise NonFiniteError(message)

    def checkpoint(step: int, record: dict[str, Any], metrics: bool = True) -> float:
        """Collective: save and report step's checkpoint; returns how long that took (the slowest rank)."""
        t_ckpt = time.perf_counter()
        if not weights_finite(task.engine.module, ctx):
            record.update(nonfinite=["weights"], stopped="nonfinite_weights", stopped_value=None)
            stop(record, f"step {step}: the weights after it are not finite (NaN or inf), though its loss and "
                 f"gradient norm were: training stopped before writing {step_dir_name(step)}; "
                 + saved_hint(newest[0]), metrics)
        ckpt_dir = session.scratch_dir(step)
        try:
            # the checkpoint holds the records of its steps since the previous one: a resume rebuilds
            # any of them metrics.jsonl lost, so every finished step is in the file exactly once
            save_checkpoint(task.engine, ckpt_dir, rank, world, step, cfg,
                            {"data": rows.state()}, {"metrics": record, "metrics_since_previous":
                             list(since_checkpoint), "total_steps": total,
                             "data_fingerprint": rows.fingerprint})
            session.report(record, step, ckpt_dir, metrics=metrics)
        except BaseException:
            # a failed write (a full disk, a failed upload, a stop) leaves nothing of this checkpoint behind
            session.discard(step, ckpt_dir)
            raise
        since_checkpoint.clear()
        newest[0] = step_dir_name(step)
        return ctx.all_max([time.perf_counter() - t_ckpt])[0]

    ckpt_seconds: float | None = None
    for step in range(start + 1, last + 1):
        ctx.step = step
        t0 = time.perf_counter()
        batch = [rows.next_row() for _ in range(ctx.grad_accum)]
        result = stage.train_step(task, batch, ctx)
        record = reduce_record(ctx, result, batch, rows, time.perf_counter() - t0, total)
        if step == start + 1:
            clock.lap("first step")
            report_startup(clock, ctx)
        record["resumed_from"] = start
        verdict = guard.observe(record, last=step == last)
        if verdict == "stop":
            stop(record, guard.stop_message(record, newest[0]))
        due = step % cfg.checkpoint.every_steps == 0 or step == last
        if verdict == "tolerate" and rank == 0:
            logger.warning(f"[train] warning: {guard.describe(record)}; tolerated ({guard.streak} in a row, "
                           f"train.nonfinite_patience={guard.patience})"
                           + (f"; {step_dir_name(step)} is not written" if due else ""))
        since_checkpoint.append(record)
        save = due and verdict == "ok"
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
        # no final checkpoint from a non-finite state (a tolerated step): the newest one is resumed from
        final = notice["final"] and verdict == "ok"
        if final and not save:
            ckpt_seconds = checkpoint(step, record, metrics=False)
        if rank == 0:
            why = notice["why"] if not notice["final"] else (
                f"no final checkpoint: step {step} was not finite; the newest intact checkpoint is resumed from")
            logger.info(f"[train] {notice['source']}: " + (f"final checkpoint {step_dir_name(step)} written"
                        if final else why))
        if notice["stop"]:
            session.close()
            return

    if cfg.checkpoint.consolidate:
        consolidate(task, ctx, session.run_loc, cfg.model.student)
    session.close()


# ------------------------------------------------------------------------------------ the step
def train_step(task: Task, rows: list[PackedRow], ctx: WorkerContext) -> StepResult:
    """One optimiser step over this rank's rows, one micro-batch each: the task's module -> its weighted loss
    terms -> backward; the returned sums are this rank's (`reduce_record` reduces them)."""
    engine = task.engine
    parts = [row_part(row, ctx) for row in rows]
    counted = [task.counted(part) for part in parts]
    # Normalisation: the step's loss is the mean over the counted tokens of the GLOBAL batch (every rank's
    # rows; at sequence parallelism each rank counts its own part, so every row counts once). Each
    # micro-batch backpropagates its loss sum times W / n_global with DeepSpeed's 1/G scaling off, and
    # DeepSpeed averages the gradients over the W ranks. So a row weighs by its tokens, whatever G, W and
    # the rows' lengths.
    n_global = ctx.all_sum([float(sum(counted))])[0]
    scale = ctx.world_size / max(n_global, 1.0)
    lr = current_lr(engine)
    names, weights = zip(*task.terms().items())
    # the loss terms stay on the device until the step's end: one host read per step, not one per row
    sums = []
    for i, inputs in enumerate(task.inputs(parts, ctx)):
        terms = engine(*inputs)
        loss = weights[0] * terms[0]
        for w, t in zip(weights[1:], terms[1:]):
            loss = loss + w * t
        engine.backward(loss * scale, scale_wrt_gas=False)
        if i == 0:
            ctx.hook("mid_step")
        engine.step()
        sums.append(torch.stack([loss.detach(), *(t.detach() for t in terms)]).double())
    # input checks of the fused KL left device flags (kernels/fused_kl/inputs.py): read them with the sums
    check_deferred()
    out = dict(zip(("loss_sum", *(f"{n}_sum" for n in names)), torch.stack(sums).sum(0).tolist()))
    out["loss_tokens"] = float(sum(counted))
    out["tokens"] = float(sum(p.end - p.start for p in parts))
    return StepResult(out, lr, float(engine.get_global_grad_norm() or 0.0))


def row_part(row: PackedRow, ctx: WorkerContext) -> RowPart:
    """This rank's part of a packed row on the step's device: the whole row, or at sequence parallelism the
    sp_rank-th of N equal slices, keeping the unsplit row's boundaries and positions (`shard_row`)."""
    d = row_to_device(row, ctx.device)
    bounds = d.bounds()
    if ctx.sequence_parallel == 1:
        return RowPart(row, d, 0, row.num_tokens, bounds)
    shard = shard_row(bounds, ctx.sp_rank, ctx.sequence_parallel, ctx.sp_group,
                      teacher=ctx.cfg.train.sequence_parallel_teacher)
    return RowPart(row, d, shard.start, shard.end, shard.local, shard)


def report_startup(clock: StartupClock, ctx: WorkerContext) -> None:
    """Rank 0: where this run's start-up went (startup.py), one line and the run directory's startup.json."""
    if ctx.rank == 0:
        logger.info(clock.line())
        write_json_atomic(ctx.run_dir / STARTUP_FILE, {"phases": clock.phases, "stage": ctx.cfg.stage,
                                                       "world_size": ctx.world_size})


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
    written = consolidate_hylo(task.student, out, ctx.rank, tokenizer_from=source)
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
    logger.info(f"[train] consolidated HF checkpoint: {written}")


def reduce_record(ctx: WorkerContext, result: StepResult, batch: list[PackedRow], rows: RowReader,
                  seconds: float, total: int) -> dict[str, Any]:
    """One record per step, identical on every rank: global sums / maxima of the local numbers."""
    keys = sorted(result.sums)
    sums = dict(zip(keys, ctx.all_sum([float(result.sums[k]) for k in keys])))
    # each rank's verdict on its own loss and gradient norm rides along with the maxima (host floats, no
    # device read): every rank sees the same verdict and stops at the same step
    local_bad = nonfinite_keys(float(result.sums["loss_sum"]), result.grad_norm)
    mem, sec, *bad_flags = ctx.all_max([peak_memory_mib(ctx.device), seconds,
                                        *(float(k in local_bad) for k in CHECKED)])
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
    bad = [k for k, flag in zip(CHECKED, bad_flags) if flag or not math.isfinite(record[k])]
    if bad:
        record["nonfinite"] = bad
    return record
