"""The per-worker training loop shared by both stages, under Ray Train or torchrun.

Legend: W workers (ranks), G gradient-accumulation micro-steps per optimiser step (one packed row each).

    train_worker(loop_config)      # Ray Train's train_loop_per_worker, or called by each torchrun rank

Design choices:
* The stage modules (`stage1.py`, `stage2.py`) own model building and THE step; this file owns what
  both share: process group, seeding, data position, resume, metrics reduction, checkpoint cadence,
  fault injection and the final consolidation.
* A `Session` hides the launcher: under Ray, checkpoints go through `ray.train.report(checkpoint=...)`
  (each worker hands its scratch directory; Ray merges them into `<run dir>/step_N`) and resume comes
  from `ray.train.get_checkpoint()`; under torchrun, ranks write `<run dir>/.tmp-step_N` and rank 0
  renames it. Both produce the same checkpoint layout (checkpoint.py), so either resumes the other.
* Loss normalisation: every step's loss is a mean over all loss tokens of the global batch. Each
  micro-batch contributes `sum / n_global * W` (DeepSpeed averages gradients over W ranks and we skip
  its 1/G scaling), so packed rows with different numbers of loss tokens weigh by their tokens.
* Fault injection (`fault.*`) SIGKILLs one worker once (a marker file in the run directory makes it
  one-shot), for the recovery tests.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.train import checkpoint as ckpt_lib
from pipeline.train.config import StageConfig, config_from_dict, run_dir
from pipeline.train.deepspeed_cfg import grad_accum_steps, resolve_dtype
from pipeline.train.metrics import MetricsWriter, peak_memory_mib
from pipeline.train.rows import RowStream, open_rows

PARTITION_FILE = "zero_partition.json"


# ------------------------------------------------------------------------------------ context
@dataclass
class WorkerContext:
    cfg: StageConfig
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    run_dir: Path
    grad_accum: int
    step: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def maybe_fault(self, when: str) -> None:
        """SIGKILL this worker once, if fault injection asks for it here."""
        f = self.cfg.fault
        if f.kill_at_step != self.step or f.kill_when != when or f.kill_rank != self.rank:
            return
        marker = self.run_dir / f".fault-step{self.step}-{when}-rank{self.rank}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("killed\n")
        print(f"[fault] rank {self.rank}: SIGKILL at step {self.step} ({when})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def row_to_device(row: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Packed row (numpy) -> [1, T] tensors on `device`; labels = next token within the row."""
    ids = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(row["loss_mask"])).bool()
    labels = torch.roll(ids, -1)
    return {
        "input_ids": ids.unsqueeze(0).to(device),
        "position_ids": torch.as_tensor(np.asarray(row["position_ids"]), dtype=torch.long).unsqueeze(0).to(device),
        "cu_seqlens": torch.as_tensor(np.asarray(row["cu_seqlens"]), dtype=torch.int32).to(device),
        "loss_mask": mask.to(device),
        "labels": labels.to(device),
    }


# ------------------------------------------------------------------------------------ sessions
class Session:
    """Launcher-specific reporting and checkpoint storage."""

    def __init__(self, ctx: WorkerContext, resume_from: str | None) -> None:
        self.ctx = ctx
        self.resume_from = resume_from

    def explicit_resume(self) -> Path | None:
        if not self.resume_from:
            return None
        if self.resume_from == "latest":
            return ckpt_lib.latest_checkpoint(self.ctx.run_dir)
        p = Path(self.resume_from)
        if not ckpt_lib.is_complete(p):
            raise ckpt_lib.CheckpointError(f"--resume {p}: not a complete checkpoint directory")
        return p

    def resume_checkpoint(self) -> Path | None:
        return self.explicit_resume()

    def scratch_dir(self, step: int) -> Path:
        raise NotImplementedError

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RaySession(Session):
    _ckpt_ctx: Any = None

    def resume_checkpoint(self) -> Path | None:
        import ray.train

        candidates = []
        ray_ckpt = ray.train.get_checkpoint()
        if ray_ckpt is not None:
            # Local or shared-filesystem storage: the directory in place; remote storage: a local copy
            # that lives until close().
            self._ckpt_ctx = ray_ckpt.as_directory()
            candidates.append(Path(self._ckpt_ctx.__enter__()))
        explicit = self.explicit_resume()
        if explicit is not None:
            candidates.append(explicit)
        candidates = [c for c in candidates if ckpt_lib.is_complete(c)]
        return max(candidates, key=ckpt_lib.checkpoint_step) if candidates else None

    def scratch_dir(self, step: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"hylo-ckpt-{step}-r{self.ctx.rank}-"))

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        import ray.train

        if ckpt_dir is None:
            ray.train.report(record)
            return
        ray.train.report(record, checkpoint=ray.train.Checkpoint.from_directory(str(ckpt_dir)),
                         checkpoint_dir_name=ckpt_lib.step_dir_name(step))
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    def close(self) -> None:
        if self._ckpt_ctx is not None:
            self._ckpt_ctx.__exit__(None, None, None)
            self._ckpt_ctx = None


class TorchrunSession(Session):
    def __init__(self, ctx: WorkerContext, resume_from: str | None, total_steps: int) -> None:
        super().__init__(ctx, resume_from)
        self.writer = None
        if ctx.rank == 0:
            m = ctx.cfg.metrics
            self.writer = MetricsWriter(ctx.run_dir, total_steps, m.log_every, m.tensorboard)

    def scratch_dir(self, step: int) -> Path:
        tmp = self.ctx.run_dir / f".tmp-{ckpt_lib.step_dir_name(step)}"
        if self.ctx.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        dist.barrier()
        return tmp

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None) -> None:
        if ckpt_dir is not None:
            dist.barrier()
            if self.ctx.rank == 0:
                ckpt_lib.finalize_local(ckpt_dir, self.ctx.run_dir / ckpt_lib.step_dir_name(step))
                ckpt_lib.prune(self.ctx.run_dir, self.ctx.cfg.checkpoint.keep)
            dist.barrier()
        if self.writer is not None:
            self.writer.write(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        # Leave together and tear the process group down explicitly: a rank that exits while another is
        # still writing the consolidated model destroys gloo's threads at interpreter exit, which aborts
        # ("terminate called without an active exception", SIGABRT) and fails the whole torchrun job.
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------ helpers
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
def train_worker(loop_config: dict[str, Any]) -> None:
    """Train one stage on this worker; all workers run this in lockstep."""
    if loop_config.get("torch_extensions_dir"):
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", loop_config["torch_extensions_dir"])
    cfg = config_from_dict(loop_config["config"])
    if cfg.stage == 1:
        from pipeline.train import stage1 as stage
    else:
        from pipeline.train import stage2 as stage

    # DeepSpeed loads its compiled ops during setup; guard against a lock left by a killed process.
    stop_watch = threading.Event()
    threading.Thread(target=watch_stale_build_locks, args=(stop_watch,), daemon=True).start()
    rank, world, device = setup_distributed(cfg)
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    ctx = WorkerContext(cfg=cfg, rank=rank, world_size=world, device=device,
                        dtype=resolve_dtype(cfg.model.dtype, device.type == "cuda"), run_dir=run_dir(cfg),
                        grad_accum=grad_accum_steps(cfg.train.global_batch_sequences, world))
    rows: RowStream = open_rows(cfg.data, cfg.train.seed, rank, world)
    total = total_steps_for(cfg, rows.num_rows)
    last = min(total, cfg.train.max_steps) if cfg.train.max_steps else total
    session: Session = (RaySession(ctx, loop_config.get("resume_from")) if loop_config["launcher"] == "ray"
                        else TorchrunSession(ctx, loop_config.get("resume_from"), total))

    task = stage.build(ctx, cosine_with_warmup(total, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio))
    stop_watch.set()
    zero_partition_report(task.engine, ctx)

    start = 0
    resume = session.resume_checkpoint()
    if resume is not None:
        ckpt_lib.check_compatible(resume, cfg, world, rows.fingerprint)
        rank_state = ckpt_lib.load_checkpoint(task.engine, resume, rank)
        rows.seek(rank_state["data"]["position"])
        start = int(rank_state["step"])
        if rank == 0:
            print(f"[train] resumed from {resume} at step {start}", flush=True)

    for step in range(start + 1, last + 1):
        ctx.step = step
        t0 = time.perf_counter()
        batch = [rows.next_row() for _ in range(ctx.grad_accum)]
        local = stage.train_step(task, batch, ctx)
        record = reduce_record(ctx, local, batch, rows, time.perf_counter() - t0, total)
        record["resumed_from"] = start
        save = step % cfg.checkpoint.every_steps == 0 or step == last
        ckpt_dir = None
        if save:
            ckpt_dir = session.scratch_dir(step)
            ckpt_lib.save_checkpoint(task.engine, ckpt_dir, rank, world, step, cfg,
                                     {"data": rows.state()}, {"metrics": record, "total_steps": total,
                                      "data_fingerprint": rows.fingerprint})
        session.report(record, step, ckpt_dir)
        if save:
            ctx.maybe_fault("after_checkpoint")

    if cfg.checkpoint.consolidate:
        out = ckpt_lib.consolidate_hylo(task.student, ctx.run_dir / "model", rank, tokenizer_from=cfg.model.student)
        if out is not None:
            print(f"[train] consolidated HF checkpoint: {out}", flush=True)
    session.close()


def reduce_record(ctx: WorkerContext, local: dict[str, float], batch: list[dict[str, Any]], rows: RowStream,
                  seconds: float, total: int) -> dict[str, Any]:
    """One record per step, identical on every rank: global sums / maxima of the local numbers."""
    keys = sorted(local)
    sums = dict(zip(keys, ctx.all_sum([float(local[k]) for k in keys])))
    mem, sec = ctx.all_max([peak_memory_mib(ctx.device), seconds])
    row_ids: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(row_ids, [r["row_key"] for r in batch])
    positions: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(positions, rows.position)
    # A step whose rows hold no loss token (e.g. windows of a split user turn) reports loss 0.
    loss_tokens = sums.pop("loss_tokens")
    n_loss = max(1.0, loss_tokens)
    tokens = sums.pop("tokens")
    record: dict[str, Any] = {
        "step": ctx.step, "stage": ctx.cfg.stage, "total_steps": total,
        "loss": sums.pop("loss_sum") / n_loss,
        "lr": ctx.extras["lr"], "grad_norm": ctx.extras["grad_norm"],
        "tokens": int(tokens), "loss_tokens": int(loss_tokens),
        "tokens_per_s": tokens / max(sec, 1e-9), "step_time_s": sec,
        "mem_peak_mib": mem, "rows": row_ids, "data_position": positions,
    }
    for k, v in sums.items():
        record[k.removesuffix("_sum")] = v / n_loss
    return record
