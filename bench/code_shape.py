"""How the code base reads: prose length, imports inside functions, sequence-parallel branches.

    python bench/code_shape.py            # this checkout
    python bench/code_shape.py --json     # the same figures as one JSON object

Figures (each one printed with what it counts):
* words per sentence of README.md, each docs/*.md page (docs/results.md, the measurement log, apart) and the
  code folders' READMEs;
* imports of the project's own modules (`hylo.*`, `pipeline.*`, `kernels.*`, `jobs.*`) in hylo/, kernels/,
  pipeline/, jobs/ and bench/, and how many of them sit inside a function;
* branches on the sequence-parallel setting (`if` tests naming `sp_size`, `sequence_parallel`, `shard` or
  `RowShard`) outside `hylo/seq_parallel.py`, the split path's own module.

How a sentence is counted: fenced code, tables, HTML comments and front matter are left out; a heading, a
list item and a paragraph each end a sentence; inside them a sentence ends at `.`, `!` or `?` followed by a
space and a capital, digit, quote or bracket (never after e.g., i.e., vs.). A word is a run of non-space characters holding a letter or a digit; an inline code span
or a link counts as the words of its text.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("hylo", "pipeline", "kernels", "jobs")
CODE_DIRS = ("hylo", "kernels", "pipeline", "jobs", "bench")
SP_NAMES = re.compile(r"\b(sp_size|sequence_parallel|shard|RowShard)\b")

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_CODE = re.compile(r"`([^`]*)`")
# a sentence ends at . ! ? (after closing quotes or brackets) before a space and a capital, digit, quote or
# bracket; never after e.g., i.e., vs., etc. or cf.
_END = re.compile(r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\bvs\.)(?<!\betc\.)(?<!\bcf\.)(?<=[.!?])[\"')\]]*\s+"
                  r"(?=[A-Z0-9`\"'(\[*_])")
_WORD = re.compile(r"[A-Za-z0-9]")
_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")


def prose_units(text: str) -> list[str]:
    """The text of a Markdown page as units that end a sentence (paragraphs, list items, headings)."""
    units: list[str] = []
    current: list[str] = []
    fenced = comment = False
    lines = text.splitlines()
    if lines and lines[0].strip() == "---":  # front matter
        end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), 0)
        lines = lines[end + 1:]

    def flush() -> None:
        if current:
            units.append(" ".join(current))
            current.clear()

    for line in lines:
        if _FENCE.match(line):
            fenced = not fenced
            flush()
            continue
        if fenced:
            continue
        if "<!--" in line:
            comment = "-->" not in line.split("<!--", 1)[1]
            flush()
            continue
        if comment:
            comment = "-->" not in line
            continue
        s = line.strip()
        if not s or s.startswith("|"):
            flush()
            continue
        if s.startswith("#") or _ITEM.match(line) or s.startswith(">"):
            flush()
            s = _ITEM.sub("", s).lstrip("#> ").strip()
        current.append(s)
    flush()
    return units


def sentences(text: str) -> list[int]:
    """Words of each sentence of a Markdown page."""
    out = []
    for unit in prose_units(text):
        unit = _CODE.sub(lambda m: m.group(1), _LINK.sub(lambda m: m.group(1), unit))
        for sentence in _END.split(unit):
            words = [w for w in sentence.split() if _WORD.search(w)]
            if words:
                out.append(len(words))
    return out


def prose(root: Path) -> dict[str, dict[str, float]]:
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted(p for d in CODE_DIRS for p in (root / d).rglob("README.md") if not p.is_symlink())]
    figures = {}
    for page in pages:
        if page.exists():
            n = sentences(page.read_text(encoding="utf-8"))
            figures[str(page.relative_to(root))] = {
                "sentences": len(n), "words": sum(n), "mean": round(sum(n) / max(len(n), 1), 1),
                "longest": max(n, default=0)}
    return figures


def _own(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in OWN for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in OWN
    return False


def _python_files(root: Path) -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (root / d).rglob("*.py") if p.is_file() and not p.is_symlink()
                  and "configs" not in p.parts)


def imports(root: Path) -> dict[str, object]:
    total = inside = 0
    by_file: dict[str, int] = {}
    for path in _python_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_function: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
        for node in ast.walk(tree):
            if _own(node):
                total += 1
                if id(node) in in_function:
                    inside += 1
                    rel = str(path.relative_to(root))
                    by_file[rel] = by_file.get(rel, 0) + 1
    top = dict(sorted(by_file.items(), key=lambda kv: -kv[1])[:10])
    return {"own_imports": total, "inside_functions": inside, "most_inside": top}


def sp_branches(root: Path) -> dict[str, object]:
    by_file: dict[str, int] = {}
    for path in _python_files(root):
        rel = str(path.relative_to(root))
        if rel == "hylo/seq_parallel.py":
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            test = getattr(node, "test", None) if isinstance(node, (ast.If, ast.IfExp, ast.While)) else None
            if test is not None and SP_NAMES.search(ast.get_source_segment(source, test) or ""):
                by_file[rel] = by_file.get(rel, 0) + 1
    return {"branches": sum(by_file.values()), "files": len(by_file), "by_file": by_file}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    pages = prose(args.root)
    reading = {k: v for k, v in pages.items() if k == "README.md" or k.startswith("docs/") and k != "docs/results.md"}
    words = sum(v["words"] for v in reading.values())
    count = sum(v["sentences"] for v in reading.values())
    figures = {"prose": pages, "prose_mean": round(words / max(count, 1), 1), "imports": imports(args.root),
               "sp_branches": sp_branches(args.root)}
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    print("words per sentence (README.md, docs/*.md, the code folders' READMEs; docs/results.md, the log, apart):")
    for page, f in pages.items():
        print(f"  {page:32} {f['mean']:5.1f}  longest {f['longest']:3d}  ({f['sentences']} sentences)")
    print(f"  {'README.md + docs/ (not results.md)':32} {figures['prose_mean']:5.1f}")
    imp = figures["imports"]
    print(f"imports of the project's own modules: {imp['own_imports']}, inside functions: {imp['inside_functions']}")
    for f, n in imp["most_inside"].items():
        print(f"  {f:48} {n}")
    sp = figures["sp_branches"]
    print(f"branches on the sequence-parallel setting outside hylo/seq_parallel.py: {sp['branches']} "
          f"in {sp['files']} files")
    for f, n in sorted(sp["by_file"].items()):
        print(f"  {f:48} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
