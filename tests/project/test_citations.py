"""The repository stands alone: no file cites a document the tree does not hold.

Nine files cited a design document by section ("section 6", "§5") that never shipped, and a test cited another
such note: a user could not read what the configs rest on. What they rest on is now a page of the docs
(docs/recipes.md). This test reads every file of the tree as a reader would and fails on a citation of a missing
document:

* a path under one of the tree's folders (`docs/x.md`, `pipeline/train/README.md`, `cluster/mi300x.yaml`, with an
  anchor `docs/x.md#section` checked against the page's headings as the site renders them);
* a bare Markdown name (`plan.md`) that is neither a file of the tree nor a file the code writes (`report.md`);
* the folder the project was written beside (`../shared`).

In Python files only comments and docstrings cite (a string literal in code is data: a file name a test makes up,
an output the code writes). Inside docs/, links between pages are `mkdocs build --strict`'s (`make docs`); this
test checks what the build cannot see: the README, the code's and the configs' comments, and the paths the pages
name in prose.
"""

from __future__ import annotations

import bisect
import fnmatch
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
# files read as text (the rest, e.g. docs/*.png, cite nothing)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".css", ".json", ".sh", ".cfg", ".rocm", ".cuda"}
TEXT_NAMES = {"Makefile", "run", ".gitignore"}
# what a cited path may end with
CITED = r"md|py|yaml|yml|txt|css|toml|json|sh|cfg"
# placeholders in a path: jobs/NAME.py, jobs/stageN.py, configs/x.yaml, jobs/X.py
PLACEHOLDER = re.compile(r"^(?:NAME|[a-z_]*N|[xX])$")
OUTSIDE = re.compile(r"(?:\.\./|/work/)shared\b")
BARE_MD = re.compile(r"(?<![\w.<>$-])([\w-]+\.md)\b")


@dataclass(frozen=True)
class Citation:
    file: str
    line: int
    cited: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.cited} ({self.why})"


def _ignored_patterns(root: Path) -> list[str]:
    gitignore = root / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.is_file() else []
    return [p.strip().strip("/") for p in lines if p.strip() and not p.startswith("#")] + [".git"]


def tree_files(root: Path) -> list[str]:
    """The files of the tree (relative, '/'-separated): what .gitignore does not ignore, links not followed (hylo/
    pipeline is pipeline/). Read from the file system, not git: `make test-fast` starts no process."""
    ignored = _ignored_patterns(root)
    out = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not any(fnmatch.fnmatch(d, p) for p in ignored)
                         and not (Path(folder) / d).is_symlink())
        out += [(rel / f).as_posix() for f in sorted(files)
                if not any(fnmatch.fnmatch(f, p) for p in ignored) and not (Path(folder) / f).is_symlink()]
    return out


def _is_text(rel: str) -> bool:
    p = Path(rel)
    return p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES


_TRIPLE = re.compile(r'(\"\"\"|\'\'\')(.*?)\1', re.S)
_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')


def prose_lines(rel: str, text: str) -> list[tuple[int, str]]:
    """(line number, text) of what a reader takes as prose: a Python file's comments and docstrings (a
    triple-quoted string that opens a module, or follows a line ending in `:`), any other file whole. Regular
    expressions, not `ast` / `tokenize`: those take ~15 s for the tree's 3.5 MB of Python on a busy 2-core
    machine, this well under one."""
    lines = text.splitlines()
    if not rel.endswith(".py"):
        return list(enumerate(lines, 1))
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    # the last line of code above each line ("" at the top of the file)
    above, last_code = [], ""
    for line in lines:
        above.append(last_code)
        if line.strip() and not line.lstrip().startswith("#"):
            last_code = line.strip()
    out: list[tuple[int, str]] = []
    in_string: set[int] = set()
    for m in _TRIPLE.finditer(text):
        first = bisect.bisect_right(starts, m.start()) - 1
        last = bisect.bisect_right(starts, m.end() - 1) - 1
        in_string.update(range(first, last + 1))
        before = lines[first][:m.start() - starts[first]].strip()
        if before in ("", "r") and (not above[first] or above[first].endswith(":")):
            out += [(first + 1 + i, line) for i, line in enumerate(m.group(2).splitlines())]
    for i, line in enumerate(lines):
        if i in in_string or "#" not in line:
            continue
        blanked = _STRING.sub(lambda s: "x" * len(s.group(0)), line)
        if "#" in blanked:
            out.append((i + 1, line[blanked.index("#"):]))
    return out


def _written_names(root: Path, files: list[str]) -> set[str]:
    """Markdown names the code writes (a string literal of a .py outside tests/): report.md, compare.md, ..."""
    names = set()
    for rel in files:
        if rel.endswith(".py") and not rel.startswith("tests/"):
            names |= set(re.findall(r"""["'/]([\w-]+\.md)["']""", (root / rel).read_text(errors="replace")))
    return names


@cache
def _render_ids(page: Path) -> frozenset[str]:
    """The ids a page's headings get on the site: Python-Markdown with mkdocs.yml's extensions (toc, attr_list)."""
    import markdown

    site = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    names, configs = [], {}
    for ext in site["markdown_extensions"]:
        name, config = next(iter(ext.items())) if isinstance(ext, dict) else (ext, {})
        names.append(name)
        configs[name] = config or {}
    text = re.sub(r"\A---\n.*?\n---\n", "", page.read_text(), flags=re.S)
    rendered = markdown.markdown(text, extensions=names, extension_configs=configs)
    return frozenset(re.findall(r'\bid="([^"]+)"', rendered))


def missing_citations(root: Path = REPO) -> list[Citation]:
    """Every citation in the tree at `root` of a document the tree does not hold."""
    files = tree_files(root)
    names = {Path(f).name for f in files} | _written_names(root, files)
    tops = sorted({f.split("/")[0] for f in files if "/" in f and not f.startswith(".")})
    folders = "|".join(map(re.escape, tops))
    path_re = re.compile(rf"(?<![\w/.<$-])((?:{folders})/[\w./-]*?\w\.(?:{CITED}))(#[\w-]+)?\b")
    found: list[Citation] = []
    for rel in files:
        if not _is_text(rel) or rel == "tests/project/test_citations.py":
            continue
        text = (root / rel).read_text(errors="replace")
        in_docs = rel.startswith("docs/")
        for n, line in prose_lines(rel, text):
            if OUTSIDE.search(line):
                found.append(Citation(rel, n, OUTSIDE.search(line).group(0), "outside the repository"))
            spans = []
            for m in path_re.finditer(line):
                spans.append(m.span())
                cited, anchor = m.group(1), m.group(2)
                if PLACEHOLDER.match(Path(cited).stem):
                    continue
                where = [root / cited, (root / rel).parent / cited, root / "tests" / cited]
                target = next((p for p in where if p.is_file()), None)
                if target is None:
                    found.append(Citation(rel, n, cited, "no such file"))
                elif anchor and target.suffix == ".md" and not in_docs and \
                        anchor[1:] not in _render_ids(target):
                    found.append(Citation(rel, n, cited + anchor, "no such section"))
            for m in BARE_MD.finditer(line):
                if m.group(1) not in names and not any(a <= m.start() < b for a, b in spans):
                    found.append(Citation(rel, n, m.group(1), "no such file"))
    return found


def test_no_file_cites_a_document_the_tree_does_not_hold():
    missing = missing_citations()
    assert not missing, "citations of documents not in the repository:\n" + "\n".join(map(str, missing))


def test_the_check_finds_each_kind_of_missing_citation(tmp_path):
    """A small tree: what a citation of each kind looks like, and what is not one."""
    (tmp_path / ".gitignore").write_text("runs/\n")
    files = {
        "docs/page.md": "# Page\n\n## The teacher {#teacher}\n\n## Evaluation suites\n",
        "docs/index.md": "# Home\n\nSee [the page](page.md#no-such-anchor) (the site's build checks this one).\n",
        "README.md": "Read [the page](docs/page.md#teacher), [the suites](docs/page.md#evaluation-suites), "
                     "[gone](docs/gone.md) and [a section](docs/page.md#no-such-section).\n",
        "configs/run.yaml": "# The suites of plan.md section 6 (docs/page.md#evaluation-suites)\nkey: 1\n",
        "pipeline/job.py": '"""Writes report.md; see notes/plan.md and ../shared/conventions.md."""\n\n'
                           'OUT = "report.md"  # the report (docs/page.md)\n'
                           'FIXTURE = "docs/made-up.md"  # data, not a citation\n'
                           "# python jobs/NAME.py runs a job; pipeline/job.py is this file\n",
        "runs/ignored.md": "plan.md\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = sorted(str(c) for c in missing_citations(tmp_path))
    assert got == sorted([
        "README.md:1: docs/gone.md (no such file)",
        "README.md:1: docs/page.md#no-such-section (no such section)",
        "configs/run.yaml:1: plan.md (no such file)",
        "pipeline/job.py:1: ../shared (outside the repository)",
        "pipeline/job.py:1: plan.md (no such file)",
        "pipeline/job.py:1: conventions.md (no such file)",
    ]), got
