"""Where a training worker's checkpoints go and how it reports, under Ray Train or torchrun: the `Session`.

Design choices:
* A `Session` hides the launcher. Under Ray a checkpoint goes through `ray.train.report` with our upload
  function, which retries a storage outage. Under torchrun the ranks write `.tmp-step_N` and rank 0 renames
  it. Both give the same layout, so either resumes the other.
* Every rank lists its files' sizes and sha256. After a barrier rank 0 writes the manifest last.
* Resume is collective. The candidates are this launch's own checkpoints, newest first, then the
  `--resume` choice. Every rank checks them, the newest intact one wins, and each skipped one is printed.
* Rank 0 writes each step's metrics record itself, before reporting it.
* Preemption is checked at every step boundary. A driver's SIGTERM gives a final checkpoint when it fits
  in `checkpoint.preempt_grace_s`, then a stop. A Ray drain notice gives one checkpoint; training goes on.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.pipeline.train.checkpoint.layout import (
    CHECKPOINT_MANIFEST,
    CheckpointError,
    checkpoint_problem,
    finalize_checkpoint,
    finalize_local,
    prune,
    step_dir_name,
    write_rank_files,
)
from hylo.pipeline.train.checkpoint.resume import launch_checkpoints, resume_candidates, set_aside_other_lines
from hylo.pipeline.train.checkpoint.write_errors import is_disk_full, upload_error
from hylo.pipeline.train.metrics import METRICS_FILE, TB_DIR, MetricsWriter
from hylo.pipeline.train.storage import (
    Loc,
    fresh_local_dir,
    remove_local,
    run_loc,
    sweep_local_scratch,
    upload_with_retries,
)
from hylo.pipeline.train.worker import WorkerContext

logger = get_logger(__name__)

# the prefix of a Ray worker's checkpoint scratch directory in the temporary directory (`hylo-ckpt-<step>-r<rank>-p<pid>-`)
CKPT_SCRATCH = "hylo-ckpt-"
# rank 0's report of how much of the model each rank holds (loop.zero_partition_report), uploaded with the metrics
PARTITION_FILE = "zero_partition.json"


# ------------------------------------------------------------------------------------ preemption
PREEMPT_FILE = ".preempt.json"


def read_preempt_request(run: Loc) -> dict[str, Any] | None:
    """The driver's preemption request in the run's storage (written by its SIGTERM handler), or None."""
    loc = run / PREEMPT_FILE
    try:
        if not loc.is_file():
            return None
        request = read_json(loc)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning(f"[train] warning: {run / PREEMPT_FILE} is unreadable ({e}); "
                       "taken as a preemption request")
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
        own = launch_checkpoints(self.run_loc, self.launch_id) if self.launch_id else []
        start: list[tuple[Loc, bool]] = []
        if self.resume_latest:
            start = [(c, True) for c in resume_candidates(self.run_loc)]
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
            problem = checkpoint_problem(ckpt)
            if problem is None and ckpt.is_local:
                local = ckpt.local()
                problem = checkpoint_problem(local, deep=True, only=lambda i: i % world == rank)
            elif problem is None:
                local = ckpt.download(fresh_local_dir(f"hylo-resume-{ckpt.name}-r{rank}-"))
                self._downloads.append(local)
                problem = checkpoint_problem(local, deep=True)
        except (OSError, CheckpointError) as e:
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
                    logger.info(f"[resume] resuming from {c.name}, the newest intact checkpoint")
                return c, local
            skipped.append(f"{c.name}: {problem}")
            if self.ctx.rank == 0:
                logger.warning(f"[resume] skipping {c.name}: {problem}")
            if not walk:
                raise CheckpointError(f"--resume {c}: cannot resume from it: {problem}")
        if cands:
            raise CheckpointError(f"no intact checkpoint to resume from in {self.run_loc}:\n  "
                                  + "\n  ".join(skipped))
        return None

    def start_new_line(self, ckpt: Loc, step: int) -> None:
        """Rank 0, after resuming from `ckpt` at `step`: the run's checkpoints after it (a resume from an older
        step) belong to the line of checkpoints this run leaves; they are moved aside, once, with a copy of the
        metrics file as it was (resume.set_aside_other_lines), and never pruned or resumed from."""
        moved = set_aside_other_lines(self.run_loc, ckpt, step, copies=(METRICS_FILE,))
        if moved is not None:
            folder, names = moved
            logger.info(f"[resume] resuming from {ckpt.name} starts a new line of checkpoints: the run's "
                        f"other checkpoints ({', '.join(names)}) and a copy of {METRICS_FILE} as it was are "
                        f"set aside in {folder}; they are kept, never pruned or resumed from (delete that "
                        "folder once you do not need it)")

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

    def discard(self, step: int, ckpt_dir: Path | None) -> None:
        """A checkpoint's write failed (a full disk, a failed upload, a stop): remove what it left, the local
        scratch directory and (under Ray) a partial `<run>/step_N` without its manifest. The previous
        checkpoints stay; nothing half-written is left to fill the disk."""
        if ckpt_dir is not None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        target = self.run_loc / step_dir_name(step)
        try:
            if target.exists() and checkpoint_problem(target) is not None:
                target.rmtree()
        except OSError:
            pass

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None, metrics: bool = True) -> None:
        """Report step's record (written to the metrics file unless `metrics` is false: a second
        report of the same step) and, with `ckpt_dir`, its checkpoint."""
        raise NotImplementedError

    def write_metrics(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def after_checkpoint(self) -> None:
        """Rank 0, once a checkpoint is final: prune old ones; for remote storage upload the metrics."""
        removed = prune(self.run_loc, self.ctx.cfg.checkpoint.keep)
        if removed:
            logger.info(f"[train] checkpoint.keep={self.ctx.cfg.checkpoint.keep}: "
                        f"removed {', '.join(removed)}")
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
        import ray.train  # lazy: ray

        storage = ray.train.get_context().get_storage()
        dest = storage.build_checkpoint_path_from_name(dir_name)
        c = self.ctx.cfg.checkpoint
        upload_with_retries(Path(checkpoint.path), Loc(storage.storage_filesystem, dest, self.run_loc.scheme),
                            c.upload_retries, c.upload_backoff_s, f"rank {self.ctx.rank}: ")
        return ray.train.Checkpoint(path=dest, filesystem=storage.storage_filesystem)

    def drain_notice(self) -> dict[str, Any] | None:
        import ray.train  # lazy: ray

        info = ray.train.get_preemption_info()
        if info is None:
            return None
        nodes = ", ".join(n[:12] for n in info.preempted_node_ids)
        return {"key": ",".join(info.preempted_node_ids),
                "source": f"Ray drains node(s) {nodes} of rank(s) {info.preempted_ranks} (preemption)",
                "deadline": info.deadline_ms / 1000 if info.deadline_ms else None}

    def scratch_dir(self, step: int) -> Path:
        # what a killed worker of this host left in the temporary directory goes first (its pid is gone)
        sweep_local_scratch(CKPT_SCRATCH)
        return fresh_local_dir(f"{CKPT_SCRATCH}{step}-r{self.ctx.rank}-p{os.getpid()}-")

    def report(self, record: dict[str, Any], step: int, ckpt_dir: Path | None, metrics: bool = True) -> None:
        import ray.train  # lazy: ray

        if metrics:
            self.write_metrics(record)
        if ckpt_dir is None:
            ray.train.report(record)
            return
        target = self.run_loc / step_dir_name(step)
        try:
            write_rank_files(ckpt_dir, self.ctx.rank, self.ctx.world_size, shared=False)
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
                    finalize_checkpoint(target, step, self.ctx.world_size, self.launch_id)
                except OSError as e:
                    if not is_disk_full(e):
                        raise
                    raise upload_error(target, None, e, step, 0, file=CHECKPOINT_MANIFEST) from e
        except BaseException:
            # the error names the file that did not arrive whole (made above); then nothing half-written stays
            self.discard(step, ckpt_dir)
            raise
        if self.ctx.rank == 0:
            self.after_checkpoint()

    def upload(self, record: dict[str, Any], ckpt_dir: Path, target: Loc, step: int) -> None:
        """Ray Train reports the checkpoint and copies this rank's scratch directory into `target` with
        `upload_files`; a full storage is reported with the checkpoint, the file and the space left
        (Ray's own error says only "No space left on device")."""
        import ray.train  # lazy: ray

        try:
            ray.train.report(record, checkpoint=ray.train.Checkpoint.from_directory(str(ckpt_dir)),
                             checkpoint_dir_name=target.name, checkpoint_upload_fn=self.upload_files)
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise upload_error(target, ckpt_dir, e, step, self.ctx.rank) from e


class TorchrunSession(Session):
    def scratch_dir(self, step: int) -> Path:
        tmp = self.run_loc.local() / f".tmp-{step_dir_name(step)}"
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
        try:
            write_rank_files(ckpt_dir, self.ctx.rank, self.ctx.world_size, shared=True)
            dist.barrier()
            if self.ctx.rank == 0:
                finalize_local(ckpt_dir, self.run_loc.local() / step_dir_name(step), step,
                               self.ctx.world_size, self.launch_id)
        except BaseException:
            self.discard(step, ckpt_dir)  # the shared .tmp-step_N: nothing half-written stays
            raise
        if self.ctx.rank == 0:
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
