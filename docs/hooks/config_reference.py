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
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = "configuration.md"
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
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def key_cell(key: str) -> str:
    """A dotted key as inline code that may wrap only after a dot (`<wbr>`; docs/css/extra.css keeps the browser
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
        for k in job_keys(job):
            what = (f"*({k.variant})* " if k.variant else "") + k.comment
            md.append(f"| {key_cell(k.key)} | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.accepts)} | {_cell(what)} |")
    return "\n".join(md) + "\n"


# ------------------------------------------------------------------------------------- mkdocs hook
def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated page to the site's files (nothing is written into docs/)."""
    from mkdocs.structure.files import File

    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    files.append(File.generated(config, PAGE, content=render()))
    return files


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
