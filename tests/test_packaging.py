"""What the distribution installs: one namespace, `hylo` (the folders kernels/, pipeline/ and jobs/ are
hylo.kernels, hylo.pipeline and hylo.jobs), the same names in a checkout, an editable install and a wheel,
and nothing that shadows another package (`kernels` is Hugging Face's kernels-hub package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"hylo": "hylo", "hylo.kernels": "kernels", "hylo.pipeline": "pipeline", "hylo.jobs": "jobs",
           "hylo.configs": "configs"}


def package_folders() -> set[str]:
    """Every package of the namespace, by its folder in the repository."""
    found = set()
    for name, folder in FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    return found


def test_pyproject_maps_the_folders_and_lists_every_package():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == FOLDERS
    assert set(setup["packages"]) == package_folders()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.startswith("hylo.") for target in scripts.values()), scripts


def test_the_checkout_imports_the_installed_names():
    import hylo.jobs.convert
    import hylo.kernels.varlen
    import hylo.pipeline.cli

    import hylo

    assert Path(hylo.pipeline.cli.__file__).resolve() == REPO / "pipeline" / "cli.py"
    assert Path(hylo.kernels.varlen.__file__).resolve() == REPO / "kernels" / "varlen.py"
    assert Path(hylo.jobs.convert.__file__).resolve() == REPO / "jobs" / "convert.py"
    # no module of the project under a top-level name; the one exception is the empty kernels/__init__.py that
    # transformers' probe for the kernels-hub package imports when the checkout's root is on sys.path (it has no
    # version, so transformers reports the hub package as not available), and nothing below it
    top = {m for m in sys.modules if m.split(".")[0] in ("kernels", "pipeline", "jobs")
           and str(REPO) in str(getattr(sys.modules[m], "__file__", None) or "")}
    assert top <= {"kernels"}, sorted(top)
    # the model code saved with a checkpoint keeps its file names
    from hylo.remote_code import bundle_sources

    files = bundle_sources()
    assert "kernels_varlen.py" in files and not any(f.startswith("hylo_kernels") for f in files)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc


def _source_copy(dst: Path) -> Path:
    """The repository's tracked files (what `pip install .` of a clone sees), without runs or caches."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    return dst


def _venv(path: Path, env: dict[str, str]) -> Path:
    """A fresh virtualenv that sees the packages of the environment running the tests (torch, transformers,
    setuptools, wheel, ...) behind its own: a `.pth` file lists this interpreter's site directories.
    (`python -m venv --system-site-packages` run from a virtualenv's Python would see the base
    interpreter's packages instead, which may lack all of them, e.g. `wheel`: `invalid command 'bdist_wheel'`.)"""
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)], path.parent, env)
    py = path / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path.parent,
                     env).stdout.strip())
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "zz_test_environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return py


CHECK = r"""
import json, sys, importlib.metadata as md
import hylo, hylo.kernels.varlen, hylo.pipeline.cli, hylo.jobs.convert
other = __import__("kernels")  # the other package (written so that the rename command leaves it alone)
from transformers.utils.import_utils import _is_package_available
print(json.dumps({"kernels": other.__file__, "mark": other.MARK, "hylo": hylo.__file__,
                  "cli": hylo.pipeline.cli.__file__, "varlen": hylo.kernels.varlen.__file__,
                  "probe": list(_is_package_available("kernels", return_version=True)),
                  "top_level": sorted({p.split("/")[0] for p in
                                       (str(f) for f in md.distribution("hylo-pipeline").files or [])})}))
"""


@pytest.mark.slow
def test_wheel_and_editable_install_beside_a_package_named_kernels(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to copy the tracked files")
    src = _source_copy(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hylo_pipeline-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"hylo", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops

    # a package named kernels (as Hugging Face's kernels-hub is), installed first
    other = tmp_path / "other"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text('MARK = "the other kernels"\n')
    (other / "pyproject.toml").write_text('[project]\nname = "kernels"\nversion = "9.9.9"\n'
                                          '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n')

    base_cfg = tmp_path / "config.json"
    base_cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 256}))
    work = tmp_path / "work"
    work.mkdir()
    for mode in ("wheel", "editable"):
        # a fresh virtualenv each (the test environment's packages visible, torch and transformers among them)
        venv = tmp_path / f"venv-{mode}"
        py = _venv(venv, env)
        pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
               "--no-build-isolation", "--ignore-installed"]
        _run([*pip, str(other)], tmp_path, env)
        _run([*pip, *([str(wheel)] if mode == "wheel" else ["-e", str(src)])], tmp_path, env)
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        if mode == "wheel":
            out = _run([str(venv / "bin" / "hylo"), "--help"], work, env).stdout
            assert "convert" in out and "place-layers" in out and "fetch-assets" in out
            dry = _run([str(venv / "bin" / "hylo"), "convert", "--dry-run", "--base-config", str(base_cfg),
                        "--mla-layers", "even"], work, env).stdout
            assert json.loads(dry[dry.index("{"):])["mla_layers"] == [0, 2], dry
        got = json.loads(_run([str(py), "-c", CHECK], work, env).stdout.strip().splitlines()[-1])
        assert got["mark"] == "the other kernels" and Path(got["kernels"]).is_relative_to(site)
        assert got["probe"] == [True, "9.9.9"]
        where = site if mode == "wheel" else src
        assert Path(got["hylo"]).is_relative_to(where), (mode, got)
        assert Path(got["cli"]) == (site / "hylo" / "pipeline" / "cli.py" if mode == "wheel" else src / "pipeline" / "cli.py")
        assert Path(got["varlen"]) == (site / "hylo" / "kernels" / "varlen.py" if mode == "wheel"
                                       else src / "kernels" / "varlen.py")
        if mode == "wheel":
            assert {t for t in got["top_level"] if not t.endswith(".dist-info") and t != ".."} == {"hylo"}, got

    # a checkout used without installing (root on sys.path, as PYTHONPATH or `ray job submit --working-dir .`
    # put it) beside the other kernels package: both import, and transformers' probe finds the other one
    venv = tmp_path / "venv-checkout"
    py = _venv(venv, env)
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
          "--no-build-isolation", "--ignore-installed", str(other)], tmp_path, env)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    check = CHECK.replace('md.distribution("hylo-pipeline").files or []', "[]")
    for cwd in (src, work):
        got = json.loads(_run([str(py), "-c", check], cwd, {**env, "PYTHONPATH": str(src)}).stdout
                         .strip().splitlines()[-1])
        assert got["mark"] == "the other kernels" and Path(got["kernels"]).is_relative_to(site), (cwd, got)
        assert got["probe"] == [True, "9.9.9"], (cwd, got)
        assert Path(got["cli"]) == src / "pipeline" / "cli.py" and Path(got["varlen"]) == src / "kernels" / "varlen.py"
