"""Where a one-step stage run spends its time: import, Ray start, worker group, process group, model load,
DeepSpeed init, the first step, and what follows it (checkpoint, consolidation, shutdown).

    python bench/stage_startup.py                       # stage 1 and 2, Ray launcher, 2 workers
    python bench/stage_startup.py --stages 2 --launchers ray torchrun --repeats 2

Each run is the real job (`python jobs/stageN.py --config ...`, a process of its own, as `ray job submit` and
the tests start it) on a tiny HyLo (1 MLA + 1 GDN layer, hidden 32) and synthetic rows, one step, 2 workers,
ZeRO-3 over gloo: the compute is negligible, so what is measured is the start-up every run pays. The phases
come from the run's own clock (pipeline/train/startup.py, the `[train] start-up:` line and startup.json);
"after the step" is the process's wall time minus all of them. `--shared-ray` also runs the jobs of one
stage inside one Python process holding one local Ray, as a test module that shares a Ray does (the
second job's Ray start and import are then the ones to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hylo.pipeline.rehearse import make_tiny_models  # noqa: E402

PHASES = ("import", "ray start", "worker group", "process group", "model load", "deepspeed init", "first step")


def tiny_models(root: Path) -> dict[str, Path]:
    """A random 2-layer Llama (base and teacher) and its HyLo conversion, as the rehearsal and the training tests
    use (pipeline/rehearse.make_tiny_models)."""
    models = make_tiny_models(root)
    return {"base": models["teacher"], "student": models["student"]}


def config(models: dict[str, Path], storage: Path, name: str, stage: int, launcher: str) -> dict:
    cfg = {
        "model": {"student": str(models["student"]), "base": str(models["base"])},
        "data": {"source": "synthetic", "seq_len": 64, "split": f"stage{stage}",
                 "synthetic": {"rows": 48, "vocab_size": 96, "min_doc_len": 8, "max_doc_len": 40}},
        "train": {"global_batch_sequences": 4, "max_steps": 1},
        "checkpoint": {"every_steps": 3},
        "ray": {"num_workers": 2, "storage_path": str(storage), "name": name, "launcher": launcher},
    }
    if stage == 2:
        cfg["teacher"] = {"model": {"path": str(models["base"])}}
    return cfg


def one_run(models: dict[str, Path], root: Path, stage: int, launcher: str, i: int) -> dict[str, float]:
    name = f"s{stage}-{launcher}-{i}"
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(models, root / "runs", name, stage, launcher)))
    job = [str(REPO / "jobs" / f"stage{stage}.py"), "--config", str(path)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *job]
           if launcher == "torchrun" else [sys.executable, *job])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"error: {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    phases = json.loads((root / "runs" / name / "startup.json").read_text())["phases"]
    phases["after the step"] = max(0.0, wall - sum(phases.values()))
    phases["wall"] = wall
    return phases


def shared_ray_runs(models: dict[str, Path], root: Path, stage: int, repeats: int) -> list[dict[str, float]]:
    """`repeats` Ray-launched jobs in one fresh process that starts one local Ray first (a shared test Ray)."""
    code = f"""
import json, sys, time, yaml
sys.path.insert(0, {str(REPO)!r})
from hylo.pipeline.ray_init import init_ray
from hylo.pipeline.train.driver import run
init_ray(None, 4, log_to_driver=False)
out = []
for i in range({repeats}):
    t0 = time.time()
    run({stage}, ["--config", sys.argv[1 + i]])
    out.append(time.time() - t0)
print("WALLS", json.dumps(out))
"""

    paths = []
    for i in range(repeats):
        name = f"shared-s{stage}-{i}"
        p = root / f"{name}.yaml"
        p.write_text(yaml.safe_dump(config(models, root / "runs", name, stage, "ray")))
        paths.append(str(p))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code, *paths], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the shared-Ray runs failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    walls = json.loads(proc.stdout.split("WALLS", 1)[1].strip().splitlines()[0])
    out = []
    for i, wall in enumerate(walls):
        phases = json.loads((root / "runs" / f"shared-s{stage}-{i}" / "startup.json").read_text())["phases"]
        phases["import"] = 0.0  # the process was already up: the clock counts from its start
        phases["after the step"] = max(0.0, wall - sum(v for k, v in phases.items() if k != "import"))
        phases["wall"] = wall
        out.append(phases)
    return out


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    cols = list(rows)
    keys = [*PHASES, "after the step", "wall"]
    lines = ["| phase (s, median) | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for k in keys:
        vals = [statistics.median([r.get(k, 0.0) for r in rows[c]]) for c in cols]
        lines.append(f"| {k} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument("--launchers", nargs="+", default=["ray"], choices=["ray", "torchrun"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shared-ray", action="store_true", help="also run the Ray jobs of a stage in one process "
                    "holding one local Ray (--repeats of them, at least 2)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stage_startup_") as tmp:
        root = Path(tmp)
        models = tiny_models(root / "models")
        rows: dict[str, list[dict[str, float]]] = {}
        for stage in args.stages:
            for launcher in args.launchers:
                col = f"stage {stage}, {launcher}"
                rows[col] = [one_run(models, root, stage, launcher, i) for i in range(args.repeats)]
                print(f"{col}: wall {statistics.median(r['wall'] for r in rows[col]):.1f} s", flush=True)
            if args.shared_ray:
                runs = shared_ray_runs(models, root, stage, max(2, args.repeats))
                rows[f"stage {stage}, shared Ray, 1st job"] = runs[:1]
                rows[f"stage {stage}, shared Ray, later jobs"] = runs[1:]
        print(f"\n{os.cpu_count()} CPUs, torch threads per worker as configured; one step of a tiny model:\n")
        print(table(rows))


if __name__ == "__main__":
    main()
