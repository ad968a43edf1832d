"""The project's one configuration system: nested dataclasses <- YAML, with dotted CLI overrides.

Every job declares its configuration as a tree of dataclasses. `load_config(Cls, path, overrides)`
reads YAML, applies `--set a.b=c` overrides (values parsed as YAML scalars), and builds the
dataclasses, rejecting unknown keys with the list of valid ones. `config_hash` gives a stable
fingerprint used by checkpoints and data manifests.

This module imports neither Ray nor torch, so any job (and `hylo/` tooling) can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the valid choices."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _coerce(value: Any, tp: Any, where: str) -> Any:
    tp = _strip_optional(tp)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, inner, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError as e:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from e
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is int:
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is str and not isinstance(value, str):
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys raise ConfigError listing the valid ones."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)} in {cls.__name__}; "
            f"valid keys: {', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    return key, yaml.safe_load(raw) if raw.strip() else ""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load `cls` from a YAML file (or defaults when `path` is None) and apply dotted overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a mapping")
        tree = loaded
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set_dotted(tree, key, value)
    try:
        return from_dict(cls, tree)
    except ConfigError as e:
        raise ConfigError(f"{path or '<defaults>'}: {e}") from None


def config_hash(obj: Any, exclude: tuple[str, ...] = ()) -> str:
    """Stable short hash of a config (optionally excluding top-level keys such as run-time knobs)."""
    d = to_dict(obj) if dataclasses.is_dataclass(obj) else dict(obj)
    for k in exclude:
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def save_yaml(obj: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=str, default=None, help="YAML config file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="dotted override, e.g. --set train.lr=1e-4 (repeatable)",
    )
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (every key, defaults filled in) as YAML and exit")


def maybe_print_config(cfg: Any, args: argparse.Namespace) -> None:
    """`--print-config`: the resolved config as YAML on stdout, then exit 0 (the config reference of a job)."""
    if getattr(args, "print_config", False):
        data = {"stage": cfg.stage, **to_dict(cfg)} if hasattr(cfg, "stage") else to_dict(cfg)
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
        raise SystemExit(0)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    cfg = load_config(cls, args.config, args.overrides)
    maybe_print_config(cfg, args)
    return cfg
