"""What the driver hands the workers: the typed config and the loop itself, with nothing of ours between."""

from __future__ import annotations

import functools
import inspect
import pickle

from ray import cloudpickle

from hylo.pipeline.train import driver
from hylo.pipeline.train.config import Stage2Config, load_stage_config


def test_ray_train_gets_the_loop_by_name_and_the_typed_config():
    """Ray Train pickles `train_loop_per_worker` in the driver and unpickles it in each worker. There it is
    `loop.train_worker` itself with the `StageConfig` object: no dictionary of the config, no entry frame."""
    cfg = load_stage_config(2, None, ["ray.num_workers=2", "train.sequence_parallel=2", "data.seq_len=64"])
    entry = functools.partial(driver.WORKER, driver.stage_for(2), cfg)
    # Ray Train counts the required parameters: one, the launch dict it passes as train_loop_config
    assert [p.name for p in inspect.signature(entry).parameters.values()] == ["loop_config"]
    on_worker = pickle.loads(cloudpickle.dumps(entry))
    from hylo.pipeline.train.loop import train_worker

    assert on_worker.func is train_worker
    stage, typed = on_worker.args
    assert stage.number == 2 and isinstance(typed, Stage2Config) and typed == cfg
    assert typed.data_parallel == 1


def test_the_launch_dict_holds_no_config():
    cfg = load_stage_config(2, None, [])
    launch = driver.loop_config(cfg, "latest", "torchrun")
    assert "config" not in launch and launch["resume_latest"] is True and launch["launcher"] == "torchrun"
