"""What a config field accepts: `@rules(field=Rule, ...)` below `@dataclass`, checked on every construction.

The rule mechanism of the project's one configuration system (`hylo.pipeline.config` loads YAML into
dataclasses and re-exports everything here). It is a leaf, the standard library only, so that hylo's own
option classes (`hylo.upcycle.ConvertConfig`) state their ranges the same way as every config section.
A broken rule raises `FieldError` (or the class's `__field_error__`, a subclass of it); the config loader
turns it into a ConfigError naming the dotted key and where its value came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """A field's value breaks its rule; `from_dict` turns it into a ConfigError with the dotted key."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        super().__init__(f"{field}={_short_repr(value)}: {reason}")
        self.field, self.value, self.reason = field, value, reason


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one config field accepts. None values of Optional fields are never checked (None has its
    own documented meaning, such as "derive it" or "no limit")."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    # A relative path below a root, such as a run name under ray.storage_path ("a" or "a/b").
    relative_name: bool = False
    # A single path component (a file name stem).
    file_name: bool = False
    # A local path, a URI (s3://...) or an asset (asset:NAME, NAME): a relative local path is relative to the
    # directory the command runs in, and the job makes it absolute once, at start (`resolve_paths`).
    path: bool = False
    # With `path`: a path the job writes (an output, or a store it adds to: a run directory, a cache); every other
    # path field is one of the job's inputs (`hylo.pipeline.paths.job_inputs`), never to be written over.
    output: bool = False
    nonempty: bool = False
    # Regular expression the whole string must match, and how to say it in an error.
    pattern: str | None = None
    pattern_text: str = ""
    # Apply the rule to every item of a list (or every value of a mapping) instead of the whole value.
    each: bool = False
    finite: bool = True
    # Why the range is what it is, added to the error in parentheses (a cap's arithmetic).
    note: str = ""

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.relative_name:
            return "a relative name (no absolute path, no '.', '..' or empty parts)"
        if self.file_name:
            return "a plain file name (no '/', not '.' or '..')"
        if self.pattern is not None:
            return self.pattern_text or f"matching {self.pattern}"
        lo = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}") if (
            self.ge is not None or self.gt is not None) else None
        hi = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})") if (
            self.le is not None or self.lt is not None) else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        if hi:
            return f"<= {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}"
        return "not empty" if self.nonempty else "any value"

    def _one(self, v: Any) -> str | None:
        if self.choices is not None:
            return None if v in self.choices else f"must be {self.describe()}"
        if isinstance(v, str):
            if self.nonempty and not v:
                return "must not be empty"
            if self.relative_name and not _is_relative_name(v):
                return f"must be {self.describe()}"
            if self.file_name and (not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v):
                return f"must be {self.describe()}"
            if self.pattern is not None and not re.fullmatch(self.pattern, v):
                return f"must be {self.describe()}"
            return None
        if isinstance(v, int | float) and not isinstance(v, bool):
            if ((self.ge is not None and not v >= self.ge) or (self.gt is not None and not v > self.gt)
                    or (self.le is not None and not v <= self.le) or (self.lt is not None and not v < self.lt)):
                return f"must be {self.describe()}"
        return None

    def problem(self, value: Any) -> str | None:
        """Why `value` breaks this rule, or None."""
        why = self._problem(value)
        return f"{why} ({self.note})" if why and self.note else why

    def _problem(self, value: Any) -> str | None:
        if not self.each:
            if self.nonempty and isinstance(value, list | tuple | dict) and not value:
                return "must not be empty"
            return self._one(value)
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        if self.nonempty and not items:
            return "must not be empty"
        for k, v in items:
            if v is None:
                continue
            why = self._one(v)
            if why:
                which = f"{k!r}" if isinstance(value, dict) else f"item {k}"
                return f"every {'value' if isinstance(value, dict) else 'item'} {why} ({which} is {_short_repr(v)})"
        return None

    def counterexamples(self, tp: Any) -> list[Any]:
        """Values of type `tp` this rule rejects (used by the tests that check every rule is applied)."""
        inner = _strip_optional(tp)
        origin = typing.get_origin(inner)
        elem = typing.get_args(inner)[-1] if origin in (list, dict) and typing.get_args(inner) else inner
        singles: list[Any] = []
        if self.choices is not None:
            singles.append(max(self.choices) + 1 if all(isinstance(c, int) for c in self.choices) else "no-such-choice")
        elif self.relative_name:
            singles += ["../x", "/abs", "a/../b", "", "a//b"]
        elif self.file_name:
            singles += ["a/b", "..", ""]
        elif self.pattern is not None:
            singles.append("?? no match ??")
        elif self.nonempty and elem is str:
            singles.append("")
        step = 1 if elem is int else 0.5
        if self.ge is not None:
            singles.append(self.ge - step)
        if self.gt is not None:
            singles.append(self.gt)
        if self.le is not None:
            singles.append(self.le + step)
        if self.lt is not None:
            singles.append(self.lt)
        if elem is float and self.finite:
            singles.append(float("nan"))
        singles = [int(s) if elem is int and isinstance(s, float) and s.is_integer() else s for s in singles]
        out: list[Any]
        if origin is list and self.each:
            out = [[s] for s in singles] + ([[]] if self.nonempty else [])
        elif origin is dict and self.each:
            out = [{"k": s} for s in singles] + ([{}] if self.nonempty else [])
        elif origin in (list, dict):
            out = ([[]] if origin is list else [{}]) if self.nonempty else []
        else:
            out = singles
        return out


def _is_relative_name(v: str) -> bool:
    if not v or "\\" in v or "\0" in v or v.startswith(("/", "~")):
        return False
    return all(part not in ("", ".", "..") for part in v.split("/"))


def at_least(x: float, **kw: Any) -> Rule:
    return Rule(ge=x, **kw)


def above(x: float, **kw: Any) -> Rule:
    return Rule(gt=x, **kw)


def between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False, **kw: Any) -> Rule:
    return Rule(ge=None if lo_open else lo, gt=lo if lo_open else None,
                le=None if hi_open else hi, lt=hi if hi_open else None, **kw)


def one_of(*choices: Any) -> Rule:
    return Rule(choices=tuple(choices))


def each(rule: Rule, nonempty: bool = False) -> Rule:
    """`rule` for every item of a list (or value of a mapping); `nonempty` also rejects an empty one."""
    return dataclasses.replace(rule, each=True, nonempty=nonempty or rule.nonempty)


NONEMPTY = Rule(nonempty=True)
# A file or directory: see Rule.path (hylo.pipeline.config.resolve_paths makes a relative one absolute).
PATH = Rule(path=True)
NONEMPTY_PATH = Rule(path=True, nonempty=True)
# A path the job writes (see Rule.output).
OUTPUT_PATH = Rule(path=True, output=True)
RELATIVE_NAME = Rule(relative_name=True)
FILE_NAME = Rule(file_name=True)
# A port to bind or connect to.
PORT = between(1, 65535)
# A random seed: what every consumer accepts. numpy's legacy `np.random.seed` (the training loop, lm-eval's
# numpy seed) takes 32 bits, torch.manual_seed 64; the converter and the KV-cache probe derive per-layer seeds
# as seed * 100_003 + layer, which stays within torch's 64 bits for any 32-bit seed.
SEED_MAX = 2**32 - 1
SEED = between(0, SEED_MAX)
# Tokens of one packed row: its boundaries (`cu_seqlens`) are int32 on disk and in the model.
ROW_TOKENS_MAX = 2**31 - 1
ROW_TOKENS = between(2, ROW_TOKENS_MAX, note="a row's cu_seqlens are int32")


def rules(**by_field: Rule) -> Callable[[type[T]], type[T]]:
    """Declare what each field accepts; put it directly below `@dataclass`.

        @dataclass
        @rules(lr=above(0), warmup_ratio=between(0, 1, hi_open=True))
        class OptimSection: ...

    The checks run at the start of `__post_init__` (the class's own cross-field checks follow) and
    raise FieldError; subclasses inherit their parents' rules.
    """

    def deco(cls: type[T]) -> type[T]:
        if "__dataclass_fields__" in cls.__dict__:
            raise TypeError(f"@rules on {cls.__name__} must sit below @dataclass (applied before it)")
        names: set[str] = set()
        merged: dict[str, Rule] = {}
        for base in reversed(cls.__mro__):
            names |= set(base.__dict__.get("__annotations__", {}))
            merged.update(base.__dict__.get("__field_rules__", {}))
        unknown = sorted(set(by_field) - names)
        if unknown:
            raise TypeError(f"@rules on {cls.__name__}: no field(s) {unknown}")
        merged.update(by_field)
        cls.__field_rules__ = merged  # type: ignore[attr-defined]
        own = cls.__dict__.get("__post_init__")
        inherited = None if own else getattr(cls, "__post_init__", None)

        def __post_init__(self: Any) -> None:
            check_fields(self)
            if own is not None:
                own(self)
            elif inherited is not None:
                inherited(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        return cls

    return deco


def field_rules(cls: type) -> dict[str, Rule]:
    """The rules a config class declares (inherited ones included); {} for a class without @rules."""
    return dict(getattr(cls, "__field_rules__", {}))


# Every integer setting fits a signed 64-bit integer (what torch, numpy and every file format here store),
# whatever its own rule says: Python's ints are unbounded and YAML reads 2^70 as one.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _beyond_int64(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not INT64_MIN <= value <= INT64_MAX
    if isinstance(value, list | tuple):
        return any(_beyond_int64(v) for v in value)
    if isinstance(value, dict):
        return any(_beyond_int64(v) for v in value.values())
    return False


def _nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list | tuple):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    return False


def check_fields(obj: Any) -> None:
    """Check every field of dataclass `obj` against its rule and the defaults: finite floats, 64-bit ints."""
    declared = field_rules(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or dataclasses.is_dataclass(value):
            continue
        rule = declared.get(f.name)
        error = getattr(type(obj), "__field_error__", FieldError)
        if (rule is None or rule.finite) and _nonfinite(value):
            raise error(f.name, value, "must be a finite number")
        why = rule.problem(value) if rule is not None else None
        if why:
            raise error(f.name, value, why)
        if _beyond_int64(value):
            raise error(f.name, value, f"must fit in a signed 64-bit integer (|value| <= {INT64_MAX})")


def _initials(word: str) -> str:
    return "".join(part[0] for part in re.split(r"[_\-.]+", word) if part)


def suggest(word: str, choices: Any, prefix: str = "") -> str:
    """"; did you mean 'x'?" when `word` is close to one of `choices` (a typo, a longer spelling such as
    learning_rate for lr, the start of a name, a name qualified in front: top_k for k), else ""."""
    word, names = str(word), [str(c) for c in choices]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if not close:
        close = [n for n in names if len(n) > 1 and (_initials(word) == n or _initials(n) == word)][:1]
    if not close and len(word) >= 3:
        starts = [n for n in names if n.startswith(word)]
        close = starts if len(starts) == 1 else []
    if not close and len(parts := re.split(r"[_\-]+", word)) > 1:
        # a qualified spelling of the name (top_k for k)
        close = [n for n in names if n == parts[-1]][:1]
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def _strip_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp
