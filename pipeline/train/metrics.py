"""Per-step metrics: one record per optimiser step -> progress log (with ETA), JSONL, TensorBoard.

Design choices:
* Workers reduce their numbers into one record per step (sums for tokens and losses, max for memory)
  before reporting, so every sink sees the same record and rank 0's report is the whole step.
* Under Ray the sinks live in a `UserCallback` on the Ray Train controller (it sees every report,
  survives worker restarts and prints through Ray's log forwarding to the driver); under torchrun
  rank 0 calls the same `MetricsWriter`.
* JSONL is append-only: a step recomputed after a restart appears again with a higher `attempt`;
  readers keep the last record of each step (`read_metrics`).
* Memory: peak RSS of the worker process on CPU (`ru_maxrss`), `max_memory_allocated` on GPU.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.train.trackers import RunTrackers

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
SCALARS = ("loss", "kl", "ce", "ild_output", "ild_mixer", "lr", "grad_norm", "tokens_per_s", "mem_peak_mib")


def peak_memory_mib(device: torch.device | None = None) -> float:
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _fmt_time(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class MetricsWriter:
    """Writes step records to `<run dir>/metrics.jsonl`, TensorBoard and a progress line."""

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
        # W&B / MLflow when the run's config asks for them (metrics.wandb, metrics.mlflow)
        self.trackers = RunTrackers(self.run_dir, stream)

    def _tb_writer(self):
        if self._tb is None and self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR))
        return self._tb

    def write(self, record: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        step = int(record["step"])
        now = time.time()
        if self._t_last is not None and self._step_last is not None and step > self._step_last:
            dt = (now - self._t_last) / (step - self._step_last)
            # Smoothed seconds per step; a resumed or restarted run re-bases on its next step.
            self._sec_per_step = dt if self._sec_per_step is None else 0.7 * self._sec_per_step + 0.3 * dt
        self._t_last, self._step_last = now, step
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        tb = self._tb_writer()
        if tb is not None:
            for k in SCALARS:
                if isinstance(record.get(k), int | float):
                    tb.add_scalar(f"train/{k}", record[k], step)
            tb.flush()
        self.trackers.log(record, final=step >= self.total_steps)
        if step % self.log_every == 0 or step == self.total_steps:
            print(self.progress_line(record), file=self.stream or sys.stdout, flush=True)

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


def read_metrics(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The last record of each step (a step recomputed after a restart keeps its newest record)."""
    out: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[int(r["step"])] = r
    return dict(sorted(out.items()))


def make_ray_callback(run_dir: str | Path, total_steps: int, log_every: int, tensorboard: bool):
    """A Ray Train `UserCallback` that feeds rank 0's per-step record to a `MetricsWriter`."""
    from ray.train import UserCallback

    class _MetricsCallback(UserCallback):
        def __init__(self) -> None:
            self.writer = MetricsWriter(run_dir, total_steps, log_every, tensorboard)

        def __getstate__(self):
            # Built fresh on the controller: no open files or TensorBoard writers travel.
            return {}

        def __setstate__(self, state) -> None:
            self.writer = MetricsWriter(run_dir, total_steps, log_every, tensorboard)

        def after_report(self, run_context, metrics, checkpoint) -> None:
            if metrics and metrics[0] and "step" in metrics[0]:
                self.writer.write(dict(metrics[0]))

        def after_exception(self, run_context, worker_exceptions) -> None:
            ranks = ", ".join(f"rank {r}: {type(e).__name__}" for r, e in worker_exceptions.items())
            print(f"[train] worker failure ({ranks}); Ray restarts from the latest checkpoint if "
                  f"ray.max_failures allows", flush=True)

    return _MetricsCallback()
