"""Per-step metrics: one record per optimiser step, to a progress line with ETA, JSONL and TensorBoard.

Design choices:
* The workers reduce their numbers into one record per step before reporting. Every sink sees that record.
* Rank 0 writes the sinks right after each step, under Ray and torchrun alike. An interrupted driver loses
  no trained step.
* A JSONL line is one fsynced `write` on an O_APPEND descriptor: whole, or a torn tail after a kill.
* A restarted run rewrites the file to the steps up to its checkpoint. Lost records come back from the
  checkpoint, so each finished step is in the file once. Readers skip a torn line with a warning.
* Memory is the worker's peak RSS on CPU and `max_memory_allocated` on GPU.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from hylo.atomic import atomic_write
from hylo.logs import get_logger
from hylo.pipeline.train.storage import Loc
from hylo.pipeline.train.trackers import RunTrackers

logger = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
SCALARS = ("loss", "kl", "ce", "ild_output", "ild_mixer", "lr", "grad_norm", "tokens_per_s", "mem_peak_mib")


def peak_memory_mib(device: torch.device | None = None) -> float:
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fmt_time(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class MetricsWriter:
    """Writes step records to `<run dir>/metrics.jsonl`, TensorBoard and a progress line (logged; to `stream`
    instead when one is given)."""

    def __init__(self, run_dir: str | Path, total_steps: int, log_every: int = 1, tensorboard: bool = True,
                 stream=None) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.tensorboard = tensorboard
        self.stream = stream
        self._tb = None
        self._t_last: float | None = None
        self._step_last: int | None = None
        self._sec_per_step: float | None = None
        self._purge_step: int | None = None
        # W&B / MLflow when the run's config asks for them (metrics.wandb, metrics.mlflow)
        self.trackers = RunTrackers(self.run_dir, stream)

    def _tb_writer(self):
        if self._tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard

            # purge_step: TensorBoard drops the events a resumed run recomputes
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=self._purge_step)
        return self._tb

    def restart_at(self, step: int, remote: Loc | None = None,
                   restore: list[dict[str, Any]] | None = None) -> list[str]:
        """A run (re)starting after `step` (0: from scratch): keep only the records of steps <= `step`,
        dropping torn lines, one record per step (the last); `restore`: records of steps <= `step` kept
        elsewhere (the resumed checkpoint's), put back when the file lacks them; `remote`: the run's
        metrics file in remote storage, preferred when present. Returns the warnings (also printed)."""
        path = self.run_dir / METRICS_FILE
        text = ""
        if remote is not None and remote.is_file():
            text = remote.read_text()
        elif path.is_file():
            text = path.read_text(errors="replace")
        kept: dict[int, str] = {}
        warnings = []
        dropped_later = 0
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                s = int(r["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                warnings.append(f"{path}:{i}: dropped a torn or unreadable line ({line[:60]!r}...)")
                continue
            if s > step:
                dropped_later += 1
            else:
                kept[s] = line
        if dropped_later:
            warnings.append(f"{path}: dropped {dropped_later} record(s) of steps after {step}, where this run "
                            f"continues")
        restored = sorted(int(r["step"]) for r in restore or [] if int(r["step"]) <= step and int(r["step"]) not in kept)
        for r in restore or []:
            if int(r["step"]) in restored:
                kept[int(r["step"])] = json.dumps(r, sort_keys=True)
        if restored:
            warnings.append(f"{path}: restored the record(s) of step(s) {', '.join(map(str, restored))} from the "
                            f"checkpoint (the file had lost them)")
        if text or path.exists() or kept:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(path, "".join(kept[s] + "\n" for s in sorted(kept)))
        for w in warnings:
            self._say(f"[metrics] warning: {w}", logging.WARNING)
        self._purge_step = step + 1
        # a record the file had lost never reached TensorBoard / W&B / MLflow either (each step goes to the
        # file first): they get it now, in step order, before the steps this run computes
        for r in sorted((r for r in restore or [] if int(r["step"]) in restored), key=lambda r: int(r["step"])):
            self._send(r, final=False)
        return warnings

    def write(self, record: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        step = int(record["step"])
        now = time.time()
        if self._t_last is not None and self._step_last is not None and step > self._step_last:
            dt = (now - self._t_last) / (step - self._step_last)
            # Smoothed seconds per step; a resumed or restarted run re-bases on its next step.
            self._sec_per_step = dt if self._sec_per_step is None else 0.7 * self._sec_per_step + 0.3 * dt
        self._t_last, self._step_last = now, step
        append_line(self.run_dir / METRICS_FILE, json.dumps(record, sort_keys=True))
        self._send(record, final=step >= self.total_steps)
        if step % self.log_every == 0 or step == self.total_steps:
            self._say(self.progress_line(record), logging.INFO)

    def _say(self, line: str, level: int) -> None:
        if self.stream is not None:
            print(line, file=self.stream, flush=True)
        else:
            logger.log(level, line)

    def _send(self, record: dict[str, Any], final: bool) -> None:
        """A step's record to TensorBoard and the trackers (W&B, MLflow)."""
        step = int(record["step"])
        tb = self._tb_writer()
        if tb is not None:
            for k in SCALARS:
                if isinstance(record.get(k), int | float):
                    tb.add_scalar(f"train/{k}", record[k], step)
            tb.flush()
        self.trackers.log(record, final=final)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def progress_line(self, r: dict[str, Any]) -> str:
        step, total = int(r["step"]), self.total_steps
        eta = (total - step) * self._sec_per_step if self._sec_per_step is not None else float("nan")
        parts = [f"[stage{r.get('stage', '?')}] step {step}/{total} ({100.0 * step / max(total, 1):.0f}%)",
                 f"loss {r['loss']:.4f}" if r.get("loss_tokens", 1) else "loss - (no loss tokens)"]
        for k in ("kl", "ce", "ild_output", "ild_mixer"):
            if k in r:
                parts.append(f"{k} {r[k]:.4f}")
        parts += [f"lr {r['lr']:.2e}", f"gnorm {r['grad_norm']:.3f}", f"{r['tokens_per_s']:.0f} tok/s",
                  f"mem {r['mem_peak_mib']:.0f} MiB", f"ETA {_fmt_time(eta)}"]
        return " | ".join(parts)

    def close(self) -> None:
        self.trackers.finish()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def append_line(path: Path, line: str) -> None:
    """Append one line with a single write() on an O_APPEND descriptor, then fsync."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_metrics(run_dir: str | Path | Loc, warn=None) -> dict[int, dict[str, Any]]:
    """The last record of each step (a torn or unreadable line is skipped with a warning)."""
    out: dict[int, dict[str, Any]] = {}
    loc = Loc.of(run_dir) / METRICS_FILE
    if not loc.is_file():
        return out
    for i, line in enumerate(loc.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out[int(r["step"])] = r
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            text = f"[metrics] warning: {loc}:{i}: skipped a torn or unreadable line ({line[:60]!r}...)"
            if warn is not None:
                print(text, file=warn, flush=True)
            else:
                logger.warning(text)
    return dict(sorted(out.items()))


def make_ray_callback():
    """A Ray Train `UserCallback` on the controller that says what happens after a worker failure
    (rank 0 writes the metrics itself)."""
    from ray.train import UserCallback  # lazy: ray

    class _FailureCallback(UserCallback):
        def after_exception(self, run_context, worker_exceptions) -> None:
            ranks = ", ".join(f"rank {r}: {type(e).__name__}" for r, e in worker_exceptions.items())
            logger.warning(f"[train] worker failure ({ranks}); Ray restarts from the newest intact "
                           "checkpoint if ray.max_failures allows")

    return _FailureCallback()
