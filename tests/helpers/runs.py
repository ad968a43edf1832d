"""The shared training fixtures, for the whole `make test` (its test processes share them): the tiny models and the
uninterrupted reference runs the faulted and resumed runs are compared against. A run of `max_steps` n < 12
computes exactly the first n steps of the 12-step run (the schedule follows the data's 12 steps, not max_steps), so
one 12-step run per stage serves every length. The conftest.py of tests/e2e/ (the end-to-end training files) and
of tests/train/ (the sequence-parallel runs) take them from here.

The files that use them run in different test processes (pytest-xdist, a file to a process): the first process to
ask for the models or a stage's reference makes them, in a directory of the run's shared temp root, while holding a
lock on it; the others wait on the lock and take what it made. Tests only read them (a test that resumes a
reference copies it first); each process keeps its own directory for the runs it makes."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from hylo.locks import file_lock

from tests.helpers.train import assert_ok, make_tiny_models, tiny_config, torchrun, write_config


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    """A directory every test process of this pytest run sees: the parent of the per-process temp roots under
    pytest-xdist, the temp root itself in one process."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "e2e-shared"
    root.mkdir(exist_ok=True)
    return root


def _once(root: Path, name: str, make: Callable[[Path], object]) -> Path:
    """root/name, made by `make(root/name)` by the first process to ask while it holds root/.name.lock; the
    others wait for the lock and find it made (root/name.made, written once `make` returned). What a failed
    attempt left is removed before the next one."""
    out, made = root / name, root / f"{name}.made"
    with file_lock(root, name):
        if not made.is_file():
            shutil.rmtree(out, ignore_errors=True)
            make(out)
            made.write_text(json.dumps({"by": os.environ.get("PYTEST_XDIST_WORKER", "master")}))
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, shared_root) -> tuple[Path, dict[str, Path]]:
    """(this process's directory for the runs its tests make, the shared tiny models: a random Llama `base`
    and its HyLo conversion `student`)."""
    models = _once(shared_root, "models", make_tiny_models)
    return tmp_path_factory.mktemp("train"), {"base": models / "base", "student": models / "student"}


@pytest.fixture(scope="session")
def references(tiny, shared_root) -> Callable[[int], Path]:
    """stage -> the run directory of an uninterrupted 12-step run of that stage (torchrun, 2 ranks, a checkpoint
    every 3 steps; the same computation as Ray Train's workers), made the first time any test process asks for
    it: <shared>/runs/<name>, beside <shared>/models."""
    _, models = tiny
    runs = shared_root / "runs"

    def reference(stage: int) -> Path:
        name = "reference" if stage == 2 else f"reference{stage}"

        def make(run: Path) -> None:
            cfg = write_config(tiny_config(models, runs, name, stage=stage), shared_root / f"{name}.yaml")
            proc = torchrun(stage, cfg)
            assert_ok(proc)
            # what its ranks logged, for the tests of its log lines (`logged_by`)
            (runs / f"{name}.stderr").write_text(proc.stderr)

        return _once(runs, name, make)

    return reference


def logged_by(run: Path) -> str:
    """What the ranks of reference run `run` logged (their stderr, as torchrun passed it on)."""
    return (run.parent / f"{run.name}.stderr").read_text()


@pytest.fixture(scope="session")
def reference(references) -> Path:
    """Stage 2, 12 steps, uninterrupted (checkpoint every 3 steps)."""
    return references(2)
