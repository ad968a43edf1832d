"""One logger for every job (hylo/logs.py): each line's time, level and, in a rank, its rank (and node); the
level from HYLO_LOG_LEVEL or `--log-level`; Ray's, DeepSpeed's and transformers' loggers set from it.
(`--log-level` on each command: tests/jobs/test_cli_usability.py; a real 2-rank run's lines:
tests/e2e/test_train_e2e.py.)"""

from __future__ import annotations

import logging
import os
import re
import socket
from datetime import datetime

import pytest

from hylo import logs
from hylo.pipeline.cli import job_main

from tests.helpers.logs import level_kept, logged, messages

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"


@pytest.fixture(autouse=True)
def plain_process():
    """A process of no rank, at the default level; the level the test set is undone after it."""
    with level_kept(*RANK_ENV):
        yield


def test_a_line_is_time_level_message_and_info_hides_debug(capsys):
    before = datetime.now().replace(microsecond=0)
    log = logs.get_logger("hylo.pipeline.train.loop")
    log.info("[train] resumed from step_00000006 at step 6")
    log.debug("[train] not at info")
    log.warning("[train] warning: a shard is read unverified")
    err = capsys.readouterr().err
    first, second = err.splitlines()
    assert re.fullmatch(rf"{TIME} INFO \[train\] resumed from step_00000006 at step 6", first), first
    assert re.fullmatch(rf"{TIME} WARNING \[train\] warning: a shard is read unverified", second), second
    a, b = logged(err)
    assert (a.level, a.rank, b.level) == ("INFO", None, "WARNING")
    assert before <= a.time <= datetime.now() and a.time <= b.time
    assert logs.message_of(first) == "[train] resumed from step_00000006 at step 6"
    assert logs.message_of("[train] a printed line") == "[train] a printed line"


def test_a_module_outside_the_package_logs_under_it():
    assert logs.get_logger("__main__").name == "hylo.__main__"
    assert logs.get_logger("hylo.pipeline.runner").name == "hylo.pipeline.runner"


@pytest.mark.parametrize("env,label", [
    # torchrun on one node (--nproc_per_node 2): RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, "rank 1/2"),
    # torchrun on 2 nodes of 8: its node's rank (GROUP_RANK) and the host
    ({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1"},
     "rank 9/16 node 1 {host}"),
    # Ray Train's torch backend: NODE_RANK instead of GROUP_RANK
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}, "rank 3/4 node 1 {host}"),
    # a launcher that says nothing of nodes
    ({"RANK": "0", "WORLD_SIZE": "4"}, "rank 0/4"),
])
def test_a_rank_shows_its_rank_and_its_node_when_the_ranks_span_nodes(monkeypatch, capsys, env, label):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    logs.get_logger("t").info("[zero] holds 1 of 2 parameters")
    (line,) = logged(capsys.readouterr().err)
    assert line.rank == label.format(host=socket.gethostname())
    assert line.message == "[zero] holds 1 of 2 parameters"


def test_a_ray_train_worker_shows_the_rank_of_ray_trains_context():
    """Before Ray Train's backend has set RANK (or where it does not), the worker's rank is read from Ray
    Train's own context, set as Ray sets it in a worker (its `set_train_context`)."""
    from ray.train.v2._internal.execution import context as ray_context

    distributed = ray_context.DistributedContext(world_rank=5, world_size=8, local_rank=1, local_world_size=4,
                                                 node_rank=1)
    ctx = ray_context.TrainContext(train_run_context=None, distributed_context=distributed,
                                   execution_context=None, storage_context=None, preemption_context=None,
                                   controller_actor=None, dataset_shard_provider=None)
    assert logs.rank_label() == ""
    ray_context.set_train_context(ctx)
    try:
        assert logs.rank_label() == f"rank 5/8 node 1 {socket.gethostname()}"
    finally:
        ray_context.set_train_context(None)
    assert logs.rank_label() == ""


def test_the_level_filters_lines_and_travels_in_the_environment(capsys):
    log = logs.get_logger("hylo.pipeline.demo")
    logs.set_level("warning")
    log.info("[demo] hidden")
    log.warning("[demo] shown")
    assert os.environ[logs.ENV] == "warning" and logs.child_env() == {logs.ENV: "warning"}
    logs.set_level("DEBUG")  # any case
    log.debug("[demo] debug line")
    assert messages(capsys.readouterr().err) == ["[demo] shown", "[demo] debug line"]
    # a process started with the variable (a Ray worker, a torchrun rank, a demo step) takes it at its setup
    os.environ[logs.ENV] = "error"
    assert logs.setup() == "error" and logs.current_level() == "error"
    log.warning("[demo] hidden at error")
    assert capsys.readouterr().err == ""
    with pytest.raises(logs.LogLevelError, match="'loud' is not a log level; choose one of debug, info, "):
        logs.set_level("loud")


def test_a_bad_hylo_log_level_is_the_jobs_one_error_line(capsys):
    @job_main
    def main(argv=None):
        raise AssertionError("the job ran")

    os.environ[logs.ENV] = "verbose"
    assert main([]) == 2
    assert capsys.readouterr().err == ("error: HYLO_LOG_LEVEL=verbose: not a log level; choose one of debug, "
                                       "info, warning, error\n")


def test_the_default_leaves_no_variable_behind():
    """At the default level and with no HYLO_LOG_LEVEL, nothing is handed to workers (their environment is as
    it was before the logger)."""
    assert logs.child_env() == {} and logs.ENV not in os.environ and logs.TRANSFORMERS_ENV not in os.environ


@pytest.mark.parametrize("level,expected", [
    # at info each library keeps its own default: the terminal of a run is as it was
    ("info", {"ray": logging.INFO, "DeepSpeed": logging.WARNING, "transformers": logging.WARNING}),
    ("warning", {"ray": logging.WARNING, "DeepSpeed": logging.WARNING, "transformers": logging.WARNING}),
    ("error", {"ray": logging.ERROR, "DeepSpeed": logging.ERROR, "transformers": logging.ERROR}),
    ("debug", {"ray": logging.DEBUG, "DeepSpeed": logging.DEBUG, "transformers": logging.DEBUG}),
])
def test_ray_deepspeed_and_transformers_follow_the_level(level, expected):
    """Their real loggers: DeepSpeed's `deepspeed.utils.logger` (and the handler it filters with), set again
    when the project imports DeepSpeed (its import sets its own level); transformers' verbosity."""
    import transformers.utils.logging as tf_logging

    from hylo.pipeline.train.deepspeed_cfg import import_deepspeed

    ds = import_deepspeed()
    logs.set_level(level)
    ds.utils.logger.setLevel(logging.WARNING)  # as DeepSpeed's import leaves it
    ds = import_deepspeed()
    got = {"ray": logging.getLogger("ray").level, "DeepSpeed": ds.utils.logger.level,
           "transformers": tf_logging.get_verbosity()}
    assert got == expected
    assert all(h.level == expected["DeepSpeed"] for h in ds.utils.logger.handlers)
    # transformers imported later (a worker, a step) reads it from its variable
    assert os.environ.get(logs.TRANSFORMERS_ENV) == (None if level == "info" else level)


def test_what_deepspeed_logs_while_it_is_imported_follows_the_level_too(capsys):
    """DeepSpeed's import makes its logger (warning, a handler on stdout) and at once warns which accelerator
    it chose: before the project can set its level. What its import does is done again here, with DeepSpeed's
    own factory: at error its warning is dropped, at info it shows as it always did."""
    from deepspeed.utils.logging import LoggerFactory

    for level, shown in (("error", False), ("info", True)):
        logs.set_level(level)
        capsys.readouterr()
        logger = LoggerFactory.create_logger(name="DeepSpeed", level=logging.WARNING)
        handler = logger.handlers[-1]
        try:
            logger.warning("Setting accelerator to CPU.")
        finally:
            logger.removeHandler(handler)
        assert ("Setting accelerator to CPU." in capsys.readouterr().out) == shown, level
