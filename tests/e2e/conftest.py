"""Fixtures of the end-to-end training tests (test_train_e2e.py, test_train_e2e_ray.py): per module, the tiny
models and one uninterrupted reference run to compare against."""

from __future__ import annotations

import pytest

from tests.helpers.train import assert_ok, make_tiny_models, tiny_config, torchrun, write_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, make_tiny_models(root / "models")


@pytest.fixture(scope="module")
def reference(tiny):
    """Stage 2, 12 steps, uninterrupted (checkpoint every 3 steps)."""
    root, models = tiny
    cfg = write_config(tiny_config(models, root / "runs", "reference"), root / "reference.yaml")
    assert_ok(torchrun(2, cfg))
    return root / "runs" / "reference"
