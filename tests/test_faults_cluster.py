"""Faults of a real cluster, on a multi-node Ray cluster simulated on this machine (fixtures_cluster.py):

* node loss: stage 1 and stage 2 with their two workers on two nodes; the node of one worker is killed
  (its raylet, object store and processes: `fault.kill_target=node`) mid-step or right after a
  checkpoint. Ray Train restarts the worker group on the nodes left (a spare one stands in for the
  replacement an autoscaler would bring) from the newest intact checkpoint, and the run ends with the
  losses, rows and data positions of an uninterrupted run (torchrun reference, same computation).

* storage outage: a run on s3:// storage (a local S3 server) whose server stops in the middle of
  uploading step 6's checkpoint: the upload is retried `checkpoint.upload_retries` times, then the run
  fails with one line naming the checkpoint; step 3 stays intact, and `--resume` once the server is
  back finishes the run with the uninterrupted run's losses.

One cluster for the module (head without CPUs + 1-CPU nodes of kind `trainer` / `teacher`); each test
refills the nodes the previous one killed. The tiny models and rows of the other training tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.train import checkpoint as ckpt_lib
from pipeline.train.metrics import read_metrics

from fixtures_cluster import local_cluster
from fixtures_train import make_tiny_models, s3_server, tiny_config, write_config
from test_train_e2e import assert_ok, assert_same_steps, torchrun

pytestmark = pytest.mark.slow
RAY_TRAIN = {"launcher": "ray", "max_failures": 1, "resources_per_worker": {"trainer": 1}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return root, make_tiny_models(root / "models")


@pytest.fixture(scope="module")
def cluster():
    with local_cluster({"trainer": 3}) as nodes:
        yield nodes


@pytest.fixture
def nodes(cluster):
    cluster.replace_dead()
    yield cluster


def reference(tiny, stage: int, steps: int) -> Path:
    """An uninterrupted run of `steps` steps (torchrun, the same computation as Ray Train's workers)."""
    root, models = tiny
    name = f"reference{stage}-{steps}"
    if not (root / "runs" / name / f"step_{steps:08d}").is_dir():
        cfg = write_config(tiny_config(models, root / "runs", name, stage=stage, train={"max_steps": steps}),
                           root / f"{name}.yaml")
        assert_ok(torchrun(stage, cfg))
    return root / "runs" / name


@pytest.mark.parametrize("stage,when,step,resumed", [(1, "mid_step", 5, 3), (2, "after_checkpoint", 6, 6)],
                         ids=["stage1-mid_step", "stage2-after_checkpoint"])
def test_node_loss_resumes_from_the_newest_intact_checkpoint(tiny, nodes, stage, when, step, resumed):
    from pipeline.train.driver import run

    root, models = tiny
    steps = 8
    ref = reference(tiny, stage, steps)
    name = f"node-loss-{stage}"
    cfg = tiny_config(models, root / "runs", name, stage=stage, ray=RAY_TRAIN, train={"max_steps": steps},
                      fault={"kill_at_step": step, "kill_rank": 1, "kill_when": when, "kill_target": "node"})
    summary = run(stage, ["--config", str(write_config(cfg, root / f"{name}.yaml"))])
    rd = root / "runs" / name
    # the node of rank 1 is gone (its raylet was killed), and the run finished without it
    assert [k for _, k in nodes.dead()] == ["trainer"]
    assert (rd / f".fault-step{step}-{when}-rank1").exists()
    got = read_metrics(rd)
    assert summary["last_step"] == steps and list(got) == list(range(1, steps + 1))
    assert all(got[s]["resumed_from"] == resumed for s in range(resumed + 1, steps + 1)), \
        {s: got[s]["resumed_from"] for s in got}
    assert_same_steps(read_metrics(ref), got, range(1, steps + 1))
    assert ckpt_lib.checkpoint_problem(rd / f"step_{steps:08d}", deep=True) is None
    assert (rd / "model" / "hybrid_config.json").is_file()


def test_storage_outage_mid_upload_fails_in_one_line_and_resume_finishes(tiny, nodes):
    import shutil

    from pipeline.train.driver import TrainingError, run
    from pipeline.train.storage import Loc, local_mirror

    root, models = tiny
    ref = reference(tiny, 2, 8)
    with s3_server() as s3:
        cfg = tiny_config(models, s3.uri("runs"), "outage", ray={**RAY_TRAIN, "max_failures": 0},
                          train={"max_steps": 8}, checkpoint={"upload_retries": 1, "upload_backoff_s": 0.5})
        cfg_path = write_config(cfg, root / "outage.yaml")
        rd = Loc.of(s3.uri("runs/outage"))
        try:
            # the directory markers and a few files of step 6 go up, then the server stops
            s3.outage_on("outage/step_00000006/", after=12)
            with pytest.raises(TrainingError) as e:
                run(2, ["--config", str(cfg_path)])
            msg = str(e.value)
            print("the run stopped with:", msg)
            assert "\n" not in msg and msg.startswith("training failed: CheckpointUploadError: uploading checkpoint "
                                                       "step_00000006 to s3://bucket/runs/outage failed 2 time(s)"), msg
            assert s3.stopped.is_set()
            s3.start()
            assert [s for s, _ in ckpt_lib.list_checkpoints(rd)] == [3]
            assert ckpt_lib.checkpoint_problem(rd / "step_00000003", deep=True) is None
            assert "no manifest.json" in ckpt_lib.checkpoint_problem(rd / "step_00000006")
            resumed = run(2, ["--config", str(cfg_path), "--resume"])
        finally:
            shutil.rmtree(local_mirror(rd), ignore_errors=True)
        got = read_metrics(rd)
    assert resumed["last_step"] == 8 and list(got) == list(range(1, 9))
    assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
    assert_same_steps(read_metrics(ref), got, range(1, 9))
