"""Faults found without starting Ray: a teacher that cannot distil into the student is refused from config
files before Ray starts; an input error inside a worker is not retried like a fault."""

from __future__ import annotations

import json
import time

import pytest

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import load_stage_config
from hylo.pipeline.train.inputs import check_stage_inputs

from tests.helpers.teacher import save_tiny_llama
from tests.helpers.train import make_tiny_models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("faults") / "models")


def _stage2(tiny, tmp_path, teacher, *sets):
    return load_stage_config(2, None, [f"model.student={tiny['student']}", f"teacher.model.path={teacher}",
                                       "data.source=synthetic", f"ray.storage_path={tmp_path}", *sets])


# ------------------------------------------------------------------------------------ before Ray starts
def test_a_teacher_of_another_vocabulary_is_refused_before_ray_starts(tiny, tmp_path):
    """Refused in seconds from the config files (not after Ray started and both models loaded, 94 s, then
    retried)."""
    teacher = save_tiny_llama(tmp_path / "teacher", vocab_size=128)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"teacher.model.path='{teacher}': vocabulary 128 != the student's 96"):
        check_stage_inputs(_stage2(tiny, tmp_path, teacher))
    assert time.perf_counter() - t0 < 5
    # the same for the Serve pool the driver deploys
    with pytest.raises(ConfigError, match="vocabulary 128 != the student's 96"):
        check_stage_inputs(_stage2(tiny, tmp_path, teacher, "teacher.source=serve"))
    check_stage_inputs(_stage2(tiny, tmp_path, tiny["base"]))


def test_a_teacher_whose_tokenizer_maps_ids_to_other_tokens_is_refused(tiny, tmp_path):
    """Same vocabulary size, another tokenizer: every id means another token."""
    teacher = save_tiny_llama(tmp_path / "teacher", vocab_size=96, tokenizer_salt="x")
    with pytest.raises(ConfigError, match=r"tokenizers of .*teacher and the student .* disagree on 96 token id\(s\), "
                                          r"first id 0: 'wx0' vs 'w0'"):
        check_stage_inputs(_stage2(tiny, tmp_path, teacher))


def test_a_teacher_without_the_students_chat_template_is_a_warning(tiny, tmp_path, capsys):
    import shutil

    student = tmp_path / "student"
    shutil.copytree(tiny["student"], student)
    (student / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    cfg = load_stage_config(2, None, [f"model.student={student}", f"teacher.model.path={tiny['base']}",
                                      "data.source=synthetic", f"ray.storage_path={tmp_path}"])
    check_stage_inputs(cfg)
    assert "has no chat template but the student's tokenizer has one" in capsys.readouterr().err


def test_stage1_base_of_another_shape_is_refused(tiny, tmp_path):
    """Layer-wise ILD: the student's layers learn the base's layer outputs, so the base must be the
    model the student came from (hidden size, layer count, vocabulary)."""
    wider = save_tiny_llama(tmp_path / "wider", hidden_size=48)
    cfg = load_stage_config(1, None, [f"model.student={tiny['student']}", f"model.base={wider}",
                                      "data.source=synthetic", f"ray.storage_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.base=.*wider': hidden_size 48 != the student's 32"):
        check_stage_inputs(cfg)
    deeper = save_tiny_llama(tmp_path / "deeper", layers=3)
    cfg = load_stage_config(1, None, [f"model.student={tiny['student']}", f"model.base={deeper}",
                                      "data.source=synthetic", f"ray.storage_path={tmp_path}"])
    with pytest.raises(ConfigError, match="num_hidden_layers 3 != the student's 2"):
        check_stage_inputs(cfg)


# ------------------------------------------------------------------------------------ Ray's retries
def _worker_group_error(*failures: BaseException):
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    wrapped = {r: (e if e.__class__.__name__.endswith("ActorDiedError") else
                   UserExceptionWithTraceback(e, f"Traceback ...\n{type(e).__name__}: {e}"))
               for r, e in enumerate(failures)}
    return WorkerGroupError("worker errors", wrapped)


def test_an_input_error_inside_a_worker_is_not_retried_a_fault_is():
    from ray.exceptions import ActorDiedError
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    from hylo.pipeline.train.failures import InputErrorsAreFinal

    user = ConfigError("teacher vocabulary 128 != student vocabulary 96: teacher and student must share a tokenizer")
    full = OSError(28, "No space left on device", "/runs/x/step_00000004/zero/state/a.pt")
    # Ray's own policy retries both, spending ray.max_failures on an error that cannot go away
    assert DefaultFailurePolicy(FailureConfig(max_failures=3)).make_decision(
        _worker_group_error(user)) == FailureDecision.RETRY
    policy = InputErrorsAreFinal(FailureConfig(max_failures=3))
    assert policy.make_decision(_worker_group_error(user, user)) == FailureDecision.RAISE
    assert policy.make_decision(_worker_group_error(full)) == FailureDecision.RAISE
    # faults keep their retries: a bug-or-fault error, a worker that died (even beside a collateral error)
    assert policy.make_decision(_worker_group_error(RuntimeError("gloo: connection reset"))) == FailureDecision.RETRY
    assert policy.make_decision(_worker_group_error(user, ActorDiedError())) == FailureDecision.RETRY


def test_the_log_says_why_a_failure_is_not_retried(capsys):
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    from hylo.pipeline.train.failures import InputErrorsAreFinal
    from hylo.pipeline.train.storage import CheckpointUploadError

    policy = InputErrorsAreFinal(FailureConfig(max_failures=3))
    upload = CheckpointUploadError("uploading checkpoint s3://b/r/step_00000006 failed 2 time(s): connection refused")
    assert policy.make_decision(_worker_group_error(upload)) == FailureDecision.RAISE
    out = capsys.readouterr().err
    assert "not retrying: the checkpoint storage failed after checkpoint.upload_retries attempts" in out, out
    assert "the input is wrong" not in out
    assert policy.make_decision(_worker_group_error(ConfigError("bad"))) == FailureDecision.RAISE
    assert "not retrying: the input is wrong, not the machine (worker 0: " in capsys.readouterr().err


def test_the_driver_fits_with_the_input_error_policy():
    from ray.train import FailureConfig
    from ray.train.v2.api import data_parallel_trainer as dpt

    from hylo.pipeline.train.failures import InputErrorsAreFinal, final_input_errors

    with final_input_errors() as installed:
        assert installed and isinstance(dpt.create_failure_policy(FailureConfig()), InputErrorsAreFinal)
    assert not isinstance(dpt.create_failure_policy(FailureConfig()), InputErrorsAreFinal)
