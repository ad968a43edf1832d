"""The teacher sources `teacher.source` can name: the registry, and the teacher stage 2 opens from it.

    inprocess  sources/inprocess.py  the teacher model on every training worker
    serve      sources/serve.py      the Ray Serve pool (the driver deploys it, or the client attaches to one)
    offline    sources/offline.py    the top-k records of a cache written by the cache job

A source is one file here holding one `TeacherSourceKind` (sources/base.py), listed in `SOURCES` below, or
`register`ed by a module of its own. It owns everything that differs between sources: the keys it reads (its
typed `section`, in pipeline/teacher/config.py; stage 2's `teacher` section is those sections in one), its config
check (`check_section`, run when `TeacherSection` is built; `teacher.source`'s choices are `source_names()`), its checks
before Ray starts (train/inputs.py), the Ray resources and the service it starts (train/driver.py), where its
model runs (what `hylo estimate` sizes: train/estimate.py) and its opening (`open_teacher`, in each stage-2
worker). What is the same for all, the width `teacher.k` and the exact form, is resolved here (`target_form`)
from what each source says it can give. Nothing outside this package branches on a source's name.

Importing this package loads config modules only (the sources import their implementations when used).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hylo.pipeline.config import ConfigError, FieldError
from hylo.pipeline.teacher.config import SourceSection
from hylo.pipeline.teacher.sources.base import TeacherSourceKind
from hylo.pipeline.teacher.sources.inprocess import InProcessSource
from hylo.pipeline.teacher.sources.offline import OfflineSource
from hylo.pipeline.teacher.sources.serve import ServeSource

SOURCES: dict[str, TeacherSourceKind] = {}


def register(kind: TeacherSourceKind) -> TeacherSourceKind:
    """Make `kind` a value of `teacher.source` (a name already taken by another kind is refused)."""
    held = SOURCES.get(kind.name)
    if held is not None and type(held) is not type(kind):
        raise ValueError(f"teacher source {kind.name!r} is registered already ({type(held).__qualname__})")
    SOURCES[kind.name] = kind
    return kind


for _kind in (InProcessSource(), ServeSource(), OfflineSource()):
    register(_kind)


def source_names() -> tuple[str, ...]:
    return tuple(SOURCES)


def source_kind(name: str) -> TeacherSourceKind:
    if name not in SOURCES:
        raise ConfigError(f"teacher.source={name!r}: must be one of {', '.join(SOURCES)}", "teacher.source")
    return SOURCES[name]


# Why an exact form needs particular sources, and how a source gives each (the error that refuses one).
_FORM_NEEDS = {"hidden": "the teacher's hidden states and its lm_head on the trainer",
               "logits": "the teacher's full-vocabulary logits"}
_FORM_GIVEN = {"hidden": "gives its hidden states", "logits": "streams logits"}


def target_form(t: SourceSection) -> str:
    """What the teacher of section `t` gives the fused KL: "topk" (k > 0), or for the exact teacher (k: 0)
    "hidden" or "logits", as `exact_form` asks (auto: the source's `auto_form`); FieldError naming the key."""
    kind = source_kind(t.source)
    if t.k > 0:
        if t.exact_form != "auto":
            raise FieldError("exact_form", t.exact_form, f"applies to the exact teacher (k: 0) only, k is {t.k}")
        return "topk"
    if not kind.exact_forms:
        raise FieldError("k", t.k, f"the {kind.name} teacher gives top-k records only: set k > 0")
    if t.exact_form == "auto":
        return kind.auto_form(t)
    if t.exact_form not in kind.exact_forms:
        givers = " or ".join(n for n, s in SOURCES.items() if t.exact_form in s.exact_forms)
        raise FieldError("exact_form", t.exact_form, f"needs source {givers} ({_FORM_NEEDS[t.exact_form]}); the "
                                                     f"{kind.name} teacher {' or '.join(map(_FORM_GIVEN.get, kind.exact_forms))}")
    return t.exact_form


def check_section(t: SourceSection) -> None:
    """That section `t` has the keys its source reads (its `section`'s, declared alike), the source's own check of
    it, then its width and form (`TeacherSection.__post_init__`)."""
    kind = source_kind(t.source)
    have = {f.name: f for f in fields(t)}
    for f in fields(kind.section):
        got = have.get(f.name)
        if got is None or (got.type, got.default, got.default_factory) != (f.type, f.default, f.default_factory):
            raise TypeError(f"teacher.source={kind.name!r} reads teacher.{f.name} as {kind.section.__qualname__} "
                            f"declares it, which {type(t).__qualname__} does not: add its section to that class")
    kind.check_config(t)
    target_form(t)


def open_teacher(t: SourceSection, student_vocab: int, data_path: str | None = None) -> Any:
    """The teacher stage 2's `teacher` section names, bound to its targets (`protocol.BoundTeacher`);
    `data_path`: the prepared data an offline cache must have been made from (None: not checked)."""
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec, check_k_fits  # lazy: torch

    spec = TargetSpec(t.k, t.form)
    source, vocab = source_kind(t.source).open(t, data_path)
    if vocab is not None:
        if vocab != student_vocab:
            raise ConfigError(f"teacher vocabulary {vocab} != student vocabulary {student_vocab}: "
                              f"teacher and student must share a tokenizer")
        check_k_fits(t.k, vocab, "teacher.k")
    return BoundTeacher(source, spec, vocab)
