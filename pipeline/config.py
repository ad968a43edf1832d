"""The project's one configuration system: nested dataclasses <- YAML, with dotted CLI overrides.

Every job declares its configuration as a tree of dataclasses. `load_config(Cls, path, overrides)`
reads YAML, applies `--set a.b=c` overrides (values parsed as YAML scalars), and builds the
dataclasses, rejecting unknown keys with the list of valid ones. `config_hash` gives a stable
fingerprint used by checkpoints and data manifests.

Values are checked when a config is built, before any job starts Ray or loads a model:
* each field states what it accepts once, next to its class, with `@rules(field=Rule, ...)` (hylo/rules.py) below
  `@dataclass` (`at_least(1)`, `above(0)`, `between(0, 1)`, `one_of(...)`, `RELATIVE_NAME`, `each(...)`);
  the rules run on every construction (YAML, `--set`, code), before the class's own `__post_init__`
  cross-field checks;
* every float (also inside lists and mappings) must be finite unless its rule says `finite=False`;
* a YAML mapping that repeats a key is an error naming the key and both lines (PyYAML would keep the
  last one silently); a config file must be UTF-8;
* a YAML document may nest at most 64 levels and its aliases may stand for at most 10,000 nodes in all (no
  alias bombs, no recursive aliases: hylo/yaml_limits.py), checked before anything is built from it;
* errors name where the value came from: `<file> line N: key=value: must be ...` or `command line: ...`.

This module imports neither Ray nor torch, so any job (and `hylo/` tooling) can use it.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import copy
import dataclasses
import hashlib
import importlib.resources
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hylo.bounded_read import read_bounded
from hylo.logs import add_log_level_flag
from hylo.rules import (  # noqa: F401  (the rule mechanism, re-exported: configs import it from here)
    FILE_NAME,
    NONEMPTY,
    NONEMPTY_PATH,
    OUTPUT_PATH,
    PATH,
    PORT,
    RELATIVE_NAME,
    ROW_TOKENS,
    SEED,
    SEED_MAX,
    FieldError,
    Rule,
    _short_repr,
    _strip_optional,
    above,
    at_least,
    between,
    check_fields,
    each,
    field_rules,
    one_of,
    rules,
    suggest,
)

T = TypeVar("T")
# The config files shipped with the package (the folder configs/ of a checkout, hylo/configs/ of a wheel):
# `--config NAME` finds one by name, `hylo configs` lists and copies them.
CONFIGS_PACKAGE = "hylo.configs"


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the valid choices.

    `key` is the dotted key at fault when known (used to say which file line or override set it).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ------------------------------------------------------------------------------- dataclasses <- dicts
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_optional(tp: Any) -> bool:
    return tp is Any or (typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp))


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "a list"
    if origin is dict or (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    if value is None:
        if _is_optional(tp):
            return None
        raise ConfigError(f"{where}: expected {_type_name(_strip_optional(tp))}, got None", where)
    tp = _strip_optional(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}", where)
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {_short_repr(value)}", where)
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_short_repr(value)}", where)
        args = typing.get_args(tp)
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, inner, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {_short_repr(value)}", where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {_short_repr(value)}", where)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {_short_repr(value)}", where)
    if tp is str and not isinstance(value, str):
        if isinstance(value, dict | list | tuple):
            raise ConfigError(f"{where}: expected a string, got {_short_repr(value)}", where)
        text = _SOURCE_TEXT.get()(where)
        if text is not None:
            # YAML 1.1 read the unquoted text as a number, a boolean or a date: the field wants what was written
            return text
        leaf = re.split(r"[.\[]", where)[-1] or where
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {_short_repr(value)}; quote it: "
                          f"{leaf}: '{value}'", where)
    return value


# The text as written of an unquoted YAML scalar that YAML 1.1 resolved to something else than a string (012 -> 10,
# yes -> True, 12:30 -> 750, 0x1F -> 31), by the dotted key `_coerce` names it with; None when unknown.
_SOURCE_TEXT: contextvars.ContextVar[Callable[[str], str | None]] = contextvars.ContextVar(
    "_SOURCE_TEXT", default=lambda where: None)


@contextlib.contextmanager
def source_texts(file_texts: dict[str, str] | None, override_texts: dict[str, str] | None = None,
                 override_keys: list[str] | None = None, line_prefixes: tuple[str, ...] = ("",)) -> Iterator[None]:
    """While building a config, a string-typed field given an unquoted scalar takes its text as written:
    `override_texts` (what `apply_overrides` recorded) for a key a --set or flag set, else `file_texts` (what
    `read_config_file` recorded) under each of `line_prefixes`."""
    file_texts, override_texts, keys = file_texts or {}, override_texts or {}, override_keys or []

    def lookup(where: str) -> str | None:
        if any(where == k or where.startswith((k + ".", k + "[")) for k in keys):
            return override_texts.get(where)
        for prefix in line_prefixes:
            if prefix + where in file_texts:
                return file_texts[prefix + where]
        return None

    token = _SOURCE_TEXT.set(lookup)
    try:
        yield
    finally:
        _SOURCE_TEXT.reset(token)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`, mapping by mapping (`over` wins)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _changed(made: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in made.items():
        if isinstance(v, dict) and isinstance(plain.get(k), dict):
            if sub := _changed(v, plain[k]):
                out[k] = sub
        elif k not in plain or v != plain[k]:
            out[k] = v
    return out


def _factory_defaults(cls: type, types_: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For each section field whose default_factory sets values of its own (Stage2Config's
    `DataSection(split="stage2")`), those values: a file or --set that gives the section only in part
    keeps them (the class's plain defaults stand for the keys nobody set)."""
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is dataclasses.MISSING:
            continue
        tp = _strip_optional(types_.get(f.name))
        if not (dataclasses.is_dataclass(tp) and isinstance(tp, type)):
            continue
        made = f.default_factory()
        try:
            plain = tp()
        except TypeError:
            continue
        if type(made) is tp and (diff := _changed(to_dict(made), to_dict(plain))):
            out[f.name] = diff
    return out


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and values that break a field's rule raise
    ConfigError naming the dotted key (and, for unknown keys, listing the valid ones)."""
    types_ = _field_types(cls)
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - set(types_), key=str)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + str(k) for k in unknown)} in {cls.__name__}"
            f"{suggest(unknown[0], types_, prefix) or ';'} valid keys: {', '.join(sorted(types_))}",
            prefix + str(unknown[0])
        )
    made = _factory_defaults(cls, types_)
    data = {k: deep_merge(made[k], v) if k in made and isinstance(v, dict) else v for k, v in data.items()}
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
        check_fields(obj)
    except FieldError as e:
        raise ConfigError(f"{prefix}{e.field}={_short_repr(e.value)}: {e.reason}", prefix + e.field) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}", where or None) from None
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


# ------------------------------------------------------------------------------------ YAML files
class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r} at line {line} (first at line {first})")


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping repeating a key (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue
            if first is not None:
                raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _key_lines(node: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                out.setdefault(key, k.start_mark.line + 1)
                _key_lines(v, key, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.setdefault(f"{prefix}[{i}]", v.start_mark.line + 1)
            _key_lines(v, f"{prefix}[{i}]", out)


_STR_OR_NULL = ("tag:yaml.org,2002:str", "tag:yaml.org,2002:null")


def _scalar_texts(node: Any, prefix: str, out: dict[str, str]) -> None:
    """Dotted key -> text as written of every unquoted scalar that does not resolve to a string or null."""
    if isinstance(node, yaml.ScalarNode):
        if node.style is None and node.tag not in _STR_OR_NULL:
            out.setdefault(prefix, node.value)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                _scalar_texts(v, f"{prefix}.{k.value}" if prefix else str(k.value), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _scalar_texts(v, f"{prefix}[{i}]", out)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def parse_yaml(text: str, where: str, lines: dict[str, int] | None = None,
               texts: dict[str, str] | None = None) -> Any:
    """YAML text -> Python objects with StrictLoader; `lines` (if given) receives dotted key -> line, and
    `texts` dotted key -> the text as written of each unquoted scalar YAML 1.1 reads as a number, boolean or date
    ("" for a bare scalar), which a string-typed field takes (`source_texts`).
    Its nesting depth and what its aliases expand to are bounded first (hylo/yaml_limits.py)."""
    from hylo.yaml_limits import YamlShapeError, check_yaml_shape  # lazy: layering

    try:
        check_yaml_shape(text, StrictLoader)
    except YamlShapeError as e:
        raise ConfigError(f"{where}{f' line {e.line}' if e.line else ''}: {e.reason}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_one_line(str(e))}") from None
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if lines is not None:
            _key_lines(node, "", lines)
        if texts is not None:
            _scalar_texts(node, "", texts)
        return loader.construct_document(node)
    except _DuplicateKey as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_one_line(str(e))}") from None
    finally:
        loader.dispose()


def configs_dir() -> Path:
    """The folder of the shipped config files (found by import, the same way installed or in a checkout)."""
    return Path(str(importlib.resources.files(CONFIGS_PACKAGE)))


def shipped_configs() -> dict[str, Path]:
    """File name -> path of every shipped config file."""
    return {p.name: p for p in sorted(configs_dir().glob("*.yaml"))}


def shipped_config(name: str) -> Path | None:
    """The shipped config file called `name` (`demo-smollm2.yaml` or `demo-smollm2`), else None."""
    found = shipped_configs()
    return found.get(name) or found.get(f"{name}.yaml")


def config_file(spec: str | Path) -> Path:
    """What `--config SPEC` reads: an existing file, else the shipped config of that name (a name without a
    folder: `demo-smollm2.yaml`, `demo-smollm2`); else the path as given (reading it then fails naming it)."""
    p = Path(spec).expanduser()
    if not p.exists() and p.parent == Path(".") and (found := shipped_config(str(spec))) is not None:
        return found
    return p


def _missing_config(p: Path) -> ConfigError:
    names = list(shipped_configs())
    if p.name in names or f"{p.name}.yaml" in names:
        hint = f"; the shipped config of that name is --config {p.name}"
    else:
        stems = {n.removesuffix(".yaml"): n for n in names}
        close = suggest(p.name.removesuffix(".yaml"), stems).removeprefix("; did you mean ").removesuffix("?")
        hint = f"; did you mean --config {stems[close.strip(chr(39))]}?" if close else ""
    return ConfigError(f"config file {p} does not exist{hint} (`hylo configs` lists the shipped configs)")


def read_yaml_file(p: Path, what: str = "config file") -> str:
    """The text of YAML file `p` (`what` names it in errors), read the one way a YAML file is: a regular file only,
    at most `MAX_YAML_BYTES` (`hylo.bounded_read.read_bounded`: a directory, a pipe, a device or a socket is
    refused saying what it is, a larger file with the limit), UTF-8. Errors are ConfigErrors naming the file; a
    missing file raises FileNotFoundError (what that means is the caller's to say)."""
    from hylo.yaml_limits import MAX_YAML_BYTES  # lazy: layering

    try:
        raw = read_bounded(p, MAX_YAML_BYTES, ConfigError, what)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ConfigError(f"{what} {p}: cannot read it ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{p}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at line {line}, offset {e.start})") from None


def read_config_file(path: str | Path, texts: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """A YAML config file (or a shipped config's name, `config_file`) -> (mapping, dotted key -> line); `texts`
    (if given) receives the unquoted scalars' texts (`parse_yaml`).
    Missing, unreadable, non-UTF-8 or duplicate-key files raise ConfigError naming the file; so does what is not a
    regular file or is over `MAX_YAML_BYTES` (`read_yaml_file`)."""
    p = config_file(path)
    try:
        text = read_yaml_file(p)
    except FileNotFoundError:
        raise _missing_config(p) from None
    lines: dict[str, int] = {}
    loaded = parse_yaml(text, str(p), lines, texts)
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return loaded, lines


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section", dotted)
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str, texts: dict[str, str] | None = None) -> tuple[str, Any]:
    """`key.sub=value` -> (key, value parsed as YAML); `texts` receives its unquoted scalars' texts by full key."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    if not raw.strip():
        return key, ""
    mine: dict[str, str] = {}
    value = parse_yaml(raw, f"override {text!r}", texts=mine)
    if texts is not None:
        texts.update({key + (sub if sub.startswith("[") or not sub else "." + sub): t for sub, t in mine.items()})
    return key, value


def apply_overrides(tree: dict[str, Any], overrides: list[str] | None, texts: dict[str, str] | None = None) -> list[str]:
    """Apply `--set key=value` overrides to `tree` in order; returns the dotted keys they set. `texts` receives
    the texts as written of their unquoted scalars (`source_texts`)."""
    keys = []
    for ov in overrides or []:
        key, value = parse_override(ov, texts)
        _set_dotted(tree, key, value)
        keys.append(key)
    return keys


def error_origin(key: str | None, label: str, lines: dict[str, int], override_keys: list[str],
                 line_prefixes: tuple[str, ...] = ("",)) -> str:
    """Where the value at dotted `key` came from: "command line" (a --set override or a job's flag),
    "<label> line N" (the nearest enclosing key the file sets), or `label`."""
    if key:
        if any(key == k or key.startswith((k + ".", k + "[")) for k in override_keys):
            return "command line"
        k = key
        while k:
            for prefix in line_prefixes:
                if prefix + k in lines:
                    return f"{label} line {lines[prefix + k]}"
            k = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", k) if re.search(r"[.\[]", k) else ""
    return label


def build_config(cls: type[T], tree: dict[str, Any], label: str, lines: dict[str, int] | None = None,
                 override_keys: list[str] | None = None, line_prefixes: tuple[str, ...] = ("",),
                 texts: dict[str, str] | None = None, override_texts: dict[str, str] | None = None) -> T:
    """`from_dict(cls, tree)` with errors prefixed by where the bad value came from; a string-typed field keeps
    the text as written of an unquoted scalar (`texts` of the file, `override_texts` of the overrides)."""
    try:
        with source_texts(texts, override_texts, override_keys, line_prefixes):
            return from_dict(cls, tree)
    except ConfigError as e:
        origin = error_origin(e.key, label, lines or {}, override_keys or [], line_prefixes)
        raise ConfigError(f"{origin}: {e}", e.key) from None


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                select: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None, label: str | None = None,
                line_prefixes: tuple[str, ...] = ("",)) -> T:
    """Load `cls` from a YAML file (or defaults when `path` is None) and apply dotted overrides.

    `select(tree, path)` picks what `cls` reads from a file's tree (a training stage merges its own
    section over the shared ones); errors then name the file as `label` and find a key's line under
    each of `line_prefixes` in turn."""
    texts: dict[str, str] = {}
    set_texts: dict[str, str] = {}
    tree, lines = read_config_file(path, texts) if path is not None else ({}, {})
    if select is not None and path is not None:
        tree = select(tree, Path(path))
    keys = apply_overrides(tree, overrides, set_texts)
    label = label or (str(path) if path is not None else "<defaults>")
    return remember_config_file(build_config(cls, tree, label, lines, keys, line_prefixes, texts, set_texts), path)


# where a loaded config remembers the file it was read from (`config_file_of`): one of the files its job reads
_CONFIG_FILE = "_hylo_config_file"


def remember_config_file(cfg: T, path: str | Path | None) -> T:
    """`cfg`, remembering that it was read from config file `path` (None: from defaults and flags alone)."""
    if path is not None:
        object.__setattr__(cfg, _CONFIG_FILE, config_file(path))
    return cfg


def config_file_of(cfg: Any) -> Path | None:
    """The config file `cfg` was loaded from (`load_config`), else None; it survives `copy.deepcopy`."""
    return getattr(cfg, _CONFIG_FILE, None)


def config_hash(obj: Any, exclude: tuple[str, ...] = ()) -> str:
    """Stable short hash of a config (optionally excluding top-level keys such as run-time knobs)."""
    d = to_dict(obj) if dataclasses.is_dataclass(obj) else dict(obj)
    for k in exclude:
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class GivenOnce(argparse.Action):
    """argparse `action=` for a flag that names one thing (a config file): given twice, it is an error (argparse
    would keep the last one and ignore the first silently)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                  option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None and before is not self.default:
            parser.error(f"argument {option_string}: given twice ({before} and {values}); it takes one file: "
                         f"merge them into one, or put the changes in --set KEY=VALUE")
        setattr(namespace, self.dest, values)


def add_config_args(parser: argparse.ArgumentParser, example: str | None = None) -> None:
    """--config (once), --set, --print-config and --log-level (hylo/logs.py); `example` is a valid KEY=VALUE
    of the job's config for the help (tests/project/test_examples.py runs every example of every help)."""
    parser.add_argument("--config", type=str, default=None, action=GivenOnce,
                        help="YAML config file (or a shipped config's name; given once)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="dotted override of a config key (repeatable)" + (f", e.g. --set {example}" if example else "")
        + "; --print-config lists every key",
    )
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (every key, defaults filled in) as YAML and exit")
    add_log_level_flag(parser)


def maybe_print_config(cfg: Any, args: argparse.Namespace) -> None:
    """`--print-config`: the resolved config as YAML on stdout, then exit 0 (the config reference of a job)."""
    if getattr(args, "print_config", False):
        data = {"stage": cfg.stage, **to_dict(cfg)} if hasattr(cfg, "stage") else to_dict(cfg)
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
        raise SystemExit(0)


def flag_overrides(args: argparse.Namespace, flag_keys: dict[str, str]) -> list[str]:
    """`key=value` overrides from a job's shorthand flags: `flag_keys` maps a flag's dest to its dotted
    key; a flag left at None was not given."""
    return [f"{key}={json.dumps(getattr(args, dest))}" for dest, key in flag_keys.items()
            if getattr(args, dest) is not None]


def config_from_args(cls: type[T], args: argparse.Namespace, flag_keys: dict[str, str] | None = None) -> T:
    """The job's config: `--config` file, then `--set` overrides, then its shorthand flags (`flag_keys`,
    see `flag_overrides`), which win; `--print-config` prints it and exits."""
    cfg = load_config(cls, args.config, [*args.overrides, *flag_overrides(args, flag_keys or {})])
    maybe_print_config(cfg, args)
    return cfg


# ------------------------------------------------------------------------------ shared sections
@dataclasses.dataclass
@rules(num_cpus=at_least(1))
class RayInitSection:
    """Where a job finds its Ray (used by pipeline/ray_init.py; every job's `ray` section)."""

    # The Ray to use: None = $RAY_ADDRESS when set (`ray job submit` sets it), else a local Ray started
    # for this job; "auto" = the cluster running on this machine; "host:port" or "ray://host:port".
    address: str | None = None
    # CPUs of a local Ray this job starts (None = every CPU of the machine); unused when joining a cluster.
    num_cpus: int | None = None
