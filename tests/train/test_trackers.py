"""Optional W&B / MLflow trackers (pipeline/train/trackers.py).

Neither package is a dependency (the `trackers` extra), so the tests put recording fakes with the
same call signatures in their place: in sys.modules for the units, and as importable packages on
PYTHONPATH for the torchrun end-to-end run, which goes through the real job, driver and metrics hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import config_to_dict, load_stage_config
from hylo.pipeline.train.metrics import MetricsWriter, read_metrics

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo-smollm2.yaml"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []


def fake_wandb(rec: Recorder, fail_log: bool = False) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    class Run:
        def __init__(self, run_id: str) -> None:
            self.id = run_id

        def log(self, data, step=None):
            if fail_log:
                raise ConnectionError("api.wandb.ai unreachable")
            rec.calls.append(("log", step, dict(data)))

        def finish(self):
            rec.calls.append(("finish",))

    def init(project=None, entity=None, mode=None, name=None, dir=None, config=None, id=None, resume=None):
        rec.calls.append(("init", {"project": project, "entity": entity, "mode": mode, "name": name, "dir": dir,
                                   "config": config, "id": id, "resume": resume}))
        return Run(id or "wandb-run-1")

    mod.init = init
    return mod


def fake_mlflow(rec: Recorder) -> types.ModuleType:
    mod = types.ModuleType("mlflow")
    mod.set_tracking_uri = lambda uri: rec.calls.append(("set_tracking_uri", uri))
    mod.set_experiment = lambda name: rec.calls.append(("set_experiment", name))

    def start_run(run_id=None, run_name=None):
        rec.calls.append(("start_run", run_id, run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "mlflow-run-1"))

    mod.start_run = start_run
    mod.log_params = lambda params: rec.calls.append(("log_params", dict(params)))
    mod.log_metrics = lambda metrics, step=None: rec.calls.append(("log_metrics", step, dict(metrics)))
    mod.end_run = lambda: rec.calls.append(("end_run",))
    return mod


def record(step: int, loss: float) -> dict:
    return {"step": step, "stage": 2, "loss": loss, "kl": loss, "lr": 1e-4, "grad_norm": 0.5, "tokens_per_s": 100.0,
            "mem_peak_mib": 512.0, "loss_tokens": 40, "attempt": 0, "data_position": {"row": step}}


def write_run_config(run_dir: Path, *overrides: str) -> dict:
    cfg = config_to_dict(load_stage_config(2, DEMO, list(overrides)))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_stage2.json").write_text(json.dumps(cfg))
    return cfg


# --------------------------------------------------------------------------------------- config
def test_trackers_are_off_by_default():
    cfg = load_stage_config(2, DEMO)
    assert cfg.metrics.wandb is None and cfg.metrics.mlflow is None


@pytest.mark.parametrize("key,module", [("metrics.wandb.project=p", "wandb"), ("metrics.mlflow.experiment=e", "mlflow")])
def test_missing_package_is_one_clear_error_at_config_load(monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed, whatever this machine has
    with pytest.raises(ConfigError, match=rf"metrics.{module} is set but the `{module}` package is not installed: "
                                          r"pip install 'hylo-pipeline\[trackers\]'"):
        load_stage_config(2, DEMO, [key])


@pytest.mark.slow
def test_missing_package_stops_the_job_with_one_error_line():
    # the job as a user runs it, with mlflow made unimportable whatever this machine has installed
    code = ("import runpy, sys; sys.modules['mlflow'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "jobs/stage2.py", "--config", str(DEMO), "--set",
                           "metrics.mlflow.experiment=e", "--print-config"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "metrics.mlflow" in lines[0] and "pip install 'hylo-pipeline[trackers]'" in lines[0]
    assert proc.stdout == ""


def test_wandb_mode_is_checked(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(Recorder()))
    with pytest.raises(ConfigError, match="metrics.wandb.mode='cloud'; allowed: online, offline, disabled"):
        load_stage_config(2, DEMO, ["metrics.wandb.mode=cloud"])


# --------------------------------------------------------------------------------------- units
def test_wandb_gets_config_once_every_step_and_finish(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(rec))
    run = tmp_path / "stage2"
    cfg = write_run_config(run, "metrics.wandb.project=hylo", "metrics.wandb.entity=team", "metrics.wandb.mode=offline")
    w = MetricsWriter(run, total_steps=2, tensorboard=False)
    w.write(record(1, 3.0))
    w.write(record(2, 2.5))
    assert [c[0] for c in rec.calls] == ["init", "log", "log", "finish"]
    init = rec.calls[0][1]
    assert init == {"project": "hylo", "entity": "team", "mode": "offline", "name": "stage2", "dir": str(run),
                    "config": cfg, "id": None, "resume": None}
    assert rec.calls[1] == ("log", 1, {"train/loss": 3.0, "train/kl": 3.0, "train/lr": 1e-4, "train/grad_norm": 0.5,
                                       "train/tokens_per_s": 100.0, "train/mem_peak_mib": 512.0,
                                       "train/loss_tokens": 40.0, "train/attempt": 0.0})
    assert rec.calls[2][1] == 2 and rec.calls[2][2]["train/loss"] == 2.5
    # the JSONL record is written as before
    assert read_metrics(run)[2]["loss"] == 2.5
    assert json.loads((run / "trackers.json").read_text()) == {"wandb": "wandb-run-1"}


def test_resumed_run_continues_the_same_tracker_runs(monkeypatch, tmp_path):
    wrec, mrec = Recorder(), Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(wrec))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(mrec))
    run = tmp_path / "stage2"
    write_run_config(run, "metrics.wandb.project=hylo", "metrics.mlflow.tracking_uri=file:///tmp/mlruns",
                     "metrics.mlflow.experiment=hylo-demo")
    first = MetricsWriter(run, total_steps=4, tensorboard=False)
    first.write(record(1, 3.0))
    first.write(record(2, 2.9))  # the job stops here (no finish)
    # a new process resumes from step 2's checkpoint and recomputes step 3 onwards
    resumed = MetricsWriter(run, total_steps=4, tensorboard=False)
    resumed.write(record(3, 2.8))
    resumed.close()
    inits = [c[1] for c in wrec.calls if c[0] == "init"]
    assert [(i["id"], i["resume"]) for i in inits] == [(None, None), ("wandb-run-1", "allow")]
    assert mrec.calls[:3] == [("set_tracking_uri", "file:///tmp/mlruns"), ("set_experiment", "hylo-demo"),
                              ("start_run", None, "stage2")]
    params = mrec.calls[3][1]
    assert params["metrics.mlflow.experiment"] == "hylo-demo" and params["optim.lr"] == "0.0001"
    assert params["data.split"] == "stage2" and params["ray.name"] == "stage2"
    # the resumed run reopens the run by id and logs no params again (MLflow refuses changed params)
    starts = [c for c in mrec.calls if c[0] == "start_run"]
    assert starts == [("start_run", None, "stage2"), ("start_run", "mlflow-run-1", None)]
    assert sum(c[0] == "log_params" for c in mrec.calls) == 1
    assert [c[1] for c in mrec.calls if c[0] == "log_metrics"] == [1, 2, 3]
    assert mrec.calls[-1] == ("end_run",) and wrec.calls[-1] == ("finish",)


def test_no_tracker_configured_touches_nothing(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(rec))
    run = tmp_path / "stage2"
    write_run_config(run)
    w = MetricsWriter(run, total_steps=1, tensorboard=False)
    w.write(record(1, 3.0))
    w.close()
    assert rec.calls == [] and not (run / "trackers.json").exists()


def test_a_failing_tracker_never_stops_training(monkeypatch, tmp_path, capsys):
    rec = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(rec, fail_log=True))
    run = tmp_path / "stage2"
    write_run_config(run, "metrics.wandb.project=hylo")
    w = MetricsWriter(run, total_steps=3, tensorboard=False)
    for s in (1, 2, 3):
        w.write(record(s, 3.0 - s / 10))
    err = capsys.readouterr().err
    assert err.count("wandb: log failed (ConnectionError: api.wandb.ai unreachable)") == 1
    assert "metrics.jsonl is unaffected" in err
    assert list(read_metrics(run)) == [1, 2, 3]


# ----------------------------------------------------------------------------------- end to end
FAKE_MLFLOW_PACKAGE = '''
"""Recording stand-in for mlflow's fluent API (tests only): appends each call to $FAKE_MLFLOW_LOG."""
import json, os


def _rec(*call):
    with open(os.environ["FAKE_MLFLOW_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), *call]) + "\\n")


class _Info:
    def __init__(self, run_id):
        self.run_id = run_id


class _Run:
    def __init__(self, run_id):
        self.info = _Info(run_id)


def set_tracking_uri(uri):
    _rec("set_tracking_uri", uri)


def set_experiment(name):
    _rec("set_experiment", name)


def start_run(run_id=None, run_name=None):
    _rec("start_run", run_id, run_name)
    return _Run(run_id or "run-%d" % os.getpid())


def log_params(params):
    _rec("log_params", sorted(params))


def log_metrics(metrics, step=None):
    _rec("log_metrics", step, metrics)


def end_run():
    _rec("end_run")
'''


@pytest.mark.slow
def test_torchrun_stage2_logs_every_step_to_mlflow(tmp_path):
    """The real job: config from YAML + --set, the driver writes the run config, rank 0's MetricsWriter
    feeds the tracker; one process logs, every step once, then ends the run."""
    from tests.helpers.train import make_tiny_models, tiny_config, write_config

    fake = tmp_path / "fakes" / "mlflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent(FAKE_MLFLOW_PACKAGE))
    models = make_tiny_models(tmp_path / "models")
    cfg = write_config(tiny_config(models, tmp_path / "runs", "tracked", train={"max_steps": 3}), tmp_path / "c.yaml")
    log = tmp_path / "mlflow_calls.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "fakes")]),
           "FAKE_MLFLOW_LOG": str(log),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "hylo" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "jobs/stage2.py", "--config", str(cfg), "--set", "metrics.mlflow.tracking_uri=file:///nowhere",
           "--set", "metrics.mlflow.experiment=e2e"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({c[0] for c in calls}) == 1, "only rank 0 logs"
    names = [c[1] for c in calls]
    assert names == ["set_tracking_uri", "set_experiment", "start_run", "log_params",
                     "log_metrics", "log_metrics", "log_metrics", "end_run"], names
    assert calls[0][2] == "file:///nowhere" and calls[1][2] == "e2e" and calls[2][3] == "tracked"
    assert "metrics.mlflow.experiment" in calls[3][2] and "optim.lr" in calls[3][2]
    jsonl = read_metrics(tmp_path / "runs" / "tracked")
    for c in calls[4:7]:
        step, metrics = c[2], c[3]
        assert metrics["train/loss"] == pytest.approx(jsonl[step]["loss"], rel=1e-12)
    assert [c[2] for c in calls[4:7]] == [1, 2, 3]


def test_a_record_restored_from_the_checkpoint_reaches_tensorboard_and_the_trackers(monkeypatch, tmp_path):
    """Step 4's line was torn by a kill; the resume puts it back into metrics.jsonl from the checkpoint, and
    TensorBoard and W&B get it too (before, only the file did: both had a hole at step 4)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(rec))
    run = tmp_path / "stage2"
    write_run_config(run, "metrics.wandb.project=hylo", "metrics.wandb.mode=offline")
    records = [record(s, 3.0 - 0.1 * s) for s in (1, 2, 3, 4)]
    first = MetricsWriter(run, total_steps=6, tensorboard=True, stream=open(os.devnull, "w"))
    for r in records[:3]:
        first.write(r)
    first.close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(records[3])[:30])  # killed while appending step 4's line: no TB event, no W&B log
    rec.calls.clear()
    resumed = MetricsWriter(run, total_steps=6, tensorboard=True, stream=open(os.devnull, "w"))
    resumed.restart_at(4, restore=records[2:4])
    for s in (5, 6):
        resumed.write(record(s, 2.0))
    resumed.close()
    assert [c[1] for c in rec.calls if c[0] == "log"] == [4, 5, 6]
    assert rec.calls[[c[0] for c in rec.calls].index("log")][2]["train/loss"] == records[3]["loss"]
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert list(read_metrics(run)) == [1, 2, 3, 4, 5, 6]
