"""Optional experiment trackers, Weights & Biases and MLflow, fed with the per-step metrics records.

Off by default. A `metrics.wandb` or `metrics.mlflow` section in a training config turns one on:

    metrics:
      wandb: {project: hylo, entity: my-team, mode: offline}        # mode: online | offline | disabled
      mlflow: {tracking_uri: file:///mnt/hylo/mlruns, experiment: hylo-1b}

    python jobs/stage2.py --config ... --set metrics.wandb.project=hylo --set metrics.wandb.mode=offline

Design choices:
* A tracker has three calls: `start(config)` once with the resolved run config (W&B run config,
  MLflow params), `log(step, scalars)` per optimiser step (every number of the step's record, under
  `train/<key>`: the same values as metrics.jsonl and TensorBoard), and `finish()` after the last step.
* The packages are optional (`pip install 'hylo-pipeline[trackers]'`) and imported only when a
  tracker opens. The config sections (pipeline/train/config.py) check at load time that the package can
  be imported, so a missing one is one `error:` line when the job starts, not a failure after the first step.
* `MetricsWriter` (pipeline/train/metrics.py) owns a `RunTrackers` and hands it each record. It reads
  the run config from `<run dir>/config_stage<N>.json`, which the driver writes before training, so
  the same hook serves the Ray Train controller and torchrun's rank 0 with no extra plumbing.
* A resumed run continues the same tracker run: the ids are kept in `<run dir>/trackers.json`.
* A tracker that fails (network, quota) is reported once and switched off; training goes on and
  metrics.jsonl stays complete.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any, Protocol

from hylo.atomic import atomic_write
from hylo.json_files import read_json
from hylo.logs import get_logger

logger = get_logger(__name__)

TRACKERS_FILE = "trackers.json"
class Tracker(Protocol):
    name: str

    def start(self, config: dict[str, Any], run_dir: Path, resume_id: str | None) -> str | None:
        """Open (or continue) the tracker's run; returns its id for a later resume."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def finish(self) -> None: ...


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class WandbTracker:
    name = "wandb"

    def __init__(self, section: dict[str, Any]) -> None:
        self.section = section
        self.run = None

    def start(self, config: dict[str, Any], run_dir: Path, resume_id: str | None) -> str | None:
        wandb = importlib.import_module("wandb")
        s = self.section
        self.run = wandb.init(project=s.get("project"), entity=s.get("entity"), mode=s.get("mode", "online"),
                              name=s.get("name") or config.get("ray", {}).get("name"), dir=str(run_dir),
                              config=config, id=resume_id, resume="allow" if resume_id else None)
        return getattr(self.run, "id", None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowTracker:
    name = "mlflow"
    # MLflow rejects longer parameter values.
    MAX_PARAM_CHARS = 6000

    def __init__(self, section: dict[str, Any]) -> None:
        self.section = section
        self.mlflow = None

    def start(self, config: dict[str, Any], run_dir: Path, resume_id: str | None) -> str | None:
        mlflow = self.mlflow = importlib.import_module("mlflow")
        s = self.section
        if s.get("tracking_uri"):
            mlflow.set_tracking_uri(s["tracking_uri"])
        mlflow.set_experiment(s.get("experiment") or "hylo")
        if resume_id:
            run = mlflow.start_run(run_id=resume_id)
        else:
            run = mlflow.start_run(run_name=s.get("run_name") or config.get("ray", {}).get("name"))
            # parameters cannot change once logged: only a new run logs the config
            mlflow.log_params({k: json.dumps(v)[: self.MAX_PARAM_CHARS] if not isinstance(v, str)
                               else v[: self.MAX_PARAM_CHARS] for k, v in flatten(config).items()})
        return run.info.run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def finish(self) -> None:
        if self.mlflow is not None:
            self.mlflow.end_run()
            self.mlflow = None


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics record except the step and stage themselves, as `train/<key>`."""
    return {f"train/{k}": float(v) for k, v in record.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "stage")}


class RunTrackers:
    """The trackers a run's config turns on; opened at the first record, a no-op when none is set."""

    def __init__(self, run_dir: str | Path, stream=None) -> None:
        self.run_dir = Path(run_dir)
        self.stream = stream
        self.active: list[Tracker] | None = None  # None: not opened yet

    def _config(self, stage: Any) -> dict[str, Any] | None:
        path = self.run_dir / f"config_stage{stage}.json"
        if not path.is_file():
            found = sorted(self.run_dir.glob("config_stage*.json"))
            if len(found) != 1:
                return None
            path = found[0]
        return read_json(path)

    def _warn(self, tracker: Tracker, what: str, e: Exception) -> None:
        text = (f"[metrics] {tracker.name}: {what} failed ({type(e).__name__}: {e}); "
                f"{tracker.name} logging is off for this run, metrics.jsonl is unaffected")
        if self.stream is not None:
            print(text, file=self.stream, flush=True)
        else:
            logger.warning(text)

    def _open(self, stage: Any) -> None:
        self.active = []
        config = self._config(stage)
        wanted = {k: v for k, v in ((config or {}).get("metrics") or {}).items() if k in TRACKERS and v}
        if not wanted:
            return
        ids_path = self.run_dir / TRACKERS_FILE
        ids = read_json(ids_path) if ids_path.is_file() else {}
        for name, section in wanted.items():
            tracker = TRACKERS[name](section)
            try:
                run_id = tracker.start(config, self.run_dir, ids.get(name))
            except Exception as e:  # a tracker never stops training
                self._warn(tracker, "start", e)
                continue
            self.active.append(tracker)
            if run_id:
                ids[name] = run_id
        atomic_write(ids_path, json.dumps(ids, indent=1))

    def log(self, record: dict[str, Any], final: bool = False) -> None:
        if self.active is None:
            self._open(record.get("stage"))
        for tracker in list(self.active or []):
            try:
                tracker.log(int(record["step"]), scalars_of(record))
            except Exception as e:
                self._warn(tracker, "log", e)
                self.active.remove(tracker)
        if final:
            self.finish()

    def finish(self) -> None:
        if not self.active:
            return
        for tracker in self.active:
            try:
                tracker.finish()
            except Exception as e:
                self._warn(tracker, "finish", e)
        # a later record (a step recomputed after a restart) opens them again, continuing the same runs
        self.active = None
