"""Faults of a real cluster, on a multi-node Ray cluster simulated on this machine (tests/helpers/cluster.py):

* node loss: stage 1 and stage 2 with their two workers on two nodes; the node of one worker is killed
  (its raylet, object store and processes: `fault.kill_target=node`) mid-step or right after a
  checkpoint. Ray Train restarts the worker group on the nodes left (a spare one stands in for the
  replacement an autoscaler would bring) from the newest intact checkpoint, and the run ends with the
  losses, rows and data positions of an uninterrupted run (torchrun reference, same computation).

* teacher replica loss: stage 2's Serve pool on a node of its own, which dies with a step's rows in
  flight: the client sends them again until Serve runs a replica on the spare teacher node, every row
  is answered once and in order, and the losses equal a run without the fault (the in-process teacher at the
  same k, under torchrun).
* storage outage: a run on s3:// storage (a local S3 server) whose server stops in the middle of
  uploading step 6's checkpoint: the upload is retried `checkpoint.upload_retries` times, then the run
  fails with one line naming the checkpoint; step 3 stays intact, and `--resume` once the server is
  back finishes the run with the uninterrupted run's losses.

* preemption: SIGTERM to the driver mid-run: with time (`checkpoint.preempt_grace_s`) the workers
  write a final checkpoint at the step they are in and stop, the job says which checkpoint `--resume`
  continues from (without time they stop without one and the previous checkpoint is it: the same
  test with `grace=0`, left out for time; test_faults.py checks that decision). A Ray drain
  notice for the node of a worker (what a cloud's preemption notice becomes in Ray), then SIGTERM to
  that node's raylet: one just-in-time checkpoint, and Ray Train restarts the workers from it. Every
  resume ends with the uninterrupted run's losses.

One cluster for the module (head without CPUs + 1-CPU nodes of kind `trainer` / `teacher`); each test
refills the nodes the previous one killed. The tiny models, rows and reference runs of the other training tests
(tests/helpers/runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hylo.pipeline.train.checkpoint.layout import (
    checkpoint_problem,
    latest_checkpoint,
    list_checkpoints,
    step_of,
)
from hylo.pipeline.train.metrics import read_metrics

from tests.helpers.cluster import local_cluster
from tests.helpers.ray_logs import RayLogs
from tests.helpers.train import (
    S3_ENV,
    assert_ok,
    assert_same_steps,
    s3_server,
    tiny_config,
    torchrun,
    write_config,
)

pytestmark = pytest.mark.slow
RAY_TRAIN = {"launcher": "ray", "max_failures": 1, "resources_per_worker": {"trainer": 1}}


@pytest.fixture(scope="module")
def cluster():
    # the S3 server of the storage test starts later: its credentials go to every node now
    with local_cluster({"trainer": 3, "teacher": 2}, env=S3_ENV) as nodes:
        yield nodes


@pytest.fixture
def nodes(cluster):
    import ray

    # a test that failed while disconnected (the SIGTERM test's job disconnects before its last line) must not
    # leave the next one to start a Ray of its own: join the module's cluster again
    if not ray.is_initialized():
        ray.init(address=cluster.cluster.address)
    cluster.replace_dead()
    yield cluster


# stage2-after_checkpoint: the relaunched group resumes from step 6, which storage holds and Ray Train had not
# registered yet; it also stands for a worker SIGKILLed alone at that point (tests/e2e/test_train_e2e_ray.py), whose
# own run checked the same steps and losses
@pytest.mark.parametrize("stage,when,step,resumed", [(1, "mid_step", 5, 3), (2, "after_checkpoint", 6, 6)],
                         ids=["stage1-mid_step", "stage2-after_checkpoint"])
def test_node_loss_resumes_from_the_newest_intact_checkpoint(tiny, references, nodes, stage, when, step,
                                                             resumed):
    from hylo.pipeline.train.driver import run

    root, models = tiny
    steps = 8
    ref = references(stage)  # 12 steps: the first `steps` are what an uninterrupted run of `steps` computes
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
    assert checkpoint_problem(rd / f"step_{steps:08d}", deep=True) is None
    assert (rd / "model" / "hybrid_config.json").is_file()


def test_storage_outage_mid_upload_fails_in_one_line_and_resume_finishes(tiny, reference, nodes):
    import shutil

    from hylo.pipeline.train.driver import TrainingError, run
    from hylo.pipeline.train.storage import Loc, local_mirror

    root, models = tiny
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
                                                       "s3://bucket/runs/outage/step_00000006 failed 2 time(s)"), msg
            assert s3.stopped.is_set()
            s3.start()
            assert [s for s, _ in list_checkpoints(rd)] == [3]
            assert checkpoint_problem(rd / "step_00000003", deep=True) is None
            assert "no manifest.json" in checkpoint_problem(rd / "step_00000006")
            resumed = run(2, ["--config", str(cfg_path), "--resume"])
        finally:
            shutil.rmtree(local_mirror(rd), ignore_errors=True)
        got = read_metrics(rd)
    assert resumed["last_step"] == 8 and list(got) == list(range(1, 9))
    assert all(got[s]["resumed_from"] == 3 for s in range(4, 9))
    assert_same_steps(read_metrics(reference), got, range(1, 9))


def wait_for_step(rd: Path, step: int, timeout_s: float = 600.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not (rd / "metrics.jsonl").is_file() or max(read_metrics(rd) or [0]) < step:
        assert time.monotonic() < deadline, f"{rd}: no step {step} within {timeout_s} s"
        time.sleep(0.05)


# grace 0 (no time for a final checkpoint: the previous one is resumed) passes the same way and is left
# out to keep `make test` short; test_faults.py checks that decision on its own
@pytest.mark.parametrize("grace,final", [(60.0, True)], ids=["final-checkpoint"])
def test_sigterm_to_the_driver_checkpoints_within_the_grace_period_and_resume_is_exact(tiny, reference, nodes, grace,
                                                                                        final, capfd):
    import os
    import signal
    import threading

    from hylo.jobs.stage2 import main
    from hylo.pipeline.train.driver import run

    root, models = tiny
    steps = 12
    name = f"preempt-{int(grace)}"
    cfg = tiny_config(models, root / "runs", name, ray=RAY_TRAIN, train={"max_steps": steps},
                      checkpoint={"preempt_grace_s": grace})
    cfg_path = write_config(cfg, root / f"{name}.yaml")
    rd = root / "runs" / name

    def preempt() -> None:
        wait_for_step(rd, 4)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=preempt, daemon=True)
    sender.start()
    # (the job disconnects from Ray before it returns: the workers' lines are read from the session's files)
    logs = RayLogs.of_connected()
    # the job's own main, as `python jobs/stage2.py` runs it: exit status 143 and one line, the last one
    rc = main(["--config", str(cfg_path)])
    sender.join()
    cap = capfd.readouterr()
    assert rc == 143, cap.err[-3000:]
    stopped = max(read_metrics(rd))
    assert 4 <= stopped < steps
    newest = latest_checkpoint(rd)
    # what rank 0 says it did
    if final:
        logs.wait_for(f"final checkpoint step_{stopped:08d} written")
        assert newest.name == f"step_{stopped:08d}"
    else:
        logs.wait_for("no time for a final checkpoint")
        assert newest.name == f"step_{stopped // 3 * 3:08d}"
    assert cap.err.splitlines()[-1] == f"[train] preempted (SIGTERM): run the same command with --resume to " \
                                       f"continue from {newest.name}, its newest intact checkpoint"
    assert not (rd / ".preempt.json").exists() and not (rd / "model").exists()

    # the job disconnected from Ray before its last line (so that Ray's streamed logs end first): join again
    import ray

    assert not ray.is_initialized()
    ray.init(address=nodes.cluster.address)
    resumed = run(2, ["--config", str(cfg_path), "--resume"])
    got = read_metrics(rd)
    assert resumed["last_step"] == steps and list(got) == list(range(1, steps + 1))
    start = step_of(newest)
    assert all(got[s]["resumed_from"] == start for s in range(start + 1, steps + 1))
    assert_same_steps(read_metrics(reference), got, range(1, steps + 1))


def test_node_preemption_notice_then_sigterm_resumes_from_the_just_in_time_checkpoint(tiny, reference, nodes,
                                                                                       monkeypatch, capfd):
    import os
    import signal
    import threading
    import time

    import ray
    import ray._private.state

    from hylo.pipeline.train.driver import run

    root, models = tiny
    steps = 12
    # Ray Train's preemption watcher polls the drain state every 5 s by default
    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.2")
    cfg = tiny_config(models, root / "runs", "drain", ray=RAY_TRAIN, train={"max_steps": steps})
    cfg_path = write_config(cfg, root / "drain.yaml")
    rd = root / "runs" / "drain"
    seen: dict[str, object] = {}

    def preempt_node_of_rank1() -> None:
        from ray.core.generated import autoscaler_pb2

        wait_for_step(rd, 4)
        # a node whose `trainer` unit is taken holds a train worker (the cluster has no dashboard for the state API)
        free = ray._private.state.available_resources_per_node()
        victim = next(n for n, kind in nodes.nodes if kind == "trainer" and n.node_id in free
                      and free[n.node_id].get("trainer", 0) < 1)
        seen["step"] = max(read_metrics(rd))
        gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
        accepted, why = gcs.drain_node(victim.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       "spot instance reclaimed", int(time.time() * 1000) + 30_000)
        seen["accepted"] = (accepted, why)
        # the cloud's SIGTERM to the node comes once the just-in-time checkpoint is written
        deadline = time.monotonic() + 120
        while not any(step_of(p) % 3 for _, p in list_checkpoints(rd)):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        os.kill(victim.all_processes["raylet"][0].process.pid, signal.SIGTERM)

    sender = threading.Thread(target=preempt_node_of_rank1, daemon=True)
    sender.start()
    summary = run(2, ["--config", str(cfg_path)])
    sender.join()
    out = capfd.readouterr().err  # the driver's log lines, for the message of a failure
    assert seen["accepted"][0], seen
    jit = [s for s, _ in list_checkpoints(rd) if s % 3]
    # (the line "[train] Ray drains node(s) ... (preemption): final checkpoint step_N written" is not
    # asserted: when rank 0 is on the drained node, its log may die with the node before Ray ships it)
    assert len(jit) == 1, ([s for s, _ in list_checkpoints(rd)], out[-3000:])
    got = read_metrics(rd)
    assert summary["last_step"] == steps and list(got) == list(range(1, steps + 1))
    # the restart resumed from the just-in-time checkpoint (or a newer one, had a step finished before
    # the node went): nothing trained before the notice was lost
    restarts = {r["resumed_from"] for r in got.values()} - {0}
    assert len(restarts) == 1 and restarts.pop() >= jit[0], {s: r["resumed_from"] for s, r in got.items()}
    assert_same_steps(read_metrics(reference), got, range(1, steps + 1))


def test_teacher_node_lost_mid_step_rows_answered_once_each_in_order(tiny, nodes):
    """Stage 2 with the Serve pool (one replica) on a `teacher` node of its own: the replica kills its
    node while it holds rows of step 4. The client sends them again until Serve has a replica on the
    spare teacher node; training never restarts (ray.max_failures=0) and the losses equal a run without
    the fault: the same rows and a teacher of the same k, in process under torchrun (its top-k records have the
    client's default wire dtype, float16; Serve batches rows differently: a tolerance). That reference costs a
    third of what a second Ray Train run with a pool of its own did."""
    import socket

    from hylo.pipeline.train.driver import run

    root, models = tiny
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    marker = root / "teacher-kill-armed"
    steps = 6

    def teacher_run(name: str, **kill) -> Path:
        teacher = {"source": "serve", "k": 16,
                   "pool": {"app_name": name.replace("-", "_"), "num_replicas": 1, "num_cpus": 1,
                            "resources": {"teacher": 1}, "port": port},
                   "client": {"max_retries": 8, "retry_backoff_s": 0.5, "timeout_s": 60}}
        cfg = tiny_config(models, root / "runs", name, ray={**RAY_TRAIN, "max_failures": 0},
                          train={"max_steps": steps}, teacher=teacher, fault={"teacher": kill})
        run(2, ["--config", str(write_config(cfg, root / f"{name}.yaml"))])
        return root / "runs" / name

    ref_cfg = tiny_config(models, root / "runs", "teacher-ref", train={"max_steps": steps},
                          teacher={"source": "inprocess", "k": 16})
    assert_ok(torchrun(2, write_config(ref_cfg, root / "teacher-ref.yaml")))
    ref = read_metrics(root / "runs" / "teacher-ref")
    marker.write_text("armed")
    logs = RayLogs.of_connected()
    # 4 rows a step (2 workers x 2): row 15 is in step 4, with the step's other rows queued beside it
    rd = teacher_run("teacher-loss", kill_marker=str(marker), kill_at_row=15, kill_target="node")
    assert not marker.exists() and [k for _, k in nodes.dead()] == ["teacher"]
    # the client of a train worker sent a row of the lost replica again
    logs.wait_for("[teacher] teacher row", "sending it again")
    got = read_metrics(rd)
    assert list(got) == list(range(1, steps + 1)) and all(r["resumed_from"] == 0 for r in got.values())
    for s in range(1, steps + 1):
        assert got[s]["rows"] == ref[s]["rows"], s
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5, abs=1e-7), s
