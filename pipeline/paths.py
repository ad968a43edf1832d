"""What a path in a config means: relative to the directory the command runs in, made absolute once, at start.

    cfg = resolve_paths(config_from_args(MyConfig, args))     # every job, after --print-config

A config field that names a file or directory declares it with the `PATH` rule (`@rules(path=PATH)`,
hylo/rules.py). Every job passes its loaded config through `resolve_paths` before it does any work, so
that the processes it starts (Ray Train workers, Ray Data tasks, the demo's subprocesses), which run in
other working directories, read and write the same files the user meant.

Design choices:
* A relative path is relative to the current directory of the command (not to the config file that
  holds it): the same rule for a config file, a `--set` override and a job's own flag, and what every
  shell tool does. Under `ray job submit --working-dir .` that directory is Ray's copy of the working
  directory.
* Left as given: a URI or scheme (`s3://bucket/runs`, `hub:org/name`, `asset:NAME`), an absolute path
  (`~` expanded), a known asset name that is not an existing path (the project's one rule, hylo/assets.py),
  and fields a config says hold no local path in its instance (`__not_paths__`, e.g. a Hub dataset source).
* `--print-config` prints the config as given (before this step): a printed config loads back in the same
  directory with the same meaning.

What a job reads, from the same declarations: `job_inputs(cfg, config)` lists every path field that is not an
output (`OUTPUT_PATH`, hylo/rules.py: an output directory, a run directory, a cache the job adds to), with its
dotted key, plus the config file itself: model folders, data, caches, the teacher, tokenizers. Every job that
writes a path the user named checks it against them (`hylo.outputs.check_not_an_input`): an output is never
one of them, inside one, or around one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, TypeVar

from hylo.assets import ASSETS, AssetError, local_path
from hylo.pipeline.config import config_file, config_file_of, field_rules

T = TypeVar("T")
# `scheme:` at the start of a value: a URI (s3://, gs://, file://) or one of the project's prefixes
# (asset:NAME, hub:NAME); a one-letter scheme would be a drive letter, never used here.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")


def resolve_path(text: str, base: str | os.PathLike | None = None) -> str:
    """One config path made absolute against `base` (default: the current directory), by the rules above."""
    if not isinstance(text, str) or not text or _SCHEME.match(text):
        return text
    p = Path(text).expanduser()
    if p.is_absolute():
        return str(p)
    root = Path.cwd() if base is None else Path(base)
    if not (root / p).exists():
        if text in ASSETS:
            return text
    return os.path.normpath(root / p)


def path_fields(obj: Any) -> list[str]:
    """The fields of config object `obj` that hold local paths (their rule is PATH)."""
    skip = obj.__not_paths__() if hasattr(obj, "__not_paths__") else set()
    return [name for name, rule in field_rules(type(obj)).items() if rule.path and name not in skip]


def _resolve_value(value: Any, base: Path) -> Any:
    if isinstance(value, str):
        return resolve_path(value, base)
    if isinstance(value, list):
        return [_resolve_value(v, base) for v in value]
    return value


def _walk(obj: Any, base: Path) -> None:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        own = set(path_fields(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name in own:
                object.__setattr__(obj, f.name, _resolve_value(value, base))
            else:
                _walk(value, base)
    elif isinstance(obj, list | tuple):
        for item in obj:
            _walk(item, base)
    elif isinstance(obj, dict):
        for item in obj.values():
            _walk(item, base)


def resolve_paths(cfg: T, base: str | os.PathLike | None = None) -> T:
    """A copy of config `cfg` whose every local path (PATH fields, nested sections and lists included) is
    absolute against `base` (default: the current directory)."""
    out = copy.deepcopy(cfg)
    _walk(out, Path.cwd() if base is None else Path(base))
    return out


def _input_values(obj: Any, prefix: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        rules = field_rules(type(obj))
        skip = set(obj.__not_paths__() if hasattr(obj, "__not_paths__") else ()) | set(getattr(obj, "__not_inputs__", ()))
        for f in dataclasses.fields(obj):
            value, key, rule = getattr(obj, f.name), f"{prefix}{f.name}", rules.get(f.name)
            if rule is not None and rule.path:
                if rule.output or f.name in skip:
                    continue
                items = value if isinstance(value, list) else [value]
                keys = [f"{key}[{i}]" for i in range(len(items))] if isinstance(value, list) else [key]
                out += [(k, v) for k, v in zip(keys, items) if isinstance(v, str) and v]
            else:
                out += _input_values(value, key + ".")
    elif isinstance(obj, list | tuple):
        for i, item in enumerate(obj):
            out += _input_values(item, f"{prefix.removesuffix('.')}[{i}].")
    elif isinstance(obj, dict):
        for k, item in obj.items():
            out += _input_values(item, f"{prefix}{k}.")
    return out


def job_inputs(cfg: Any, config: str | os.PathLike | None = None,
               extra: list[tuple[str, str | os.PathLike | None]] | None = None) -> list[tuple[str, Path]]:
    """(dotted key, local path) of every file or folder config `cfg` reads: each path field that is not an output
    (`Rule.output`) nor named by its class's `__not_inputs__` (a folder whose parts the job reads, found by the job
    itself: placement's data_from), nested sections and lists included, an asset name as its folder in the asset cache; a URI
    or a Hub name is no local path and left out. `config`: the `--config` file, first (default: the file `cfg`
    was loaded from, `config_file_of`; a shipped config's name as its file). `extra`: more (option, path) pairs
    the job reads, named as the user gave them (a flag: `--model`), before the config's fields."""
    found: list[tuple[str, Path]] = []
    config = config or config_file_of(cfg)
    if config:
        found.append(("--config", config_file(config)))
    for key, value in [*[(k, os.fspath(v)) for k, v in extra or [] if v], *_input_values(cfg, "")]:
        try:
            p = local_path(value)
        except AssetError:  # an unknown asset:NAME is the reader's error to report, with its own message
            p = None
        if p is not None:
            found.append((key, p))
    return found
