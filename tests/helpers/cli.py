"""The command line in this process, and the job configs' fields: `run_hylo` (`hylo ARGV` through
`hylo_main`, as the `hylo` command runs it), every job's config class and every field under it."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from hylo.pipeline.cli import hylo_main


def run_hylo_split(argv: list[str]) -> tuple[int, str, str]:
    """`hylo ARGV` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = hylo_main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc, out.getvalue(), err.getvalue()


def run_hylo(argv: list[str]) -> tuple[int, str]:
    """`hylo ARGV` in this process: (exit status, stdout + stderr)."""
    rc, out, err = run_hylo_split(argv)
    return rc, out + err


def job_config_roots() -> dict[str, type]:
    from hylo.pipeline.convert import ConvertJobConfig
    from hylo.pipeline.data.config import PrepareDataConfig
    from hylo.pipeline.data.decontam import DecontamJobConfig
    from hylo.pipeline.demo import DemoConfig
    from hylo.pipeline.eval.config import EvalConfig
    from hylo.pipeline.placement import PlacementConfig
    from hylo.pipeline.teacher.config import TeacherCacheConfig
    from hylo.pipeline.train.config import Stage1Config, Stage2Config

    # the teacher pool's sections (model, pool, client) are reached through stage 2's `teacher`
    return {"stage1": Stage1Config, "stage2": Stage2Config, "prepare_data": PrepareDataConfig,
            "decontaminate": DecontamJobConfig, "teacher_cache": TeacherCacheConfig,
            "eval": EvalConfig, "demo": DemoConfig,
            "place_layers": PlacementConfig, "convert": ConvertJobConfig}


def walk_fields(cls: type, prefix: str = "", seen: set | None = None):
    """(dotted path, owning class, field name, type hint, reached through a list) of every field under `cls`."""
    import typing

    from hylo.pipeline.config import _field_types, _strip_optional

    for name, tp in _field_types(cls).items():
        inner = _strip_optional(tp)
        listed = typing.get_origin(inner) is list
        elem = typing.get_args(inner)[0] if listed and typing.get_args(inner) else inner
        if dataclasses.is_dataclass(elem):
            yield from walk_fields(elem, f"{prefix}{name}{'[0]' if listed else ''}.")
        else:
            yield f"{prefix}{name}", cls, name, inner, listed
