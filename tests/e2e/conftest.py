"""Fixtures of the end-to-end training tests (test_train_e2e.py, test_train_e2e_ray.py, test_faults_cluster.py):
for the session (one per test process), the tiny models and the uninterrupted reference runs the faulted runs
are compared against. A run of `max_steps` n < 12 computes exactly the first n steps of the 12-step run (the
schedule follows the data's 12 steps, not max_steps), so one 12-step run per stage serves every length."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.train import assert_ok, make_tiny_models, tiny_config, torchrun, write_config


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return root, make_tiny_models(root / "models")


@pytest.fixture(scope="session")
def references(tiny) -> Callable[[int], Path]:
    """stage -> the run directory of an uninterrupted 12-step run of that stage (torchrun, 2 ranks, a checkpoint
    every 3 steps; the same computation as Ray Train's workers), made the first time a test asks for it."""
    root, models = tiny
    made: dict[int, Path] = {}

    def reference(stage: int) -> Path:
        if stage not in made:
            name = "reference" if stage == 2 else f"reference{stage}"
            cfg = write_config(tiny_config(models, root / "runs", name, stage=stage), root / f"{name}.yaml")
            assert_ok(torchrun(stage, cfg))
            made[stage] = root / "runs" / name
        return made[stage]

    return reference


@pytest.fixture(scope="session")
def reference(references) -> Path:
    """Stage 2, 12 steps, uninterrupted (checkpoint every 3 steps)."""
    return references(2)
