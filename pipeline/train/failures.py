"""Which worker failures Ray Train retries: faults yes, errors in the user's input no.

Ray Train's default failure policy retries every worker-group error, up to `FailureConfig(max_failures)`.
`InputErrorsAreFinal` keeps that policy and adds one rule. A failure in which some worker raised an input
error (what `hylo.pipeline.cli.input_error_message` knows) and no worker died is raised at once. A dead
worker or a lost node (`RayActorError`) keeps its retries.

Ray has no public switch for this. The hook is Ray's factory `create_failure_policy`, replaced while the
driver fits (`final_input_errors`). A Ray version without it keeps its own policy, and the run says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ray.exceptions import RayActorError
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

from hylo.logs import get_logger
from hylo.pipeline.cli import input_error_message
from hylo.pipeline.train.storage import CheckpointUploadError

logger = get_logger(__name__)


def worker_input_error(error: BaseException) -> str | None:
    """`worker N: <message>` when a worker of this Ray Train failure raised an input error and none
    died; None for a fault (or anything else) that Ray may retry."""
    failures = getattr(error, "worker_failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    found = None
    for rank, failure in sorted(failures.items(), key=lambda kv: str(kv[0])):
        # Ray wraps the worker's exception (UserExceptionWithTraceback) and keeps it as _base_exc
        base = getattr(failure, "_base_exc", failure)
        if isinstance(base, RayActorError) or isinstance(failure, RayActorError):
            return None  # a dead worker: a fault, whatever the others said after it
        msg = input_error_message(base) if isinstance(base, BaseException) else None
        if msg and found is None:
            found = f"worker {rank}: {msg}"
    return found


def final_reason(error: BaseException) -> str:
    """Why a failure `worker_input_error` found is not retried, in the log's words: a checkpoint upload that
    ran out of its own retries is the storage, not the input (a restart of the workers would meet the same
    storage, and the run resumes from its last checkpoint once it is back)."""
    for failure in (getattr(error, "worker_failures", None) or {}).values():
        if isinstance(getattr(failure, "_base_exc", failure), CheckpointUploadError):
            return "the checkpoint storage failed after checkpoint.upload_retries attempts"
    return "the input is wrong, not the machine"


class InputErrorsAreFinal(DefaultFailurePolicy):
    """Ray's default failure policy, except that an input error of a worker is never retried."""

    def make_decision(self, training_failed_error: Any) -> FailureDecision:
        message = worker_input_error(training_failed_error)
        if message is not None:
            logger.info(f"[train] not retrying: {final_reason(training_failed_error)} ({message})")
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


@contextlib.contextmanager
def final_input_errors() -> Iterator[bool]:
    """While fitting: Ray Train builds `InputErrorsAreFinal` as its failure policy. Yields whether it
    could be installed."""
    try:
        from ray.train.v2.api import data_parallel_trainer as dpt  # lazy: version (older Ray lacks it)
    except ImportError:
        dpt = None
    if dpt is None or not hasattr(dpt, "create_failure_policy"):
        logger.warning("[train] warning: this Ray version has no failure-policy factory: input errors inside "
                       "workers are retried like faults (ray.max_failures)")
        yield False
        return
    saved = dpt.create_failure_policy
    dpt.create_failure_policy = lambda failure_config: InputErrorsAreFinal(failure_config)
    try:
        yield True
    finally:
        dpt.create_failure_policy = saved
