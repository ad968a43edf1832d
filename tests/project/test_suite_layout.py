"""The test suite's own layout, read from its source with `ast` (nothing imported or run):

* every test file is in a folder of its part, and every folder is a package (so two files may share a name);
* a pytest marker decorates tests only: on a helper or a fixture it does nothing (a `@pytest.mark.slow` helper
  leaves the test that calls it in `make test-fast`), so one there is an error here;
* no test module imports another: what tests share is in tests/helpers/;
* every path of a test file the repository's text names (docs, comments, help texts) exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# where the repository's text is (hylo/'s symlinks lead to these folders again)
TEXT_FOLDERS = ("hylo", "kernels", "pipeline", "jobs", "configs", "bench", "cluster", "docs", "tests", ".ci")
TEXT_FILES = ("README.md", "pyproject.toml", "Makefile", "constraints.txt")
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".txt", ".toml", "")
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/]+\.py")


def _sources(root: Path) -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _mark_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to pytest's marks: `from pytest import mark`, `slow = pytest.mark.slow`."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            names |= {a.asname or a.name for a in node.names if a.name == "mark"}
        elif isinstance(node, ast.Assign) and _is_mark(node.value, names):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_mark(node: ast.expr, mark_names: set[str]) -> bool:
    """`pytest.mark.X`, `pytest.mark.X(...)` or a name bound to one (`mark.X`, `slow`)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in mark_names
    while isinstance(node, ast.Attribute):
        inner = node.value
        if isinstance(inner, ast.Attribute) and inner.attr == "mark" and isinstance(inner.value, ast.Name) \
                and inner.value.id == "pytest":
            return True
        if isinstance(inner, ast.Name) and inner.id in mark_names:
            return True
        node = inner
    return False


def _is_fixture(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) in ("pytest.fixture", "fixture")


def _collected(node: ast.AST, parents: list[ast.AST]) -> bool:
    """What pytest collects: `test*` functions at module level or in a `Test*` class, `Test*` classes."""
    if isinstance(node, ast.ClassDef):
        return node.name.startswith("Test") and not parents
    in_class = (len(parents) == 1 and isinstance(parents[0], ast.ClassDef)
                and parents[0].name.startswith("Test"))
    return node.name.startswith("test") and (not parents or in_class)


def marked_non_tests(root: Path) -> list[str]:
    """`file:line name` of every function or class under `root` a marker decorates that pytest does not
    collect as a test (a helper, a nested function, a fixture)."""
    found = []

    def visit(path: Path, node: ast.AST, parents: list[ast.AST], mark_names: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                marks = [d for d in child.decorator_list if _is_mark(d, mark_names)]
                fixture = any(_is_fixture(d) for d in child.decorator_list)
                if marks and (fixture or not _collected(child, parents)):
                    what = "fixture" if fixture else "not a test"
                    found.append(f"{path.relative_to(root)}:{child.lineno} {child.name} ({what}): "
                                 + ", ".join(ast.unparse(m) for m in marks))
                visit(path, child, [*parents, child], mark_names)
            else:
                visit(path, child, parents, mark_names)

    for path, tree in _sources(root):
        visit(path, tree, [], _mark_names(tree))
    return found


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in dotted.split("."))


def imports_of_test_modules(root: Path) -> list[str]:
    """`file:line module` of every import of a test module (test_*.py, conftest.py) under `root`."""
    found = []
    for path, tree in _sources(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                # `from tests.model import test_released`, `from . import test_x`: the names are modules
                sep = "" if module.endswith(".") else "."
                names = [module] if _is_test_module(module) else [f"{module}{sep}{a.name}" for a in node.names
                                                                   if _is_test_module(a.name)]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in names
                      if _is_test_module(name)]
    return found



def test_every_test_file_is_in_the_package_of_its_part():
    files = sorted(TESTS.rglob("test_*.py"))
    assert files
    misplaced = [str(p.relative_to(TESTS)) for p in files
                 if p.parent.parent != TESTS or p.parent.name == "helpers"]
    assert not misplaced, f"test files outside tests/<part>/ (put each in its part's folder): {misplaced}"
    no_init = sorted({str(p.parent) for p in TESTS.rglob("*.py") if not (p.parent / "__init__.py").is_file()})
    assert not no_init, f"folders of tests/ that are not packages: {no_init}"


def test_every_test_path_the_repository_names_exists():
    files = {p.resolve() for p in (REPO / f for f in TEXT_FILES) if p.is_file()}
    for folder in TEXT_FOLDERS:
        files |= {p.resolve() for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix in TEXT_SUFFIXES}
    stale = sorted({f"{f.relative_to(REPO)}: {m}" for f in files
                    for m in TEST_PATH.findall(f.read_text(errors="replace")) if not (REPO / m).is_file()})
    assert not stale, "paths of test files that do not exist:\n" + "\n".join(stale)


def test_markers_decorate_only_tests():
    found = marked_non_tests(TESTS)
    assert not found, "markers on what pytest does not collect as a test (mark the tests that use it):\n" \
        + "\n".join(found)


def test_no_test_module_imports_another():
    found = imports_of_test_modules(TESTS)
    assert not found, "test modules imported (move what they share to tests/helpers/):\n" + "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("@pytest.mark.slow\ndef helper():\n    pass\n", ["helper (not a test)"]),
    ("@pytest.mark.slow\ndef test_ok():\n    pass\n", []),
    ("slow = pytest.mark.slow\n@slow\ndef _start_ray():\n    pass\n", ["_start_ray (not a test)"]),
    ("from pytest import mark\n@mark.parametrize('x', [1])\ndef check(x):\n    pass\n",
     ["check (not a test)"]),
    ("@pytest.fixture\n@pytest.mark.slow\ndef ray():\n    yield\n", ["ray (fixture)"]),
    ("def test_outer():\n    @pytest.mark.slow\n    def test_inner():\n        pass\n",
     ["test_inner (not a test)"]),
    ("@pytest.mark.slow\nclass TestRay:\n    @pytest.mark.slow\n    def test_a(self):\n        pass\n"
     "    @pytest.mark.slow\n    def start(self):\n        pass\n", ["start (not a test)"]),
    ("@pytest.mark.slow\nclass Cluster:\n    pass\n", ["Cluster (not a test)"]),
])
def test_the_marker_check_finds_marked_helpers(tmp_path, source, expected):
    (tmp_path / "test_x.py").write_text("import pytest\n" + source)
    found = marked_non_tests(tmp_path)
    assert [f.split(" ", 1)[1].split(":")[0] for f in found] == expected, found


@pytest.mark.parametrize("source,expected", [
    ("import test_released as rel\n", ["test_released"]),
    ("from test_train_e2e import torchrun\n", ["test_train_e2e"]),
    ("def f():\n    from tests.model.test_config import walk\n", ["tests.model.test_config"]),
    ("from tests.model import test_released\n", ["tests.model.test_released"]),
    ("from . import test_x\n", [".test_x"]),
    ("from conftest import thing\n", ["conftest"]),
    ("from tests.helpers.train import torchrun\nimport hylo.released\nfrom x import tested\n", []),
])
def test_the_import_check_finds_test_modules(tmp_path, source, expected):
    (tmp_path / "test_x.py").write_text(source)
    assert [f.split(" ", 1)[1] for f in imports_of_test_modules(tmp_path)] == expected
