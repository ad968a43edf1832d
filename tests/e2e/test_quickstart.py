"""The README's "Quick start" and docs/stages.md's "Running the stages", run as written, for real, at their
smallest size.

* `test_the_quick_start_then_the_stages_from_an_installed_wheel`: a wheel of this checkout installed into a
  fresh virtualenv (the packages of this test's environment visible: torch, Ray, transformers; nothing of the
  checkout on PYTHONPATH); in a directory outside the checkout, the quick start's commands (`hylo demo` with
  the flags of its smallest run appended, `DEMO_SMALLEST`), then, in the same directory as a user who goes on
  would, the first block of "Running the stages" with `--set` overrides appended that make each job small
  (`SMALLEST`; later --set wins). Its jobs join one local Ray started for them (by the installed package, in
  yet another directory). Then the cards of the demo's models as a Hub user reads them (huggingface_hub's
  ModelCard).
* `test_the_checkout_block_from_the_repository_root`: the checkout block of "Running the stages" (`python
  jobs/NAME.py --config configs/...`) in a directory laid out as the repository's root (jobs/, configs/ and
  the packages linked, its own runs/), small the same way.

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
import zipfile
from pathlib import Path

import pytest

from tests.helpers.common import source_copy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SMALLEST = {
    "prepare-data": ["--set", "packing.max_len=128", "--set", "packing.window=64",
                     "--set", 'mixture.sources=[{name: sharegpt, path: "asset:sharegpt", limit: 40}]'],
    # one worker, one step of one 128-token row
    "stage1": ["--set", "ray.num_workers=1", "--set", "train.global_batch_sequences=1", "--set", "train.total_steps=1",
               "--set", "checkpoint.every_steps=1", "--set", "checkpoint.delete_after_consolidate=true",
               "--set", "model.activation_checkpointing=false"],
    "eval": ["--set", "kl.max_rows=1", "--set", "kvcache.lengths=[64]", "--set", "kvcache.decode_tokens=2"],
}
SMALLEST["stage2"] = SMALLEST["stage1"]
DEMO_SMALLEST = ["--steps", "1", "--records", "40", "--heldout", "8", "--heldout-rows", "1", "--seq-len", "128",
                 "--kv-lengths", "[64]"]


def readme_blocks(title: str) -> list[list[str]]:
    """The commands (a line with its `\\` continuations, comments dropped) of each bash block of section
    `title`, block by block: a `## title` of the README or a `# title` / `## title` of a docs/ page (up to its
    next `##`)."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        found = re.search(rf"^##? {re.escape(title)}\n", path.read_text(), re.M)
        if found:
            break
    assert found, f"no section {title!r} in README.md or docs/*.md"
    body = found.string[found.end():].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", body, re.S)
    assert blocks, f"section {title!r} of {path.name} has no bash block"
    out = []
    for block in blocks:
        lines = [shlex.join(shlex.split(line, comments=True)) for line in block.replace("\\\n", " ").splitlines()]
        out.append([line for line in lines if line])
    return out


def job_of(argv: list[str]) -> str | None:
    """`hylo NAME ...` / `python jobs/NAME.py ...` -> NAME (with dashes), else None."""
    if argv[0] == "hylo" and len(argv) > 1:
        return argv[1]
    m = re.fullmatch(r"jobs/(\w+)\.py", argv[1]) if len(argv) > 1 and Path(argv[0]).name.startswith("python") else None
    return m.group(1).replace("_", "-") if m else None


def run(cmd: str, cwd: Path, env: dict[str, str], python: str | None = None, timeout: int = 900) -> str:
    """Run README command `cmd` in `cwd`, made small (SMALLEST, DEMO_SMALLEST); its output. `python`: the
    interpreter a `python ...` line runs."""
    argv = shlex.split(cmd)
    job = job_of(argv)
    if "--help" not in argv and "--print-config" not in argv:
        argv += DEMO_SMALLEST if job == "demo" else SMALLEST.get(job or "", [])
    if argv[0] == "python" and python:
        argv[0] = python
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{shlex.join(argv)}` in {cwd}: exit {proc.returncode}\n{out[-4000:]}"
    return out


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1", **more}


def printed_once(out: str, pattern: str) -> None:
    """Each line a training worker printed reached the output once (Ray Train's print patch doubled them)."""
    lines = [ln.split(") ", 1)[-1] for ln in out.splitlines() if re.search(pattern, ln)]
    assert lines and len(lines) == len(set(lines)), f"{pattern}: {lines}"


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


def test_the_quick_start_then_the_stages_from_an_installed_wheel(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to copy the tracked files")
    (quick,) = readme_blocks("Quick start")
    assert [c.split()[:2] for c in quick] == [["pip", "install"], ["hylo", "fetch-assets"], ["hylo", "demo"],
                                            ["hylo", "configs"]], quick
    stages = readme_blocks("Running the stages")[0]
    assert [job_of(shlex.split(c)) for c in stages] == ["prepare-data", "prepare-data", "stage1", "stage2", "eval"]
    bin_dir = installed_wheel(tmp_path)  # `pip install .`
    venv = bin_dir.parent
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = {cmd.split()[1]: run(cmd, work, env) for cmd in quick[1:]}
    # the demo ran the installed package's jobs, with its shipped configs, in this directory
    site_dir = next((venv / "lib").glob("python3*/site-packages"))
    assert f"{site_dir}/hylo/configs/demo-smollm2.yaml" in out["demo"]
    assert not re.search(rf"{re.escape(str(REPO))}/(hylo|pipeline|jobs|kernels|configs)/", out["demo"])
    demo = work / "runs" / "demo"
    assert "KL(teacher || student), after stage 2" in (demo / "report.md").read_text()
    assert "demo-smollm2.yaml" in out["configs"]
    printed_once((demo / "logs" / "stage1.log").read_text(), r"\[stage1\] step \d+/")
    cards = {name: (demo / name / "README.md").read_text() for name in ("converted", "stage2/model")}

    # "Running the stages" where the demo ran, relative paths, its jobs on one Ray
    with shared_ray(bin_dir / "python", tmp_path / "ray-home", env) as join:
        outs = [run(cmd, work, {**env, **join}) for cmd in stages]
    for split in ("stage1", "stage2"):
        assert json.loads((demo / "data" / split / "manifest.json").read_text())["max_len"] == 128
    for stage, text in (("stage1", outs[2]), ("stage2", outs[3])):
        assert (demo / stage / "model" / "hybrid_config.json").is_file()
        assert f"[{stage}] step 1/1" in text
        printed_once(text, rf"\[{stage}\] step \d+/")
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
