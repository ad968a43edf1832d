"""The configuration reference (docs page `configuration.md`), generated from the config dataclasses.

    python docs/hooks/config_reference.py                 # print the page (Markdown) on stdout
    python docs/hooks/config_reference.py --out FILE      # write it to FILE

`make docs` (mkdocs.yml `hooks:`) adds the page to the site at build time: it is never written by hand and
never committed, so it cannot drift from the code. For every job of `hylo` (pipeline/cli.py COMMANDS) it
lists each key of the job's config, dotted as `--set` takes it, with its type, its default (what
`--print-config` prints for an empty config), what it accepts (the field's `@rules`: range, choices, path,
...; hylo/rules.py) and the comment written above the field in its dataclass.

Design choices:
* Generic: nested dataclasses are walked whatever they are called. A field whose type is a union of
  dataclasses, or whose default is a dataclass of another class than its annotation names (a registered
  set of sections), lists the keys of each class, marked with the class name. A list of dataclasses is
  `key[].sub`, a mapping of them `key.<name>.sub`.
* Comments: the `#` lines directly above a field (and a trailing `# ...` on its line) in the class that
  declares it (inherited fields from their base class), read with `ast` / `inspect`; the class docstring
  heads its section.
* Which config a job reads is the one table below (`JOBS`); tests/project/test_docs.py fails when a job of COMMANDS
  is missing from it or a key of a config is missing from the page.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import html
import importlib
import inspect
import json
import logging
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

PAGE = "configuration.md"
# under "mkdocs.": `--strict` counts this logger's warnings as errors
log = logging.getLogger("mkdocs.hooks.config_reference")
# job (a COMMANDS name) -> "module:Class" of the config it reads, or the name of another job whose config it
# reads (the estimate, the kernels check and the rehearsal read a training recipe, stage 1 or 2).
JOBS: dict[str, str | tuple[str, ...]] = {
    "convert": "hylo.pipeline.convert:ConvertJobConfig",
    "decontaminate": "hylo.pipeline.data.decontam:DecontamJobConfig",
    "prepare-data": "hylo.pipeline.data.config:PrepareDataConfig",
    "teacher-cache": "hylo.pipeline.teacher.config:TeacherCacheConfig",
    "stage1": "hylo.pipeline.train.config:Stage1Config",
    "stage2": "hylo.pipeline.train.config:Stage2Config",
    "eval": "hylo.pipeline.eval.config:EvalConfig",
    "place-layers": "hylo.pipeline.placement:PlacementConfig",
    "demo": "hylo.pipeline.demo:DemoConfig",
    "serve": "hylo.pipeline.serve:ServeConfig",
    "fetch-assets": "hylo.jobs.fetch_assets:FetchAssetsConfig",
    "estimate": ("stage1", "stage2"),
    "kernels-check": ("stage1", "stage2"),
    "rehearse": ("stage1", "stage2"),
}


@dataclass(frozen=True)
class Key:
    """One documented key of a job's config."""

    key: str
    type: str
    default: str
    accepts: str
    comment: str
    # the class that declares the field (and, for one of several classes a field may hold, that choice)
    owner: str
    variant: str = ""


def config_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------ types
def _strip_none(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) != len(typing.get_args(tp))
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), optional  # noqa: UP007
    return tp, False


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_text(tp: Any) -> str:
    """A type as a reader of YAML wants it: int, float, bool, str, list[int], dict[str, float], X or null."""
    inner, optional = _strip_none(tp)
    origin = typing.get_origin(inner)
    if origin in (typing.Union, types.UnionType):
        text = " or ".join(type_text(a) for a in typing.get_args(inner))
    elif origin in (list, tuple, dict):
        args = typing.get_args(inner)
        name = "list" if origin in (list, tuple) else "dict"
        text = f"{name}[{', '.join(type_text(a) for a in args if a is not Ellipsis)}]" if args else name
    elif _is_section(inner):
        text = f"section {inner.__name__}"
    elif inner is Any:
        text = "any"
    else:
        text = getattr(inner, "__name__", str(inner).replace("typing.", ""))
    return f"{text} or null" if optional else text


def value_text(value: Any) -> str:
    """A default as YAML spells it (JSON is YAML's flow style)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def rule_text(rule: Any) -> str:
    """What a field's rule (hylo.rules.Rule) accepts, in words."""
    if rule is None:
        return ""
    if rule.path:
        text = "a path (relative to the working directory), URI or asset name" + (", not empty" if rule.nonempty else "")
    else:
        text = rule.describe()
        if text == "any value":
            text = ""
    if rule.each and text:
        text = f"every item {text}" + (" (at least one)" if rule.nonempty else "")
    elif rule.each and rule.nonempty:
        text = "at least one item"
    if not rule.finite:
        text += ("; " if text else "") + "may be infinite"
    if rule.note:
        text += f" ({rule.note})"
    return text


# --------------------------------------------------------------------------------------- comments
def _own_class(cls: type, name: str) -> type:
    """The class of `cls`'s MRO that declares field `name`."""
    for base in cls.__mro__:
        if name in base.__dict__.get("__annotations__", {}):
            return base
    return cls


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the `#` comment lines directly above it (and a trailing comment) in `cls`'s own source."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    src_lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    out: dict[str, str] = {}
    for stmt in node.body if node else []:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        i = stmt.lineno - 2
        while i >= 0 and src_lines[i].strip().startswith("#"):
            above.insert(0, src_lines[i].strip().lstrip("#").strip())
            i -= 1
        line = src_lines[stmt.lineno - 1]
        trailing = _trailing_comment(line)
        if trailing:
            above.append(trailing)
        out[stmt.target.id] = " ".join(part for part in above if part)
    return out


def _trailing_comment(line: str) -> str:
    """The `# ...` at the end of a code line (not inside a string), else ""."""
    import io
    import tokenize

    try:
        for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            if tok.type == tokenize.COMMENT:
                return tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return ""
    return ""


def class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__")
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return ""
    return " ".join(doc.split())


# ------------------------------------------------------------------------------------------- walk
def _section_classes(tp: Any, default: Any) -> list[type]:
    """The dataclasses a field may hold: those its annotation names (a union: each) and its default's class."""
    inner, _ = _strip_none(tp)
    found = [a for a in (typing.get_args(inner) if typing.get_origin(inner) in (typing.Union, types.UnionType)
                         else (inner,)) if _is_section(a)]
    if dataclasses.is_dataclass(default) and not isinstance(default, type) and type(default) not in found:
        found.append(type(default))
    return found


def _container_item(tp: Any) -> tuple[str, Any] | None:
    """("[]", item type) for a list of dataclasses, (".<name>", value type) for a mapping of them."""
    inner, _ = _strip_none(tp)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin in (list, tuple) and args and _is_section(args[0]):
        return "[]", args[0]
    if origin is dict and len(args) == 2 and _is_section(args[1]):
        return ".<name>", args[1]
    return None


def _default_of(f: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _instance(cls: type) -> Any:
    """`cls` as an empty config builds it (the defaults `--print-config` shows), or None when it needs keys."""
    from hylo.pipeline.config import from_dict

    try:
        return from_dict(cls, {})
    except Exception:  # noqa: BLE001 - a class with required keys: defaults come from its fields
        return None


def walk(cls: type, prefix: str = "", instance: Any = None, variant: str = "",
         stack: tuple[type, ...] = ()) -> list[Key]:
    """Every key under dataclass `cls` (with its defaults from `instance`, when given), depth first."""
    from hylo.pipeline.config import _field_types, field_rules

    if cls in stack:
        return []
    hints = _field_types(cls)
    rules = field_rules(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        owner = _own_class(cls, f.name)
        comment = field_comments(owner).get(f.name, "")
        default = _default_of(f, instance)
        key = prefix + f.name
        sections = _section_classes(tp, None if default is dataclasses.MISSING else default)
        if default is dataclasses.MISSING:
            shown = "required"
        elif dataclasses.is_dataclass(default) and not isinstance(default, type):
            shown = "(section)"
        else:
            shown = value_text(default)
        item = _container_item(tp)
        out.append(Key(key, type_text(tp), shown, rule_text(rules.get(f.name)), comment, owner.__name__, variant))
        annotated = _strip_none(tp)[0]
        for sub in sections:
            held = default if type(default) is sub else _instance(sub)
            # one of several classes (a union, or a registered class other than the annotation): name it
            label = sub.__name__ if len(sections) > 1 or sub is not annotated else ""
            out += walk(sub, key + ".", held, label or variant, (*stack, cls))
        if item is not None:
            out += walk(item[1], key + item[0] + ".", _instance(item[1]), variant, (*stack, cls))
    return out


# ------------------------------------------------------------------------------------------- page
# a code span: `x` or ``x`` (its content is shown as written)
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
# what Markdown reads as markup outside a code span: emphasis, links, escapes, code
_MARKUP = re.compile(r"([\\`*_\[\]])")


def _escape(text: str) -> str:
    return _MARKUP.sub(r"\\\1", html.escape(text, quote=False))


def md_text(text: str) -> str:
    """`text` (a comment, a type, a rule) as Markdown that shows it as written. Its code spans are kept. Outside
    them a backslash, a backtick, `*`, `_`, `[` and `]` are escaped, and `<`, `>`, `&` written as entities.
    Unescaped, `mla.*/gdn.*/mamba.*` showed as "mla./gdn./mamba.*" with "/gdn." in italics, and the `<run dir>`
    of `<run dir>/model` was an HTML tag the browser hid."""
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out += [_escape(text[pos:m.start()]), m.group(0)]
        pos = m.end()
    out.append(_escape(text[pos:]))
    return "".join(out)


def shown_text(text: str) -> str:
    """What the site shows of `text` written with `md_text`: the code spans' backticks gone, spaces collapsed."""
    return " ".join(_CODE_SPAN.sub(lambda m: m.group(2), text).split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """`text` as one code span (a longer fence when it holds a backtick)."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{_cell(text)}{pad}{fence}"


def _what(k: Key) -> str:
    return f"({k.variant}) " if k.variant else ""


def key_row(k: Key) -> str:
    """The Markdown table row of one key (the variant, the class of a union the key belongs to, in italics)."""
    what = (f"*{_what(k).strip()}* " if k.variant else "") + md_text(k.comment)
    return f"| {key_cell(k.key)} | {_cell(md_text(k.type))} | {_code(k.default)} | {_cell(md_text(k.accepts))} | {_cell(what)} |"


def key_row_text(k: Key) -> list[str]:
    """What the site shows in the cells of `key_row(k)`."""
    return [k.key, shown_text(k.type), " ".join(k.default.split()), shown_text(k.accepts),
            shown_text(_what(k) + k.comment)]


def key_cell(key: str) -> str:
    """A dotted key as inline code that may wrap only after a dot (`<wbr>`; docs/stylesheets/extra.css keeps the browser
    from breaking it anywhere else): `convert.<wbr>kv_lora_rank`, never `convert.kv_l` / `ora_rank`. HTML, not a
    Markdown code span, which would show the `<wbr>` as text; a copied key has no trace of it."""
    return "<code>" + ".<wbr>".join(html.escape(part) for part in key.split(".")) + "</code>"


def job_keys(job: str) -> list[Key]:
    spec = JOBS[job]
    if isinstance(spec, tuple):
        return [k for other in spec for k in job_keys(other)]
    cls = config_class(spec)
    return walk(cls, "", _instance(cls))


def render() -> str:
    from hylo.pipeline.cli import COMMANDS

    # no table of contents beside the page (the job table below is one): its five-column tables get the width
    md = ["---", "hide:", "  - toc", "---", "", "# Configuration reference", "",
          "Generated from the config dataclasses (`docs/hooks/config_reference.py`, run by `make docs`): every key "
          "of every job's config, dotted as `--set` takes it, with its type, its default, what it accepts (the "
          "field's `@rules`) and the comment above the field in the code. How configs are read, overridden and "
          "checked: [Configuration](config-guide.md). `hylo NAME --print-config` prints a job's resolved "
          "config, which loads back with `--config`.", "",
          "| job | config |", "|---|---|"]
    for job in COMMANDS:
        if job not in JOBS:
            continue
        spec = JOBS[job]
        if isinstance(spec, tuple):
            where = ", ".join(f"[{o}](#{o})" for o in spec) + " (a training recipe)"
        else:
            where = f"[`{spec.split(':')[1]}`](#{job}) (`{spec.split(':')[0]}`)"
        md.append(f"| `hylo {job}` | {where} |")
    for job in COMMANDS:
        spec = JOBS.get(job)
        if not isinstance(spec, str):
            continue
        cls = config_class(spec)
        md += ["", f"## {job}", "", f"`hylo {job}` (`python jobs/{job.replace('-', '_')}.py`) reads "
               f"`{cls.__name__}` from `{cls.__module__}`." + (f" {class_doc(cls)}" if class_doc(cls) else ""), ""]
        if job in ("stage1", "stage2"):
            md += ["A training config file may hold both stages: shared top-level sections plus `stage1:` / "
                   "`stage2:` sections that override them for their stage; `--print-config` heads the config "
                   "with `stage: N`.", ""]
        md += ["| key | type | default | accepts | what it is |", "|---|---|---|---|---|"]
        md += [key_row(k) for k in job_keys(job)]
    return "\n".join(md) + "\n"


def page_keys() -> list[Key]:
    """The keys of the page's tables, in the page's order."""
    from hylo.pipeline.cli import COMMANDS

    return [k for job in COMMANDS if isinstance(JOBS.get(job), str) for k in job_keys(job)]


# --------------------------------------------------------------------------- the page as the site shows it
class _TableCells(HTMLParser):
    """The text of each table row made of <td> cells, tags dropped (a browser hides an unknown tag such as
    `<run dir>`, and shows `*` swallowed by <em> nowhere)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "th":
            self._row = None

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def shown_rows(page_html: str) -> list[list[str]]:
    """The key rows (five cells) of the rendered page, as the browser shows their text."""
    parser = _TableCells()
    parser.feed(page_html)
    return [row for row in parser.rows if len(row) == 5]


def misrendered(page_html: str, keys: list[Key] | None = None) -> list[str]:
    """Each key whose row the rendered page shows otherwise than the code writes it (a `*` read as emphasis, a
    `<name>` read as a tag, ...): `key: shows '...', written '...'`."""
    keys = page_keys() if keys is None else keys
    shown = shown_rows(page_html)
    if len(shown) != len(keys):
        return [f"the page shows {len(shown)} key rows, the code has {len(keys)} keys"]
    problems = []
    for k, got in zip(keys, shown):
        want = key_row_text(k)
        for column, g, w in zip(("key", "type", "default", "accepts", "what it is"), got, want):
            if g != w:
                problems.append(f"{k.key} ({column}): shows {g!r}, written {w!r}")
    return problems


# ------------------------------------------------------------------------------------- mkdocs hook
def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files (nothing is written into docs/)."""
    from mkdocs.structure.files import File

    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    files.append(File.generated(config, PAGE, content=render()))
    return files


def on_page_content(page_html: str, page: Any, **kwargs: Any) -> str:
    """mkdocs hook: the generated page is checked as the site shows it; a row that reads otherwise than the code
    is a warning, an error of `mkdocs build --strict`."""
    if page.file.src_uri == PAGE:
        for problem in misrendered(page_html):
            log.warning("%s: %s", PAGE, problem)
    return page_html


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the page here instead of printing it")
    args = ap.parse_args(argv)
    text = render()
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
