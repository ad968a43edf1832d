"""How the project's modules depend on each other: no import cycle, and configs as leaves.

The import graph is read from the source with `ast` (every `import` and `from ... import`, at module level
or inside a function: a lazy import that closes a cycle still ties two modules to each other), over the
folders of the namespace (hylo/, kernels/, pipeline/, jobs/ as hylo, hylo.kernels, hylo.pipeline,
hylo.jobs). A config module (`*/config.py`) is what implementations import, never the reverse: importing
one loads only other config modules, the packages around them, hylo.rules (the `@rules` mechanism),
hylo.atomic / hylo.json_files / hylo.bounded_read (atomic writes, JSON reading, bounded reads) and hylo.logs
(the --log-level flag), all leaves.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"hylo": "hylo", "kernels": "hylo.kernels", "pipeline": "hylo.pipeline", "jobs": "hylo.jobs"}
# Modules a config may import besides configs and packages: leaves that import nothing of the project.
LEAF_HELPERS = {"hylo.atomic", "hylo.json_files", "hylo.rules", "hylo.model_files", "hylo.lazy", "hylo.logs",
                "hylo.bounded_read"}
# The one leaf the others may import: the bounded read of a file (JSON and YAML files are read through it).
BASE_LEAF = "hylo.bounded_read"


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the namespace under `root`."""
    mods = {}
    for folder, name in FOLDERS.items():
        for path in (root / folder).rglob("*.py"):
            parts = [name, *path.relative_to(root / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from a.b import c` is a.b.c when that is a module)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names += [f"{node.module}.{a.name}" for a in node.names]
        graph[mod] = {t for n in names if (t := resolve(n)) is not None and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_lazy_and_from_imports(tmp_path):
    (tmp_path / "hylo").mkdir()
    for folder in ("kernels", "pipeline", "jobs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "hylo" / "__init__.py").write_text("")
    (tmp_path / "hylo" / "a.py").write_text("def f():\n    from hylo.b import g\n")
    (tmp_path / "hylo" / "b.py").write_text("import hylo.a\nfrom hylo import c\n")
    (tmp_path / "hylo" / "c.py").write_text("from hylo.pipeline.x import y\n")
    (tmp_path / "pipeline" / "x.py").write_text("")
    graph = import_graph(project_modules(tmp_path))
    assert graph["hylo.a"] == {"hylo.b"} and graph["hylo.b"] == {"hylo.a", "hylo.c"}
    assert graph["hylo.c"] == {"hylo.pipeline.x"}
    assert cycles(graph) == [["hylo.a", "hylo.b"]]


def test_no_import_cycle_among_the_project_modules():
    mods = project_modules()
    assert len(mods) > 100 and "hylo.pipeline.train.stage2" in mods
    assert cycles(import_graph(mods)) == []


CONFIG_MODULES = sorted(m for m in project_modules() if m.rpartition(".")[2] == "config")


def test_every_config_module_is_found():
    assert {"hylo.config", "hylo.pipeline.config", "hylo.pipeline.data.config", "hylo.pipeline.train.config",
            "hylo.pipeline.eval.config", "hylo.pipeline.teacher.config"} <= set(CONFIG_MODULES)


def _loaded_by(module: str) -> list[str]:
    code = (f"import importlib, json, sys; importlib.import_module({module!r}); "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'hylo' or m.startswith('hylo.'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("module", CONFIG_MODULES)
def test_a_config_imports_no_implementation(module):
    mods = project_modules()
    graph = import_graph(mods)
    configs = {m for m in mods if m.rpartition(".")[2] == "config"} | LEAF_HELPERS
    # A package is passed through on the way to a config; one whose __init__ imports more is an implementation.
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    light = {m for m in packages if graph[m] <= configs | packages}
    implementations = [m for m in _loaded_by(module) if m not in configs | light]
    assert implementations == [], f"importing {module} loads implementation modules {implementations}"


def private_imports(root: Path = REPO) -> list[str]:
    """`from M import _name` in bench/*.py and jobs/*.py where M is a project module (hylo.*, a relative import, or
    a sibling script of bench/ or jobs/): 'file:line: from M import _name' for each."""
    found = []
    for folder in ("bench", "jobs"):
        siblings = {p.stem for p in (root / folder).glob("*.py")}
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                module = node.module or ""
                top = module.partition(".")[0]
                if node.level == 0 and top != "hylo" and top not in siblings:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{folder}/{path.name}:{node.lineno}: from {'.' * node.level}{module} "
                                     f"import {alias.name}")
    return found


def test_the_private_import_finder_finds_planted_ones(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "bench" / "a.py").write_text("from hylo.pipeline.x import _y, z\nfrom os import _exit\n"
                                             "def f():\n    from b import _helper\n")
    (tmp_path / "bench" / "b.py").write_text("from __future__ import annotations\nfrom torch import _C\n")
    (tmp_path / "jobs" / "c.py").write_text("from . import _d\nfrom hylo import __version__\n")
    assert private_imports(tmp_path) == ["bench/a.py:1: from hylo.pipeline.x import _y",
                                         "bench/a.py:4: from b import _helper", "jobs/c.py:1: from . import _d"]


def test_no_bench_or_job_imports_a_private_name():
    """A bench or a job uses what a module offers (a private name can change under it unseen): one way to build a
    stage's step (`stage1.build` / `stage2.build`), the estimator's public names."""
    assert private_imports() == []


def test_the_leaf_helpers_import_nothing_of_the_project():
    """Nothing but the base leaf (the bounded read every reader of a file uses), which imports nothing itself."""
    graph = import_graph(project_modules())
    assert {m: graph[m] - {BASE_LEAF} for m in LEAF_HELPERS} == {m: set() for m in LEAF_HELPERS}
    assert graph[BASE_LEAF] == set()
