"""The run's kernel cache (pipeline/train/kernel_cache.py): every training worker's environment points Triton's
cache and fla's autotune results at one directory, built by the driver without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import load_stage_config
from hylo.pipeline.train.driver import loop_config, run_config
from hylo.pipeline.train.kernel_cache import kernel_cache_dir, kernel_cache_env, node_local_kernel_cache
from hylo.pipeline.train.storage import run_loc


def worker_envs(cfg) -> list[dict[str, str]]:
    """What a Ray Train worker starts with (RunConfig's worker runtime env) and what a torchrun rank sets."""
    return [run_config(cfg, run_loc(cfg)).worker_runtime_env["env_vars"], loop_config(cfg, None, "torchrun")["kernel_cache_env"]]


def test_default_is_the_run_dir(tmp_path: Path) -> None:
    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.name=exp"])
    assert kernel_cache_dir(cfg) == tmp_path / "exp" / "kernel_cache"
    for env in worker_envs(cfg):
        assert env["TRITON_CACHE_DIR"] == str(tmp_path / "exp" / "kernel_cache" / "triton")
        assert env["FLA_CACHE_RESULTS"] == "1"


def test_configured_shared_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.kernel_cache=shared/kc"])
    # a relative path is made absolute where the job starts, not in each worker's working directory
    assert kernel_cache_dir(cfg) == tmp_path / "shared" / "kc"
    for env in worker_envs(cfg):
        assert env == {**env, **kernel_cache_env(tmp_path / "shared" / "kc")}
        assert env["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "kc" / "triton")


def test_run_at_a_uri_uses_a_node_local_cache() -> None:
    cfg = load_stage_config(2, None, ["ray.storage_path=memory://bucket/runs", "ray.name=exp"])
    assert kernel_cache_dir(cfg) == node_local_kernel_cache()
    for env in worker_envs(cfg):
        assert env["TRITON_CACHE_DIR"] == str(node_local_kernel_cache() / "triton")


def test_a_uri_cache_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kernel_cache.*not a URI"):
        load_stage_config(2, None, [f"ray.storage_path={tmp_path}", "ray.kernel_cache=s3://bucket/kc"])
