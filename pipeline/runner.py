"""Resumable multi-step runs of the project's jobs (used by pipeline/demo.py and pipeline/placement/).

Each step runs one of the project's own jobs as a subprocess, the same command a user would type
(`python -m hylo.jobs.NAME ...`, which is `hylo NAME ...`: it runs the same from a checkout and from an
installed package, in the directory the run was started from), and logs it to `<run-dir>/logs/<step>.log`. A finished step leaves `<run-dir>/done/<step>.json` (written
atomically); running again skips it after checking that its outputs still exist, so an interrupted run
continues where it stopped and `--force` redoes everything.

The steps that use Ray join one Ray for the whole run (`sh(..., ray=True)` passes its `RAY_ADDRESS`):
the first such step starts it (or joins the cluster `ray.address` / `RAY_ADDRESS` names), and it stops
with the run (`with runner: ...`). A local Ray takes ~10 s to start on 2 cores; the jobs then do not
start one each.

Under the signal rule (`hylo/stopping.py`; the demo and place-layers run under it), SIGTERM or Ctrl-C
reaches the step that runs (its own process group) and ends it; the run directory stays, for the next run
to continue from.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import hylo
from hylo.atomic import atomic_write
from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.outputs import check_not_an_input
from hylo.ownership import check_own_directory, record_files
from hylo.pipeline.config import OUTPUT_PATH, add_config_args, rules
from hylo.pipeline.job_output import JobEcho, known_noise
from hylo.pipeline.ray_init import RayInitSection, check_ray_address, gcs_address, init_ray
from hylo.stopping import popen

logger = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# The directory that holds the `hylo` package (a checkout's root, or site-packages): the steps' PYTHONPATH,
# so that a checkout used without installing runs its own jobs.
PACKAGE_ROOT = Path(hylo.__file__).resolve().parents[1]


def job(name: str) -> list[str]:
    """The command line of job `name` (`convert`, `prepare_data`, ...): this Python, the job's module."""
    return [PY, "-m", f"hylo.jobs.{name}"]


@dataclass
@rules(run_dir=OUTPUT_PATH)
class RunnerConfig:
    """The options every multi-step job has (`DemoConfig`, `PlacementConfig` extend it)."""

    # Where the run lives: logs/, done/ and every step's output.
    run_dir: str = "runs/run"
    # Redo every step.
    force: bool = False
    # Do not echo the jobs' output.
    quiet: bool = False
    # The one Ray the steps join (started by the first step that needs it, unless an address is given).
    ray: RayInitSection = field(default_factory=RayInitSection)


# The shorthand flags of `runner_parser` and their config keys.
RUNNER_FLAGS = {"run_dir": "run_dir", "force": "force", "quiet": "quiet"}


def runner_parser(description: str) -> argparse.ArgumentParser:
    """A multi-step job's command line: --config, --set, --print-config and the shorthands --run-dir,
    --force, --quiet (the job adds its own)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    add_config_args(ap)
    ap.add_argument("--run-dir", help="run directory (run_dir)")
    ap.add_argument("--force", action="store_true", default=None, help="redo every step (force)")
    ap.add_argument("--quiet", action="store_true", default=None, help="do not echo the jobs' output (quiet)")
    return ap


# what every multi-step run directory holds (its steps' logs and records), recorded as ours when made
RUN_ENTRIES = ("logs", "done")


class StepRunner:
    def __init__(self, run_dir: str | Path, force: bool = False, quiet: bool = False, tag: str = "run",
                 ray: RayInitSection | None = None,
                 inputs: Iterable[tuple[str, str | Path | None]] = ()) -> None:
        # before anything is made: the run directory is none of the run's `inputs` ((option, path) pairs), nor
        # inside or around one, and no directory of the user's (our record proves a run directory ours)
        check_not_an_input(run_dir, inputs, "run_dir")
        check_own_directory(run_dir, "run_dir")
        # the cluster the steps join answers (a stale RAY_ADDRESS is named now, before any step runs)
        check_ray_address((ray or RayInitSection()).address)
        self.run = Path(run_dir).resolve()
        self.force, self.quiet, self.tag = force, quiet, tag
        (self.run / "logs").mkdir(parents=True, exist_ok=True)
        (self.run / "done").mkdir(parents=True, exist_ok=True)
        record_files(self.run, RUN_ENTRIES)
        self.times: dict[str, float] = {}
        self.t_start = time.time()
        self.ray_cfg = ray or RayInitSection()
        self._ray_address: str | None = None
        self._ray_started = False

    def __enter__(self) -> StepRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the run's Ray if this runner started it."""
        if self._ray_started:
            import ray  # lazy: ray

            ray.shutdown()
            self._ray_started, self._ray_address = False, None

    def ray_address(self) -> str:
        """The address of the run's one Ray, started (or joined) on first use."""
        if self._ray_address is None:
            # this process runs no Ray work itself: the jobs' workers log to the jobs
            self._ray_started = init_ray(self.ray_cfg.address, self.ray_cfg.num_cpus, log_to_driver=False)
            self._ray_address = gcs_address()
        return self._ray_address

    def done_file(self, name: str) -> Path:
        return self.run / "done" / f"{name}.json"

    def finished(self, name: str, outputs: list[Path]) -> dict | None:
        """The step's record when it finished before and its outputs are all there, else None."""
        f = self.done_file(name)
        if self.force or not f.is_file():
            return None
        info = read_json(f)
        missing = [str(p) for p in outputs if not Path(p).exists()]
        if missing:
            logger.info(f"[{self.tag}] {name}: marked done but {missing[0]} is missing; running it again")
            return None
        logger.info(f"[{self.tag}] {name}: already done ({info.get('seconds', 0):.0f} s), "
                    "reusing its outputs")
        self.times[name] = info.get("seconds", 0.0)
        return info

    def mark(self, name: str, seconds: float, **info) -> None:
        atomic_write(self.done_file(name), json.dumps({"seconds": seconds, **info}, indent=1))
        self.times[name] = seconds

    def step(self, name: str, outputs: list[Path], fn: Callable[[], dict | None]) -> dict:
        """Run `fn` unless the step finished before; record its wall time and returned info."""
        info = self.finished(name, outputs)
        if info is not None:
            return info
        t0 = time.time()
        info = fn() or {}
        self.mark(name, time.time() - t0, **info)
        return info

    def sh(self, name: str, cmd: list[str], env: dict | None = None, ray: bool = False) -> str:
        """Run one job, its output to logs/<name>.log (all of it, without ANSI codes) and to the console's
        stderr (less the known noise of Ray and torch: pipeline/job_output.py); return its output.
        `ray`: the job joins the run's Ray (`RAY_ADDRESS`)."""
        log = self.run / "logs" / f"{name.replace('/', '_')}.log"
        if ray:
            env = {"RAY_ADDRESS": self.ray_address(), **(env or {})}
        sys.stderr.write("\n")  # a blank line before each step
        logger.info(f"[{self.tag}] === {name}: {' '.join(cmd)}")
        paths = [str(PACKAGE_ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        out_lines: list[str] = []
        echo = JobEcho(tty=sys.stderr.isatty())
        with open(log, "w") as fh:
            # under the signal rule (hylo/stopping.py) its own process group, ended with the run; bytes: the
            # job's output is split into lines and filtered by pipeline/job_output.py
            proc = popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert proc.stdout is not None
            # newline="": a progress bar's redraw ("\r") is a piece of its own, not a line
            for piece in io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace", newline=""):
                text = echo.log_text(piece)
                fh.write(text)
                out_lines.append(text)
                shown = None if self.quiet else echo.terminal_text(piece)
                if shown is not None:  # the job's log lines: on stderr, as this job's own
                    sys.stderr.write(f"  | {shown}")
                    sys.stderr.flush()
            rc = proc.wait()
        if echo.held and not self.quiet:
            lines = "1 line" if echo.held == 1 else f"{echo.held} lines"
            logger.info(f"[{self.tag}] {name}: {lines} of known Ray/torch notices are in {log} only")
        if rc != 0:
            # the job's last lines less the known noise (a Ray worker's repeated notice would hide the error)
            tail = "".join([line for line in out_lines if not known_noise(line.rstrip("\n"))][-30:])
            raise SystemExit(f"[{self.tag}] {name} failed (exit {rc}); full log: {log}\n{tail}")
        return "".join(out_lines)


def last_json_object(text: str) -> dict:
    """The JSON object a job printed last on stdout (library log lines may come before it)."""
    start = 0 if text.startswith("{") else text.index("\n{") + 1
    return json.loads(text[start:text.rindex("}") + 1])


def convert_cmd(base: str | Path, out: Path, placement: str, kv_lora_rank: int, linear_type: str = "gdn",
                seed: int = 0) -> list[str]:
    return [*job("convert"), "--base", str(base), "--out", str(out), "--mla-layers", placement,
            "--kv-lora-rank", str(kv_lora_rank), "--linear-type", linear_type, "--seed", str(seed)]


def train_cmd(stage: int, config: str | Path, storage: Path, name: str, student: Path, data: Path,
              seq_len: int | None, steps: int, extra: list[str] | None = None) -> list[str]:
    """A jobs/stage{1,2}.py command for a short run (checkpoints at half-way and the end, deleted once the
    consolidated model is written: the step's output is `<storage>/<name>/model`). The rows' length is the
    prepared data's (its manifest); `seq_len`, when given, is set as `data.seq_len`, a check of it.

    A run directory that already holds a complete checkpoint is from an interrupted attempt of this step
    (a finished step is never re-run): the command continues it with `--resume`.
    """
    from hylo.pipeline.train.checkpoint.layout import latest_checkpoint  # lazy: torch

    resume = ["--resume"] if latest_checkpoint(Path(storage) / name) is not None else []
    cmd = [*job(f"stage{stage}"), "--config", str(config),
           "--set", f"ray.storage_path={storage}", "--set", f"ray.name={name}",
           "--set", f"model.student={student}", "--set", f"data.path={data}",
           "--set", f"train.total_steps={steps}", "--set", f"checkpoint.every_steps={max(1, steps // 2)}",
           "--set", "checkpoint.delete_after_consolidate=true"]
    check = ["--set", f"data.seq_len={seq_len}"] if seq_len is not None else []
    return cmd + check + (extra or []) + resume


def lengths_arg(lengths: list[int]) -> str:
    """A list of context lengths as one `--set` value: [512,1024]."""
    return "[" + ",".join(map(str, lengths)) + "]"


def eval_cmd(model: Path, base: str | Path, data: Path, out: Path, suites: str, max_rows: int,
             extra: list[str] | None = None) -> list[str]:
    return [*job("eval"), "--model", str(model), "--teacher", str(base), "--base", str(base),
            "--data", str(data), "--out", str(out), "--suite", suites, "--quiet",
            "--set", f"kl.max_rows={max_rows}"] + (extra or [])
