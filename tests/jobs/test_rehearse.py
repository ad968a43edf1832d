"""`hylo rehearse`: a recipe's Ray topology checked against declared nodes, then rehearsed on a simulated
cluster (pipeline/rehearse.py).

* The fit arithmetic (no Ray): the shipped 64K recipes' stage-2 workers and teacher replicas on two 8-GPU
  nodes of their cluster file; a topology whose totals exceed the nodes, an actor larger than any node, and
  actors that fit in total but not node by node are refused with the numbers, through `hylo rehearse` as
  one line and exit status 2 before anything starts.
* Declared GPUs without CUDA: Ray Train's backend and the worker's device follow `collective_backend`,
  gloo on CPU with one line saying why (Ray's own choice, NCCL, cannot start on a torch without CUDA).
* Slow: one rehearsal of the smallest recipe on two simulated 8-GPU nodes (tiny models, one step).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hylo.pipeline.config import ConfigError
from hylo.pipeline.rehearse import cluster_file_of, declared_node, plan_placement
from hylo.pipeline.teacher.sources.base import ResourceDemand

from tests.helpers.logs import messages

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "configs").glob("*-64k.yaml"))
ACCEL = "accelerator_type:AMD-Instinct-MI300X-OAM"


def _demand(recipe: Path, stage: int = 2) -> list[ResourceDemand]:
    from hylo.pipeline.train.config import load_stage_config
    from hylo.pipeline.train.driver import resource_demand

    return resource_demand(load_stage_config(stage, recipe))


def _workers(n: int, **res: float) -> ResourceDemand:
    return ResourceDemand("train worker", n, res, "ray.num_workers / ray.cpus_per_worker")


def _replicas(n: int, **res: float) -> ResourceDemand:
    return ResourceDemand("teacher replica", n, res, "teacher.pool.num_replicas / teacher.pool.num_gpus")


def test_the_64k_recipes_are_the_three_shipped():
    assert [p.name for p in RECIPES] == ["llama-3.2-1b-8mla8gdn-64k.yaml", "llama-3.2-3b-14mla14gdn-64k.yaml",
                                         "qwen3-1.7b-7mla21gdn-64k.yaml"]


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_each_recipe_places_on_two_8_gpu_nodes_of_its_cluster_file(recipe):
    cluster = cluster_file_of(recipe)
    assert cluster == REPO / "cluster" / "mi300x.yaml"
    node = declared_node(cluster, gpus=8, cpus=64)
    assert node == {"CPU": 64.0, "GPU": 8.0, ACCEL: 1.0}
    demand = _demand(recipe)
    assert [(d.what, d.count) for d in demand] == [("train worker", 4), ("teacher replica", 4)]
    plan = plan_placement(demand, [node, node])
    assert sorted((b.what, b.index) for b, _ in plan) == [(w, i) for w in ("teacher replica", "train worker")
                                                           for i in range(1, 5)]
    for n in (0, 1):
        on = [b for b, at in plan if at == n]
        for k, have in node.items():
            assert sum(b.resources.get(k, 0.0) for b in on) <= have + 1e-9, (n, k)
    # without the cluster file's accelerator resource the workers' request can never be met
    with pytest.raises(ConfigError, match=rf"0.004 {ACCEL} \(4 train workers x 0.001\) but 2 nodes x 0 = 0"):
        plan_placement(demand, [{"CPU": 64.0, "GPU": 8.0}] * 2)


def test_totals_that_exceed_the_nodes_are_refused_with_the_sum():
    demand = [_workers(4, GPU=1, CPU=8), _replicas(4, GPU=1, CPU=8)]
    with pytest.raises(ConfigError) as e:
        plan_placement(demand, [{"GPU": 8.0, "CPU": 16.0}] * 2)
    msg = str(e.value)
    assert "64 CPU (4 train workers x 8 + 4 teacher replicas x 8) but 2 nodes x 16 = 32 CPU" in msg, msg
    assert "GPU" not in msg.split(":")[0] and "lower ray.num_workers" in msg
    with pytest.raises(ConfigError, match=r"needs 8 GPU \(4 train workers x 1 \+ 4 teacher replicas x 1\) but "
                                          r"1 node x 4 = 4 GPU"):
        plan_placement(demand, [{"GPU": 4.0, "CPU": 64.0}])


def test_one_actor_cannot_span_nodes():
    # 2 GPUs in total, but one worker needs both and each node has one
    with pytest.raises(ConfigError, match="one train worker needs 2 GPU but a node has at most 1: one actor "
                                          "cannot span nodes"):
        plan_placement([_workers(1, GPU=2, CPU=1)], [{"GPU": 1.0, "CPU": 8.0}] * 2)
    # 9 of 10 GPUs, every worker fits a node, but only one worker of 3 GPUs fits in each node of 5
    with pytest.raises(ConfigError) as e:
        plan_placement([_workers(3, GPU=3, CPU=1)], [{"GPU": 5.0, "CPU": 8.0}] * 2)
    assert ("the totals fit but the actors do not: train worker 3 of 3 needs {3 GPU, 1 CPU} and what the nodes "
            "have left is node 1: 2 GPU, 7 CPU; node 2: 2 GPU, 7 CPU") in str(e.value), str(e.value)
    # the same workers on nodes of 6 GPUs: two on the first, one on the second
    plan = plan_placement([_workers(3, GPU=3, CPU=1)], [{"GPU": 6.0, "CPU": 8.0}] * 2)
    assert sorted(at for _, at in plan) == [0, 0, 1]


def test_hylo_rehearse_refuses_before_ray_starts(capsys, monkeypatch):
    from hylo.pipeline.cli import hylo_main

    def no_ray(*a, **k):
        raise AssertionError("the rehearsal started although the topology cannot fit")

    monkeypatch.setattr("hylo.pipeline.rehearse.rehearse", no_ray)
    rc = hylo_main(["rehearse", "--config", str(RECIPES[0]), "--cpus-per-node", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {RECIPES[0]} (stage 2) on 2 node(s) of {{8 GPU, 16 CPU, 1 {ACCEL}}}: this "
                             "topology needs 64 CPU (4 train workers x 8 + 4 teacher replicas x 8) but 2 nodes x 16 "
                             "= 32 CPU"), err
    rc = hylo_main(["rehearse", "--config", str(RECIPES[0]), "--check-only"])
    out = capsys.readouterr().out
    assert rc == 0 and "[rehearse] fits: 8 of 16 GPU, 64 of 128 CPU" in out, out


def test_declared_gpus_without_cuda_choose_gloo_and_say_why(monkeypatch):
    import torch

    from hylo.pipeline.train.collective import collective_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    backend, note = collective_backend(True)
    assert backend == "gloo" and "CUDA_VISIBLE_DEVICES=2,3" in note and "gloo instead of NCCL" in note
    assert collective_backend(False) == ("gloo", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert collective_backend(True) == ("nccl", None)


def test_ray_trains_backend_follows_the_worker(monkeypatch, capsys):
    """Ray Train's own choice with GPUs requested is NCCL, which a torch without CUDA cannot start; the driver's
    TorchConfig asks the first worker instead, and says once why it is gloo."""
    import torch
    from ray.train.torch.config import _TorchBackend

    from hylo.pipeline.train.driver import auto_torch_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen = []
    monkeypatch.setattr(_TorchBackend, "on_start", lambda self, wg, cfg: chosen.append(cfg.backend))

    class Group:
        def get_resources_per_worker(self):
            return {"GPU": 1, "CPU": 8}

        def execute_single(self, rank, fn, *args):
            return fn(*args)

    config = auto_torch_config()
    config.backend_cls().on_start(Group(), config)
    assert chosen == ["gloo"]
    lines = [m for m in messages(capsys.readouterr().err, "INFO") if "gloo instead of NCCL" in m]
    assert len(lines) == 1 and lines[0].startswith("[train] ray.use_gpu is true"), lines


def test_the_pools_forwards_are_counted_against_the_rows_trained(capsys):
    """One forward per row per group passes; a forward per rank (the pool before groups asked once) is named."""
    from hylo.pipeline.rehearse import forwards_problem, print_report, teacher_forwards
    from hylo.pipeline.teacher.serve import forwards_in, forwards_line

    # the line the driver prints when it deletes the pool, read back by the rehearsal (of its pool only)
    line = forwards_line("teacher", [5, 2, 1, 0])
    assert line == "[teacher] pool 'teacher': its replicas ran 8 row forwards (5, 2, 1, 0)"
    assert forwards_in(line + "\n", "teacher") == 8 and forwards_in(line, "other") is None
    assert forwards_in("[teacher] deploying pool 'teacher' (4 replicas)", "teacher") is None

    # one step, 2 groups of 2 workers, 2 rows a group: each group's workers list the same rows
    records = [{"rows": [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]}]
    t = teacher_forwards(4, records, 2)
    assert t == {"forwards": 4, "rows": 4, "asked": 8, "sp": 2}
    assert forwards_problem(teacher_forwards(8, records, 2)) == (
        "the teacher pool ran 8 row forwards for 4 rows at train.sequence_parallel=2: expected one per row per group")
    print_report({"placed": [], "nodes": [], "each": {}, "teacher": t, "step": {"loss": 1.0}, "seconds": 1,
                  "ray_seconds": 1})
    assert "[rehearse] teacher forwards: 4 for 4 rows x 2 ranks (one per row per group; a forward per rank would " \
           "be 8)" in capsys.readouterr().out



@pytest.mark.parametrize("k,form", [(64, "top-64"), (0, "hidden")])
def test_the_rehearsal_shows_the_recipes_teacher_on_the_wire_per_row(capsys, k, form):
    """At the recipe's own teacher (Llama-3.1-8B: hidden 4,096, vocab 128,256, bf16) and row (64K tokens): each
    form's bytes a row, the run's marked; the served exact teacher (k: 0) is hidden states by default."""
    from hylo.pipeline.rehearse import print_report, recipe_wire
    from hylo.pipeline.train.config import load_stage_config

    recipe = load_stage_config(2, REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml", [f"teacher.k={k}"])
    print_report({"placed": [], "nodes": [], "each": {}, "teacher": None, "step": {"loss": 1.0}, "seconds": 1,
                  "ray_seconds": 1, "wire": recipe_wire(recipe)})
    out = capsys.readouterr().out
    assert "[rehearse] teacher pool on the wire per row of 65,536 tokens" in out
    # 65,536 x 128,256 x 2 B; 65,536 x 4,096 x 2 B; 65,536 x (64 x (2 + 4) + 4) B
    assert "[rehearse]   logits     16.8 GB  65,536 x 128,256 bfloat16" in out
    assert "[rehearse]   hidden    536.9 MB  65,536 x 4,096 bfloat16" in out
    assert "[rehearse]   top-64     25.4 MB  65,536 x (64 x (float16 + int32) + fp32)" in out
    assert f"{form} " in next(line for line in out.splitlines() if "<- this run" in line)
    assert "LM head (128,256 x 4,096 bfloat16, 1.1 GB per worker) and runs its product in the fused KL: 68.9 " \
           "TFLOP a row" in out


@pytest.mark.slow
def test_rehearsal_of_the_smallest_recipe_on_two_8_gpu_nodes():
    """At train.sequence_parallel=2 (2 groups of its 4 workers): the pool's replicas ran one teacher forward per
    row of the step, not one per worker."""
    from hylo.pipeline.rehearse import rehearse
    from hylo.pipeline.train.config import load_stage_config

    recipe = REPO / "configs" / "llama-3.2-1b-8mla8gdn-64k.yaml"
    node = declared_node(cluster_file_of(recipe), gpus=8, cpus=64)
    report = rehearse(load_stage_config(2, recipe, ["train.sequence_parallel=2"]), [node, node], timeout_s=900)
    kinds = sorted(what for what, _, _ in report["placed"])
    assert kinds == ["teacher replica"] * 4 + ["train worker"] * 4, kinds
    assert {at for _, at, _ in report["placed"]} <= {1, 2}
    assert report["step"]["step"] == 1 and math.isfinite(report["step"]["loss"])
    t = report["teacher"]
    assert t["sp"] == 2 and t["rows"] > 0 and t["forwards"] == t["rows"] and t["asked"] == 2 * t["rows"], t
