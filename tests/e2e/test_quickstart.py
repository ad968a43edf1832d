"""The README's "Quick start" and docs/stages.md's "Running the stages", run as written, for real, at their
smallest size.

* `test_the_quick_start_then_the_stages_from_an_installed_wheel`: a wheel of this checkout installed into a
  fresh virtualenv (the packages of this test's environment visible: torch, Ray, transformers; nothing of the
  checkout on PYTHONPATH); in a directory outside the checkout, the quick start's commands (`hylo demo` with
  the flags of its smallest run appended, `DEMO_SMALLEST`), then, in the same directory as a user who goes on
  would, the first block of "Running the stages" with `--set` overrides appended that make each job small
  (`SMALLEST`; later --set wins). Its jobs join one local Ray started for them (by the installed package, in
  yet another directory). Then the cards of the demo's models as a Hub user reads them (huggingface_hub's
  ModelCard). The demo finds vLLM's environment (`make serve-install`, through HYLO_SERVE_PYTHON) and serves its
  stage-2 model: the answers come through the OpenAI endpoint and stand beside `generate`'s in its report.
The checkout block of "Running the stages" runs in tests/e2e/test_checkout_block.py (a file of its own, so
that `make test` runs it beside this one).

`slow`: minutes on 2 cores. What a user types first is what must never break.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers.common import source_copy
from tests.helpers.ray_logs import RayLogs
from tests.helpers.readme import REPO, clean_env, job_of, printed_once, readme_blocks, run
from tests.helpers.serving import serve_python

pytestmark = pytest.mark.slow

def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{shlex.join(map(str, cmd))}: exit {proc.returncode}\n{proc.stderr[-3000:]}"



def installed_wheel(tmp_path: Path) -> Path:
    """A virtualenv with a wheel of the tracked files installed (no dependency fetched: this environment's
    packages are on its path, but not this checkout's editable install); its bin/."""
    env = clean_env()
    src = source_copy(REPO, tmp_path / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hylo_pipeline-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("hylo/configs/")}
    assert {f"hylo/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")} <= shipped
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    own = next((venv / "lib").glob("python3*/site-packages"))
    # this environment's site-packages as plain path entries: their .pth files (the checkout's editable
    # install among them) are not run
    (own / "outer-environment.pth").write_text("\n".join([*site.getsitepackages(), site.getusersitepackages()]) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
          "--no-index", "--ignore-installed", str(wheel)], tmp_path, env)
    return venv / "bin"


@pytest.fixture
def ray_root():
    """A Ray temp root of the test's own (`RAY_TMPDIR` of the jobs that start a Ray: what their workers printed is
    read in its sessions; short: Ray's socket paths live below it), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="hylo-qs-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_quick_start_then_the_stages_from_an_installed_wheel(tmp_path, ray_root):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to copy the tracked files")
    (quick,) = readme_blocks("Quick start")
    assert [c.split()[:2] for c in quick] == [["pip", "install"], ["hylo", "fetch-assets"], ["hylo", "demo"],
                                            ["hylo", "configs"]], quick
    stages = readme_blocks("Running the stages")[0]
    assert [job_of(shlex.split(c)) for c in stages] == ["prepare-data", "prepare-data", "stage1", "stage2", "eval"]
    bin_dir = installed_wheel(tmp_path)  # `pip install .`
    venv = bin_dir.parent
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv),
                    HYLO_SERVE_PYTHON=str(serve_python()))
    work = tmp_path / "elsewhere"
    work.mkdir()
    demo_logs = RayLogs.of_temp_root(ray_root / "demo")
    # the demo includes vLLM serving its stage-2 model: minutes of start-up on a loaded 2-core machine
    out = {cmd.split()[1]: run(cmd, work, {**env, "RAY_TMPDIR": str(ray_root / "demo")}, timeout=1800)
           for cmd in quick[1:]}
    # the demo ran the installed package's jobs, with its shipped configs, in this directory
    site_dir = next((venv / "lib").glob("python3*/site-packages"))
    assert f"{site_dir}/hylo/configs/demo-smollm2.yaml" in out["demo"]
    assert not re.search(rf"{re.escape(str(REPO))}/(hylo|pipeline|jobs|kernels|configs)/", out["demo"])
    demo = work / "runs" / "demo"
    assert r"KL(teacher \|\| student), after stage 2" in (demo / "report.md").read_text()
    readable(out["demo"], demo / "logs")
    # the stage-2 model served by vLLM answered every sample prompt through the OpenAI endpoint
    served = json.loads((demo / "serve" / "answers.json").read_text())
    generated = json.loads((demo / "eval" / "stage2" / "results.json").read_text())["samples"]["model"]
    assert [a["prompt"] for a in served] == [a["prompt"] for a in generated]
    # an answer may be empty: a model trained one step can put its end-of-turn token first (generate's too)
    assert all(isinstance(a["answer"], str) and a["new_tokens"] > 0 for a in served), served
    same = sum(a["answer"] == b["answer"] for a, b in zip(served, generated))
    report = (demo / "report.md").read_text()
    assert "stage 2, vLLM" in report
    assert f"| stage-2 answers served by vLLM (bf16) equal to generate's (fp32) | {same} of {len(served)} |" in report
    assert "demo-smollm2.yaml" in out["configs"]
    # the training worker printed each step once, and the job's log shows none twice
    printed_once(demo_logs.wait_for("[stage1] step 1/"), r"\[stage1\] step \d+/")
    printed_once((demo / "logs" / "stage1.log").read_text(), r"\[stage1\] step \d+/", at_least_once=False)
    cards = {name: (demo / name / "README.md").read_text() for name in ("converted", "stage2/model")}

    # "Running the stages" where the demo ran, relative paths, its jobs on one Ray
    stages_env = {**env, "RAY_TMPDIR": str(ray_root / "stages")}
    with shared_ray(bin_dir / "python", tmp_path / "ray-home", stages_env) as join:
        outs, printed = [], []
        for cmd in stages:
            logs = RayLogs.of_temp_root(ray_root / "stages")
            outs.append(run(cmd, work, {**stages_env, **join}))
            printed.append(logs)
    for split in ("stage1", "stage2"):
        assert json.loads((demo / "data" / split / "manifest.json").read_text())["max_len"] == 128
    for stage, i in (("stage1", 2), ("stage2", 3)):
        assert (demo / stage / "model" / "hybrid_config.json").is_file()
        printed_once(printed[i].wait_for(f"[{stage}] step 1/1"), rf"\[{stage}\] step \d+/")
        printed_once(outs[i], rf"\[{stage}\] step \d+/", at_least_once=False)
    results = json.loads((work / "runs" / "eval" / "results.json").read_text())
    assert results["kl"]["kl"] > 0 and results["kvcache"]["comparison"]
    assert results["config"]["models"]["path"] == str(demo / "stage2" / "model")

    # the cards the demo left, as a Hub user reads them
    from huggingface_hub import ModelCard

    for name, text in cards.items():
        card = ModelCard(text)
        assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
        assert card.data.eval_results, f"{name}: the demo's evaluation left no results in the card"
        assert "## Intended use and limitations" in card.content
        assert str(tmp_path) not in text and str(Path.home()) not in text and "PATH" not in text, name
        assert ("**Converted, not trained.**" in card.content) == (name == "converted")
        datasets = ["HuggingFaceTB/smol-smoltalk"] + (["anon8231489123/ShareGPT_Vicuna_unfiltered"]
                                                       if name != "converted" else [])
        assert card.data.datasets == datasets, (name, card.data.datasets)
        kl = {r.metric_type: r.metric_value for r in card.data.eval_results if r.dataset_name == "kl"}
        assert kl["kl"] > 0 and kl["ppl"] > 1, (name, kl)
    assert "model_id = 'stage2'" in cards["stage2/model"]
    # the stages' eval recorded its results in the model it evaluated
    assert ModelCard.load(demo / "stage2" / "model" / "README.md").data.eval_results


# What a successful demo run printed before it showed only its own progress: Ray's and torch's known notices
# (pipeline/job_output.py), Ray's helper actor failing to find its cluster next to another Ray.
DEMO_NOISE = re.compile(r"PlacementGroupCleaner|Found multiple active Ray instances|Failed to kill actor|"
                        r"FutureWarning|Setting accelerator to CPU|INFO worker\.py:\d+ -- Connect")


def readable(out: str, logs: Path) -> None:
    """The demo's terminal output `out` holds no traceback and none of the known noise; its logs no ANSI codes."""
    assert "Traceback" not in out, out[-4000:]
    noise = [line for line in out.splitlines() if DEMO_NOISE.search(line)]
    assert not noise, f"{len(noise)} lines of known noise on the terminal, e.g.\n" + "\n".join(noise[:5])
    assert "\x1b" not in out
    coloured = [log.name for log in sorted(logs.glob("*.log")) if "\x1b" in log.read_text()]
    assert not coloured, f"ANSI codes in {coloured}"
    # what it left out is in the logs, and it says so
    assert "known Ray/torch notices are in" in out


class shared_ray:
    """One local Ray for a block of jobs, started by `python` in `home` in a process of its own, which stops it
    when its stdin closes; yields the environment a job joins it with (RAY_ADDRESS, and the RAY_AUTH_MODE
    that Ray 2.60 sets in the process that starts a local Ray, where the demo's jobs inherit it)."""

    CODE = ("import os, sys\nfrom hylo.pipeline.ray_init import gcs_address, init_ray\n"
            "init_ray(None, 2, log_to_driver=False)\n"
            "print(gcs_address(), os.environ.get('RAY_AUTH_MODE', ''), flush=True)\nsys.stdin.read()\n"
            "import ray\nray.shutdown()\n")

    def __init__(self, python: Path, home: Path, env: dict[str, str]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(python), "-c", self.CODE], cwd=home, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> dict[str, str]:
        address, _, mode = self.proc.stdout.readline().strip().partition(" ")
        if not address:
            self.__exit__()
        assert address, "the test's Ray did not start"
        return {"RAY_ADDRESS": address, **({"RAY_AUTH_MODE": mode} if mode else {})}

    def __exit__(self, *exc: object) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
