"""Rehearse a recipe's Ray topology on a simulated multi-GPU cluster, on CPU, before it meets real GPUs.

    hylo rehearse --config llama-3.2-1b-8mla8gdn-64k.yaml [--nodes 2 --gpus-per-node 8 --cpus-per-node 64]

What a new GPU cluster usually shows first is not a numeric problem but a scheduling one: a resource
request no node can meet (the run waits forever), a worker group that does not come up. This job takes a
stage's real scaling and teacher-pool settings (ray.num_workers, cpus_per_worker, resources_per_worker,
use_gpu; teacher.pool.num_replicas, num_gpus, num_cpus, resources) and:

1. before Ray starts, places every training worker and teacher replica on the declared nodes
   (`plan_placement`: one actor's bundle never spans nodes) and refuses a topology that cannot fit with
   the arithmetic in one line (exit status 2);
2. starts `ray.cluster_utils.Cluster` with that many nodes, each declaring `--gpus-per-node` GPUs, the CPUs
   and the custom resources of the cluster file (`--cluster`, default the one the recipe names; e.g. the
   accelerator_type resource the recipe's workers ask for);
3. runs the real stage job (jobs/stageN.py, a child process joined to the cluster) for one optimiser step,
   the student and the teacher swapped for a tiny random Llama and its HyLo conversion, rows for short
   synthetic ones (a run past --timeout is stopped, and what is still pending is named);
4. checks, from the GCS's own tables, that every worker and replica was placed (and on which node), that
   the step finished, and that no actor or placement group is left pending; prints a table;
5. stage 2 with a pool it deployed (`teacher.source: serve`, `start_pool: true`): reads the row forwards its
   replicas ran (the line the driver prints when it deletes the pool, teacher/serve.py `forwards_line`) and
   checks them against the rows the step trained: one forward per row, whatever `train.sequence_parallel`
   (a group asks for each row once).

Design choices:
* Declared, not detected, GPUs: the workers see CUDA_VISIBLE_DEVICES from Ray and no CUDA device, so the
  training loop's GPU branch falls back to CPU and gloo, and says so in one line (train/loop.py
  `collective_backend`); the tiny teacher's device is `auto` (the recipe's `cuda` would stop the replica).
* Small processes: each node's object store is 100 MB, no dashboard, and Ray's prestarted idle workers (one
  per declared CPU) are off, so 2 x 64 declared CPUs cost nothing on a laptop.
* The GCS tables (`ray._private.state`), not `ray.util.state`: the state API needs the dashboard.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hylo.logs import get_logger
from hylo.pipeline.cli import (
    MAX_CPUS_PER_NODE,
    MAX_GPUS_PER_NODE,
    MAX_NODES,
    MAX_TIMEOUT_S,
    BadArgument,
    bounded_int,
    positive_finite_float,
    report_error,
)
from hylo.pipeline.config import (
    ConfigError,
    GivenOnce,
    add_config_args,
    config_file,
    maybe_print_config,
    parse_yaml,
    read_yaml_file,
)
from hylo.pipeline.paths import resolve_paths
from hylo.pipeline.ray_init import project_env
from hylo.pipeline.teacher.sources.base import ResourceDemand
from hylo.pipeline.train.config import config_to_dict, load_stage_config
from hylo.stopping import popen, reclaim, track_temp

logger = get_logger(__name__)

if TYPE_CHECKING:
    from hylo.pipeline.train.config import StageConfig

ROOT = Path(__file__).resolve().parents[1]
OBJECT_STORE_BYTES = 100 * 2**20
# Ray starts one idle Python worker per declared CPU when the first driver connects: off, see the docstring
SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
EPS = 1e-9


# ------------------------------------------------------------------------------------ arithmetic
@dataclass(frozen=True)
class Bundle:
    """One actor's resources: placed on one node as a whole."""

    what: str
    index: int
    count: int
    resources: dict[str, float]


def _fmt(v: float) -> str:
    return f"{v:g}"


def _res(resources: dict[str, float]) -> str:
    order = sorted(resources, key=lambda k: (k not in ("GPU", "CPU"), k != "GPU", k))
    return ", ".join(f"{_fmt(resources[k])} {k}" for k in order)


def plan_placement(demand: list[ResourceDemand], nodes: list[dict[str, float]]) -> list[tuple[Bundle, int]]:
    """Every actor of `demand` on a node of `nodes` (first fit, largest GPU then CPU request first; one actor
    never spans nodes); ConfigError with the arithmetic when they cannot all fit."""
    bundles = [Bundle(d.what, i + 1, d.count, {k: float(v) for k, v in d.resources.items() if v})
               for d in demand for i in range(d.count)]
    keys = sorted({k for b in bundles for k in b.resources})

    def plural(d: ResourceDemand) -> str:
        return f"{d.count} {d.what}{'s' if d.count != 1 else ''}"

    def sum_of(key: str) -> tuple[float, str]:
        parts = [(d, float(d.resources.get(key, 0.0))) for d in demand if d.count and d.resources.get(key)]
        return sum(d.count * v for d, v in parts), " + ".join(f"{plural(d)} x {_fmt(v)}" for d, v in parts)

    def per_node(key: str) -> str:
        sizes = [n.get(key, 0.0) for n in nodes]
        if len(set(sizes)) == 1:
            return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} x {_fmt(sizes[0])}"
        return " + ".join(_fmt(s) for s in sizes)

    hint = "lower " + " or ".join(d.keys for d in demand if d.keys) + ", or declare more or larger nodes"
    short = []
    for k in keys:
        need, parts = sum_of(k)
        have = sum(n.get(k, 0.0) for n in nodes)
        if need > have + EPS:
            short.append(f"{_fmt(need)} {k} ({parts}) but {per_node(k)} = {_fmt(have)} {k}")
    if short:
        raise ConfigError("this topology needs " + "; and ".join(short) + f": it cannot fit; {hint}")
    for b in bundles:
        if not any(all(n.get(k, 0.0) + EPS >= v for k, v in b.resources.items()) for n in nodes):
            big = [k for k, v in b.resources.items() if all(n.get(k, 0.0) + EPS < v for n in nodes)]
            detail = (f"{_fmt(b.resources[big[0]])} {big[0]} but a node has at most "
                      f"{_fmt(max(n.get(big[0], 0.0) for n in nodes))}" if big
                      else f"{{{_res(b.resources)}}} and no single node has all of it")
            raise ConfigError(f"one {b.what} needs {detail}: one actor cannot span nodes; {hint}")
    free = [dict(n) for n in nodes]
    placed: list[tuple[Bundle, int]] = []
    for b in sorted(bundles, key=lambda b: (-b.resources.get("GPU", 0.0), -b.resources.get("CPU", 0.0))):
        node = next((i for i, n in enumerate(free)
                     if all(n.get(k, 0.0) + EPS >= v for k, v in b.resources.items())), None)
        if node is None:
            left = "; ".join(f"node {i + 1}: {_res({k: n.get(k, 0.0) for k in b.resources})}"
                             for i, n in enumerate(free))
            raise ConfigError(f"the totals fit but the actors do not: {b.what} {b.index} of {b.count} needs "
                              f"{{{_res(b.resources)}}} and what the nodes have left is {left} "
                              f"(one actor cannot span nodes); {hint}")
        for k, v in b.resources.items():
            free[node][k] = free[node].get(k, 0.0) - v
        placed.append((b, node))
    return placed


# ---------------------------------------------------------------------------------- the nodes
def declared_node(cluster_file: Path | None, gpus: int, cpus: int) -> dict[str, float]:
    """The resources one simulated node declares: `gpus` GPUs, `cpus` CPUs, and the custom resources a
    cluster file's `ray start` commands declare (`--resources='{...}'`, e.g. accelerator_type:...)."""
    node: dict[str, float] = {"CPU": float(cpus), "GPU": float(gpus)}
    if cluster_file is None:
        return node
    data = read_cluster_file(cluster_file)
    commands = data.get("worker_start_ray_commands") or []
    if not isinstance(commands, list):
        raise ConfigError(f"cluster file {cluster_file}: worker_start_ray_commands must be a list of commands, "
                          f"got {type(commands).__name__}")
    commands = " ".join(str(c) for c in commands)
    found = re.search(r"--resources='([^']*)'", commands)
    if found:
        try:
            node.update({str(k): float(v) for k, v in json.loads(found.group(1)).items()})
        except (ValueError, AttributeError) as e:
            raise ConfigError(f"cluster file {cluster_file}: worker_start_ray_commands: --resources is not a "
                              f"JSON mapping of numbers: {e}") from None
    return node


def read_cluster_file(path: Path, flag: str = "cluster file") -> dict[str, Any]:
    """The mapping of a Ray cluster file; a directory, a device or pipe, a missing file or one whose top level is
    not a YAML mapping is a ConfigError naming it (its depth and aliases bounded as a config's)."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory, not a cluster file (cluster/*.yaml)")
    try:
        text = read_yaml_file(path, flag)
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: does not exist") from None
    data = parse_yaml(text, f"{flag} {path}")
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: not a YAML mapping (a Ray cluster file such as cluster/*.yaml), its top "
                          f"level is {'empty' if data is None else type(data).__name__}")
    return data


def cluster_file_of(recipe: Path) -> Path | None:
    """The cluster file a recipe names in its comments (cluster/NAME.yaml), if it exists."""
    try:
        text = recipe.read_text()
    except OSError:
        return None
    found = re.search(r"cluster/([\w.-]+\.yaml)", text)
    path = ROOT / "cluster" / found.group(1) if found else None
    return path if path is not None and path.is_file() else None


# ------------------------------------------------------------------------------- the tiny models
def make_tiny_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """A random 2-layer Llama (the teacher; vocabulary 96, hidden 32) with a word-level tokenizer, and its
    HyLo conversion (MLA on even layers, GDN on odd ones): the student."""
    import torch  # lazy: torch
    from tokenizers import Tokenizer  # lazy: tokenizers
    from tokenizers.models import WordLevel  # lazy: tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: transformers

    from hylo.io import save_hylo  # lazy: transformers
    from hylo.upcycle import load_base_model, upcycle  # lazy: torch

    base = root / "teacher"
    base.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(base, safe_serialization=True)
    Tokenizer(WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0")).save(str(base / "tokenizer.json"))
    student = upcycle(load_base_model(base), mla_layers="even", kv_lora_rank=16, gdn_head_dim=8, gdn_num_heads=4)
    save_hylo(student, root / "student", tokenizer_from=base)
    return {"teacher": base, "student": root / "student"}


def tiny_overrides(stage: int, models: dict[str, Path], storage: Path, port: int) -> list[str]:
    """What the rehearsal changes in the recipe: the models, the rows, the storage, one step. Scaling
    (ray.num_workers, cpus_per_worker, resources_per_worker, use_gpu) and the teacher pool stay."""
    sets = {"model.student": str(models["student"]), "model.base": str(models["teacher"]),
            "model.dtype": "float32", "model.convert": None,
            "data.source": "synthetic", "data.path": None, "data.seq_len": 64,
            "data.synthetic": {"rows": 64, "vocab_size": 96, "min_doc_len": 8, "max_doc_len": 40},
            "train.max_steps": 1, "train.total_steps": 1,
            "ray.address": None, "ray.launcher": "ray", "ray.storage_path": str(storage), "ray.max_failures": 0,
            "checkpoint.consolidate": False}
    if stage == 2:
        sets |= {"teacher.model.path": str(models["teacher"]), "teacher.model.device": "auto",
                 "teacher.model.dtype": "float32", "teacher.model.tokenizer": None,
                 "teacher.pool.port": port, "teacher.pool.max_batch_tokens": 256}
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


# ------------------------------------------------------------------------------ the GCS's view
@dataclass
class Seen:
    """What the rehearsal saw of the actors and placement groups while the run ran."""

    actors: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending_pgs: dict[str, str] = field(default_factory=dict)

    def poll(self) -> None:
        from ray._private import state  # lazy: ray
        from ray.util import placement_group_table  # lazy: ray

        for actor_id, a in state.actors().items():
            node = (a.get("Address") or {}).get("NodeID") or ""
            prev = self.actors.get(actor_id, {})
            self.actors[actor_id] = {"class": a.get("ActorClassName", ""), "name": a.get("Name", ""),
                                     "state": a.get("State", ""), "node": node or prev.get("node", ""),
                                     "pid": a.get("Pid") or prev.get("pid")}
        for pg_id, pg in placement_group_table().items():
            if pg.get("state") in ("PENDING", "RESCHEDULING"):
                self.pending_pgs[pg_id] = pg.get("state", "")
            else:
                self.pending_pgs.pop(pg_id, None)

    def pending_actors(self) -> list[dict[str, Any]]:
        return [a for a in self.actors.values()
                if a["state"] in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING")]


@contextlib.contextmanager
def watching(seen: Seen, every_s: float = 0.5) -> Iterator[None]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(Exception):
                seen.poll()

    t = threading.Thread(target=loop, name="rehearse-watch", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def kind_of(actor: dict[str, Any], pool_app: str | None) -> str | None:
    """What an actor of the GCS's table is to the run: a Ray Train worker, a replica of the teacher pool's Serve
    app (class `ServeReplica:<app>:<deployment>`), or neither (controllers, proxies)."""
    if actor["class"] == "RayTrainWorker":
        return "train worker"
    if pool_app is not None and actor["class"].startswith(f"ServeReplica:{pool_app}:"):
        return "teacher replica"
    return None


# ---------------------------------------------------------------------------------- the job
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n"
        "    hylo rehearse --config llama-3.2-1b-8mla8gdn-64k.yaml\n"
        "    hylo rehearse --config qwen3-1.7b-7mla21gdn-64k.yaml --nodes 1 --gpus-per-node 8 --check-only\n\n"
        "The fit arithmetic runs before Ray starts (exit 2 when the topology cannot fit); then one step on\n"
        "a simulated cluster with tiny models. pipeline/rehearse.py says what it changes and checks.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_config_args(p, example="ray.num_workers=4")
    p.add_argument("--stage", type=bounded_int(1, 2), default=2, help="the stage to rehearse (default 2)")
    p.add_argument("--nodes", type=bounded_int(1, MAX_NODES), default=2,
                   help=f"simulated nodes (default 2, at most {MAX_NODES:,})")
    p.add_argument("--gpus-per-node", type=bounded_int(0, MAX_GPUS_PER_NODE), default=8,
                   help=f"GPUs each node declares (default 8, at most {MAX_GPUS_PER_NODE})")
    p.add_argument("--cpus-per-node", type=bounded_int(1, MAX_CPUS_PER_NODE), default=64,
                   help=f"CPUs each node declares (default 64; a real node's core count; at most {MAX_CPUS_PER_NODE:,})")
    p.add_argument("--cluster", type=str, default=None, action=GivenOnce,
                   help="cluster file whose custom resources every node declares (default: the cluster/*.yaml "
                        "the recipe names, if any)")
    p.add_argument("--check-only", action="store_true", help="only the fit arithmetic; Ray is not started")
    p.add_argument("--timeout", type=positive_finite_float(MAX_TIMEOUT_S), default=900.0,
                   help="seconds the step may take before whatever is still pending is reported (default 900; "
                        f"at most {MAX_TIMEOUT_S:g}, a week)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipe = config_file(args.config) if args.config else None
    cfg = load_stage_config(args.stage, recipe, args.overrides)
    maybe_print_config(cfg, args)
    # the driver imports the training stack (torch, Ray): after --help and --print-config answered
    from hylo.pipeline.train.driver import resource_demand  # lazy: torch

    cfg = resolve_paths(cfg)
    cluster_path = Path(args.cluster) if args.cluster else cluster_file_of(recipe) if recipe else None
    try:
        node = declared_node(cluster_path, args.gpus_per_node, args.cpus_per_node)
    except ConfigError as e:
        if not args.cluster:
            raise
        raise BadArgument(f"--cluster: {str(e).removeprefix('cluster file ')}") from None
    nodes = [dict(node) for _ in range(args.nodes)]
    demand = resource_demand(cfg)
    label = f"{recipe or 'the default config'} (stage {args.stage}) on {args.nodes} node(s) of {{{_res(node)}}}"
    try:
        plan = plan_placement(demand, nodes)
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}") from None
    print(f"[rehearse] {label}" + (f" (custom resources from {cluster_path.relative_to(ROOT)})"
                                   if cluster_path and cluster_path.is_relative_to(ROOT) else ""), flush=True)
    for d in demand:
        print(f"[rehearse]   {d.count} x {d.what}: {{{_res(d.resources)}}}", flush=True)
    used = {k: sum(b.resources.get(k, 0.0) for b, _ in plan) for k in ("GPU", "CPU")}
    print(f"[rehearse] fits: {_fmt(used['GPU'])} of {_fmt(node['GPU'] * args.nodes)} GPU, {_fmt(used['CPU'])} of "
          f"{_fmt(node['CPU'] * args.nodes)} CPU", flush=True)
    if args.check_only:
        return 0

    try:
        report = rehearse(cfg, nodes, args.timeout)
    except RehearsalError as e:
        report_error(f"rehearsal of {label} failed: {e}")
        return 1
    print_report(report)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def simulated_cluster(nodes: list[dict[str, float]]) -> Iterator[Any]:
    """`ray.cluster_utils.Cluster` of `nodes` (the first is the head), connected; torn down after."""
    import ray  # lazy: ray
    from ray.cluster_utils import Cluster  # lazy: ray

    def args(n: dict[str, float]) -> dict[str, Any]:
        custom = {k: v for k, v in n.items() if k not in ("CPU", "GPU")}
        return {"num_cpus": int(n["CPU"]), "num_gpus": int(n["GPU"]), "resources": custom,
                "object_store_memory": OBJECT_STORE_BYTES}

    saved = {k: os.environ.get(k) for k in project_env()}
    os.environ.update(project_env())
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={**args(nodes[0]), "include_dashboard": False, "_system_config": SYSTEM_CONFIG})
    # ray.init (connect=True) replaced the signal rule's SIGTERM handler
    reclaim()
    try:
        for n in nodes[1:]:
            cluster.add_node(**args(n))
        cluster.wait_for_nodes()
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            from ray import serve  # lazy: ray

            if ray.is_initialized():
                serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rehearse(recipe: StageConfig, nodes: list[dict[str, float]], timeout_s: float) -> dict[str, Any]:
    """One step of the stage of `recipe` (a loaded config) on a simulated cluster of `nodes`, its models and
    rows swapped for tiny ones (`tiny_overrides`); what was placed where (see the module docstring). Raises
    RehearsalError when something was not placed, stayed pending or the step did not happen."""
    import ray  # lazy: ray

    from hylo.pipeline.train import driver  # lazy: torch
    from hylo.pipeline.train.metrics import read_metrics  # lazy: torch
    from hylo.pipeline.train.storage import run_dir  # lazy: pyarrow

    t0 = time.time()
    work = track_temp(tempfile.mkdtemp(prefix="hylo-rehearse-"))
    try:
        logger.info("[rehearse] tiny teacher (random Llama, 2 layers) and its HyLo student")
        models = make_tiny_models(work / "models")
        stage = recipe.stage
        given = work / "recipe.yaml"
        given.write_text(yaml.safe_dump(config_to_dict(recipe), sort_keys=False))
        cfg = load_stage_config(stage, given, tiny_overrides(stage, models, work / "runs", free_port()))
        expect = {d.what: d.count for d in driver.resource_demand(cfg) if d.count}
        path = work / "rehearsal.yaml"
        path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        seen = Seen()
        with simulated_cluster(nodes) as cluster:
            # node 1 is the head, the others in the order they joined
            head = ray.get_runtime_context().get_node_id()
            others = [n["NodeID"] for n in ray.nodes() if n["NodeID"] != head]
            names = {nid: i + 1 for i, nid in enumerate([head, *others])}
            t_ray = time.time()
            pool = cfg.teacher.pool.app_name if stage == 2 and cfg.teacher.source == "serve" \
                and cfg.teacher.start_pool else None
            with watching(seen):
                rc, last, forwards = run_stage_job(stage, path, cluster.address, timeout_s, pool)
                seen.poll()
            if rc is None:
                raise RehearsalError(f"no step within --timeout {timeout_s:g} s; " + describe_pending(seen, names))
            if rc == 2:
                raise ConfigError(last.removeprefix("error: "))
            if rc != 0:
                raise RehearsalError(f"the stage-{stage} job exited with status {rc}: {last}")
            metrics = read_metrics(run_dir(cfg))
        seconds = time.time() - t0
        app = cfg.teacher.pool.app_name if stage == 2 else None
        placed = [(kind_of(a, app), names.get(a["node"], 0), a) for a in seen.actors.values()
                  if kind_of(a, app) and a["node"] in names]
        problems = []
        for what, n in expect.items():
            got = sum(1 for k, _, _ in placed if k == what)
            if got != n:
                problems.append(f"{got} of {n} {what}s placed")
        if max(metrics or [0]) < 1:
            problems.append("no optimiser step recorded in metrics.jsonl")
        if seen.pending_actors() or seen.pending_pgs:
            problems.append(describe_pending(seen, names))
        teacher = None
        if pool is not None and forwards is None:
            problems.append(f"the stage-2 job printed no row forwards of its teacher pool {pool!r}")
        elif forwards is not None and metrics:
            teacher = teacher_forwards(forwards, list(metrics.values()), cfg.train.sequence_parallel)
            if teacher["forwards"] != teacher["rows"]:
                problems.append(forwards_problem(teacher))
        if problems:
            raise RehearsalError("; ".join(problems))
        each = {d.what: d.resources for d in driver.resource_demand(cfg)}
        return {"stage": stage, "each": each, "nodes": nodes, "placed": placed, "teacher": teacher,
                "step": metrics[max(metrics)], "seconds": seconds, "ray_seconds": time.time() - t_ray,
                "wire": recipe_wire(recipe)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def recipe_wire(recipe: StageConfig) -> str | None:
    """The recipe's Serve pool teacher on the wire per row of data.seq_len, in each form, at the recipe's own teacher
    (pipeline/estimate/wire.py); None without a pool or a row length."""
    if recipe.stage != 2 or recipe.teacher.source != "serve" or not recipe.data.seq_len:
        return None
    from hylo.pipeline.estimate.shapes import model_config  # lazy: torch
    from hylo.pipeline.estimate.wire import format_wire, teacher_wire  # lazy: torch

    t = recipe.teacher
    wire = teacher_wire(t, model_config(t.model.path, "teacher.model.path"), recipe.data.seq_len)
    return format_wire(wire, t.form, t.model.dtype, t.client.dtype)


def teacher_forwards(forwards: int, records: list[dict[str, Any]], sp: int) -> dict[str, int]:
    """The pool's row forwards against the rows the steps trained (`records`: metrics.jsonl's; the workers of a
    group list the same rows, so a row is counted once per step) and the requests of workers asking for their
    own ranges alone (N per row)."""
    rows = sum(len({k for worker in r["rows"] for k in worker}) for r in records)
    asked = sum(len(worker) for r in records for worker in r["rows"])
    return {"forwards": forwards, "rows": rows, "asked": asked, "sp": sp}


def forwards_problem(t: dict[str, int]) -> str:
    return (f"the teacher pool ran {t['forwards']} row forwards for {t['rows']} rows at train.sequence_parallel="
            f"{t['sp']}: expected one per row per group")


def run_stage_job(stage: int, config: Path, address: str, timeout_s: float,
                  pool: str | None = None) -> tuple[int | None, str, int | None]:
    """`python -m hylo.jobs.stageN --config CONFIG` joined to the simulated cluster, its output passed through;
    (exit status or None after `timeout_s`, its last line on stderr, the row forwards of teacher pool `pool` it
    printed or None). A child process, not a thread: a run that does not finish is stopped (SIGTERM, then
    SIGKILL) before the cluster goes, as a job on a real cluster."""
    from hylo.pipeline.teacher.serve import forwards_in  # lazy: torch

    env = {**os.environ, "RAY_ADDRESS": address}
    # under the signal rule (hylo/stopping.py): its own process group, ended with the rehearsal
    proc = popen([sys.executable, "-m", f"hylo.jobs.stage{stage}", "--config", str(config)],
                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    lines: list[str] = []
    forwards: list[int] = []

    def echo() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.strip():
                lines.append(line.rstrip())
            # the driver logs the pool's forwards (a log line, on stderr) when it deletes the pool
            found = forwards_in(line, pool) if pool is not None else None
            if found is not None:
                forwards.append(found)

    def echo_out() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=echo, name="rehearse-stderr", daemon=True)
    reader.start()
    out_reader = threading.Thread(target=echo_out, name="rehearse-stdout", daemon=True)
    out_reader.start()
    try:
        rc: int | None = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        for stop in (proc.terminate, proc.terminate, proc.kill):
            stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
                break
    reader.join(5)
    out_reader.join(5)
    return rc, (lines[-1] if lines else ""), (forwards[-1] if forwards else None)


class RehearsalError(RuntimeError):
    """Something was not placed, stayed pending, or the step did not happen."""


def describe_pending(seen: Seen, names: dict[str, int]) -> str:
    pending = [f"{a['class'] or a['name']} ({a['state']})" for a in seen.pending_actors()]
    pgs = [f"placement group {pg[:8]} ({st})" for pg, st in seen.pending_pgs.items()]
    return "still pending: " + (", ".join(pending + pgs) or "nothing")


def print_report(r: dict[str, Any]) -> None:
    per_node: dict[int, list[str]] = {}
    for what, node, _ in sorted(r["placed"], key=lambda p: (p[1], p[0])):
        per_node.setdefault(node, []).append(what)
    print(f"[rehearse] placed ({len(r['placed'])} actors):", flush=True)
    print("[rehearse]   node | train workers | teacher replicas | GPU used | CPU used", flush=True)
    for node, declared in enumerate(r["nodes"], start=1):
        kinds = per_node.get(node, [])
        used = {k: sum(r["each"][w].get(k, 0.0) for w in kinds) for k in ("GPU", "CPU")}
        print(f"[rehearse]   {node:>4} | {kinds.count('train worker'):>13} | {kinds.count('teacher replica'):>16} | "
              f"{_fmt(used['GPU']):>3} of {_fmt(declared['GPU']):<2} | {_fmt(used['CPU']):>3} of {_fmt(declared['CPU'])}",
              flush=True)
    t = r.get("teacher")
    if t is not None:
        print(f"[rehearse] teacher forwards: {t['forwards']} for {t['rows']} rows x {t['sp']} ranks "
              f"(one per row per group; a forward per rank would be {t['asked']})", flush=True)
    if r.get("wire"):
        for line in r["wire"].splitlines():
            print(f"[rehearse] {line}", flush=True)
    print(f"[rehearse] ok: every actor placed, step 1 done (loss {r['step']['loss']:.4f}), nothing pending; "
          f"{r['seconds']:.0f} s ({r['ray_seconds']:.0f} s with Ray)", flush=True)
