"""What the distribution installs: one namespace, `hylo` (the folders kernels/, pipeline/, jobs/ and configs/ are
hylo.kernels, hylo.pipeline, hylo.jobs and hylo.configs through the symlinks hylo/kernels, ... : the one place
the mapping is written), the same names in a checkout, an editable install and a wheel, no file that loads as
two modules, and nothing that shadows another package (`kernels` is Hugging Face's kernels-hub package)."""

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

from tests.helpers.common import source_copy

REPO = Path(__file__).resolve().parents[2]
# the folders beside hylo/ and the names they have: the symlink hylo/NAME -> ../NAME maps folder NAME
MAPPED = ("kernels", "pipeline", "jobs", "configs")


def package_folders() -> set[str]:
    """Every package of the namespace (a folder with an __init__.py), by its folder in the repository."""
    found = set()
    for name, folder in {"hylo": "hylo", **{f"hylo.{m}": m for m in MAPPED}}.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            if not (REPO / folder).joinpath(*rel.parts[:1]).is_symlink():  # hylo/pipeline is counted as pipeline/
                found.add(".".join([name, *rel.parts]))
    return found


def _find(root: Path) -> set[str]:
    """The packages setuptools installs from `root`, found the way pyproject.toml tells it to."""
    from setuptools import find_namespace_packages, find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return set(finder(str(root), include=find["include"], exclude=find.get("exclude", ())))


@pytest.mark.slow
def test_the_symlinks_in_hylo_are_the_mapping():
    for name in MAPPED:
        link = REPO / "hylo" / name
        # relative, so that it holds in any clone, a wheel's source copy and `ray job submit --working-dir .`
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert link.resolve() == REPO / name
    if shutil.which("git") is not None and (REPO / ".git").exists():
        staged = subprocess.run(["git", "ls-files", "-s", *(f"hylo/{m}" for m in MAPPED)], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.splitlines()
        assert sorted(line.split()[0] for line in staged) == ["120000"] * len(MAPPED), staged  # git's symlink mode
    # no other symlink anywhere below the namespace: nothing maps a folder twice or loops (hylo.hylo...)
    for folder in ("hylo", *MAPPED):
        for dirpath, dirnames, filenames in os.walk(REPO / folder):
            links = [Path(dirpath) / n for n in dirnames + filenames if (Path(dirpath) / n).is_symlink()]
            assert all(p.parent == REPO / "hylo" and p.name in MAPPED for p in links), links
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    setup = config["tool"]["setuptools"]
    assert "package-dir" not in setup and set(setup) == {"packages", "package-data"}, setup
    assert setup["package-data"] == {"hylo.configs": ["*.yaml"]}
    assert _find(REPO) == package_folders()
    assert all(target.startswith("hylo.") for target in config["project"]["scripts"].values())


def test_the_package_search_takes_only_hylo(tmp_path):
    """What could sit beside hylo/ in a clone (a previous build's build/lib/hylo, tests or bench made packages,
    a folder named like hylo) is not installed; a folder without an __init__.py is not a package."""
    for pkg in ("hylo", "pipeline", "pipeline/sub", "build/lib/hylo", "build/lib/hylo/pipeline", "tests",
                "hylo_extra", "hylofoo"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "no_init").mkdir()
    (tmp_path / "pipeline" / "no_init" / "x.py").write_text("")
    (tmp_path / "hylo" / "pipeline").symlink_to("../pipeline")
    assert _find(tmp_path) == {"hylo", "hylo.pipeline", "hylo.pipeline.sub"}


def test_the_checkout_imports_the_installed_names():
    import hylo
    import hylo.jobs.convert
    import hylo.kernels.varlen
    import hylo.pipeline.cli

    assert Path(hylo.pipeline.cli.__file__).resolve() == REPO / "pipeline" / "cli.py"
    assert Path(hylo.pipeline.cli.__file__) == REPO / "hylo" / "pipeline" / "cli.py"  # by its symlink
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


def _python_in_the_checkout(code: str) -> subprocess.CompletedProcess:
    """`python -c CODE` from the checkout's root (its root first on sys.path, as the current directory)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name", ["pipeline", "jobs", "configs", "pipeline.cli", "jobs.convert"])
@pytest.mark.slow
def test_a_folder_refuses_its_top_level_name(name):
    """The checkout's root on sys.path finds pipeline/ also as `pipeline`: it refuses, naming the one name,
    so that no file loads as two modules (two copies of its globals and classes)."""
    package = name.split(".")[0]
    proc = _python_in_the_checkout(f"import hylo, {name}")
    assert proc.returncode == 1, proc
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ImportError: the folder {package}/ is the package hylo.{package}: import hylo.{package}, not {package}")
    # the right name works from the same place
    assert _python_in_the_checkout(f"import hylo.{name}").returncode == 0


@pytest.mark.slow
def test_no_module_loads_under_two_names():
    """hylo.hylo (what the former `__path__` append allowed) and kernels.<module> (our kernels/ found as the
    top-level `kernels` when Hugging Face's package is absent) do not import."""
    code = """
import importlib, sys
import hylo.kernels.varlen, kernels
for name in ("hylo.hylo", "hylo.hylo.pipeline", "kernels.varlen"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        print(name, "refused:", type(e).__name__)
    else:
        print(name, "IMPORTED", sys.modules[name].__file__)
"""
    proc = _python_in_the_checkout(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:3] == ["hylo.hylo refused: ModuleNotFoundError",
                                            "hylo.hylo.pipeline refused: ModuleNotFoundError",
                                            "kernels.varlen refused: ModuleNotFoundError"], proc.stdout


PROBE = """from __future__ import annotations

import json

import torch

import hylo
import hylo.pipeline.cli
from hylo.config import HybridConfig
from hylo.jobs import convert
from hylo.kernels.varlen import doc_bounds
from hylo.pipeline.config import load_config

print(json, torch, hylo, HybridConfig, convert, doc_bounds, load_config)
"""


def _isort_findings(source: str) -> list[str]:
    """ruff's import sorting (the project's settings) of `source` as a file at the checkout's root."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "I",
                           "--output-format", "concise", "--stdin-filename", str(REPO / "probe.py"), "-"],
                          input=source, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    return [line for line in proc.stdout.splitlines() if "I001" in line]


@pytest.mark.slow
def test_import_sorting_sees_every_project_name_as_first_party():
    """hylo, hylo.pipeline.x, hylo.kernels.x and hylo.jobs.x are one first-party section for ruff (it looks
    for each module path below the project root: hylo/pipeline is the symlink), after the third-party one."""
    assert _isort_findings(PROBE) == []
    # the control: the same block with hylo.pipeline among the third-party imports is flagged
    third_party = PROBE.replace("from hylo.pipeline.config import load_config\n", "").replace(
        "import torch\n", "import torch\nfrom hylo.pipeline.config import load_config\n")
    assert third_party != PROBE and len(_isort_findings(third_party)) == 1
    # and one with hylo.kernels in a section of its own
    own_section = PROBE.replace("from hylo.kernels.varlen import doc_bounds\n", "").replace(
        "from hylo.config import", "from hylo.kernels.varlen import doc_bounds\n\nfrom hylo.config import")
    assert own_section != PROBE and len(_isort_findings(own_section)) == 1


def test_the_license_is_an_spdx_expression_for_a_setuptools_that_reads_one():
    """`project.license` as a TOML table (`{ text = ... }`) made every build print setuptools' deprecation
    warning (an error from 2027-02-18): it is an SPDX string, and the build needs a setuptools that reads one
    (77, PEP 639). The wheel test below checks the built METADATA."""
    from packaging.licenses import canonicalize_license_expression
    from packaging.requirements import Requirement
    from packaging.version import Version

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    license = pyproject["project"]["license"]
    assert isinstance(license, str) and canonicalize_license_expression(license) == license
    (setuptools,) = [r for r in map(Requirement, pyproject["build-system"]["requires"]) if r.name == "setuptools"]
    floor = [Version(s.version) for s in setuptools.specifier if s.operator == ">="]
    assert floor and min(floor) >= Version("77"), setuptools


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc



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
    src = source_copy(REPO, tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
          str(tmp_path / "dist"), str(src)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("hylo_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    tops = {n.split("/")[0] for n in names}
    assert tops == {"hylo", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    # every module of the mapped folders under hylo/ (real files, not links), the configs' YAML as package data
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    want = {f if f.startswith("hylo/") else f"hylo/{f}" for f in tracked
            if f.split("/")[0] in ("hylo", *MAPPED) and (f.endswith(".py") or f.startswith("configs/") and
                                                         f.endswith(".yaml"))}
    assert {n for n in names if n.startswith("hylo/")} == want
    assert "hylo/pipeline/cli.py" in want and "hylo/configs/demo-smollm2.yaml" in want

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
            alone = subprocess.run([str(venv / "bin" / "hylo")], cwd=work, env=env, capture_output=True, text=True)
            assert alone.returncode == 2 and alone.stdout == "" and alone.stderr.startswith("usage: hylo"), alone
            dry = _run([str(venv / "bin" / "hylo"), "convert", "--dry-run", "--base-config", str(base_cfg),
                        "--mla-layers", "even"], work, env).stdout
            assert json.loads(dry[dry.index("{"):])["mla_layers"] == [0, 2], dry
        got = json.loads(_run([str(py), "-c", CHECK], work, env).stdout.strip().splitlines()[-1])
        assert got["mark"] == "the other kernels" and Path(got["kernels"]).is_relative_to(site)
        assert got["probe"] == [True, "9.9.9"]
        where = site if mode == "wheel" else src
        assert Path(got["hylo"]).is_relative_to(where), (mode, got)
        assert Path(got["cli"]).resolve() == (site / "hylo" / "pipeline" / "cli.py" if mode == "wheel"
                                              else src / "pipeline" / "cli.py")
        assert Path(got["varlen"]).resolve() == (site / "hylo" / "kernels" / "varlen.py" if mode == "wheel"
                                                 else src / "kernels" / "varlen.py")
        if mode == "wheel":
            assert not (site / "hylo" / "pipeline").is_symlink()
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
        assert Path(got["cli"]) == src / "hylo" / "pipeline" / "cli.py", (cwd, got)
        assert Path(got["varlen"]) == src / "hylo" / "kernels" / "varlen.py", (cwd, got)


@pytest.mark.slow
def test_two_checkouts_on_sys_path_import_kernels_without_recursion(tmp_path: Path):
    """PYTHONPATH=checkout plus Ray's copy of the working directory first on sys.path (ray job submit
    --working-dir): `import kernels` (transformers' probe) must not hand the name back and forth."""
    roots = []
    for name in ("a", "b"):
        root = tmp_path / name
        (root / "kernels").mkdir(parents=True)
        shutil.copy(REPO / "kernels" / "__init__.py", root / "kernels" / "__init__.py")
        roots.append(str(root))
    other = tmp_path / "hub"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text('MARK = "the hub package"\n')
    code = "import kernels; print(getattr(kernels, 'MARK', None), kernels.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for path, mark in ((roots, "None"), ([*roots, str(other)], "the hub package")):
        proc = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": os.pathsep.join(path)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split()[0:len(mark.split())] == mark.split(), proc.stdout
