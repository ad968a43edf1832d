"""docs/stages.md's checkout block of "Running the stages" (`python jobs/NAME.py --config configs/...`), run as
written in a directory laid out as the repository's root (jobs/, configs/ and the packages linked, its own
runs/), at its smallest size (tests/helpers/readme.py). `slow`: minutes on 2 cores."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from tests.helpers.readme import REPO, clean_env, job_of, readme_blocks, run

pytestmark = pytest.mark.slow


def test_the_checkout_block_from_the_repository_root(tmp_path):
    """`python jobs/NAME.py --config configs/NAME.yaml` in a checkout's root, not installed (PYTHONPATH unset:
    the job files find their packages beside them)."""
    checkout = readme_blocks("Running the stages")[1]
    assert all(c.startswith("python jobs/") for c in checkout), checkout
    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("jobs", "configs", "hylo", "pipeline", "kernels"):
        (root / name).symlink_to(REPO / name)
    env = clean_env()
    for cmd in checkout:
        out = run(cmd, root, env, python=sys.executable)
        if job_of(shlex.split(cmd)) == "prepare-data":
            manifest = json.loads((root / "runs" / "data" / "smoke" / "manifest.json").read_text())
            assert manifest["max_len"] == 128 and manifest["counts"]["rows"] > 0, out[-2000:]
        if "--print-config" in cmd:
            assert "storage_path: runs/demo" in out
