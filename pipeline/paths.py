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
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, TypeVar

from hylo.assets import ASSETS
from hylo.pipeline.config import field_rules

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
