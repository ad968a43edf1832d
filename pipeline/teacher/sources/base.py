"""What a teacher source is to stage 2, from its config to its targets: one `TeacherSourceKind` per source.

A kind names the keys it reads, its typed `section` (pipeline/teacher/config.py): the keys every source reads
(`SourceSection`: source, k, exact_form) and its own (inprocess: model; serve: model, pool, client, start_pool;
offline: cache_path). Stage 2's `teacher` section (`TeacherSection`, pipeline/train/config.py) is those sections
in one flat mapping and an instance of each, so every method of a kind, given it as `t`, reads it as its own
section (`check_section` checks that it has the kind's keys). A kind is stateless. How it runs, as data:
* `exact_forms`  the exact teacher's (k: 0) forms it can give (the width and the form are resolved for every
                 source alike, `target_form` in the registry);
* `model_runs`   where its teacher model runs: in each training step, on replicas of its own, or nowhere (stored
                 targets); what `hylo estimate` builds into the step and sizes apart (pipeline/estimate/);
* `where`        the same in words.
Its methods, in the order a run uses them:
* `check_config(t)`          when the config is built: what the source needs of the section (FieldError naming
                             the key);
* `auto_form(t)`             when the config is built: the exact form `exact_form: auto` picks;
* `check_inputs(t)`          before Ray starts: the files the source reads (weights whole, a manifest of k);
* `compared_with_student(t)` before Ray starts: what it knows of the teacher (`TeacherFiles`), compared with the
                             student's vocabulary and tokenizer by the stage's input checks (train/inputs.py);
* `resources(t)`             the Ray resources of what it runs beside the training workers (`ResourceDemand`);
* `start(t, fault)`          on the driver, after Ray started: deploy that service; returns how to stop it;
* `open(t, data_path)`       in each stage-2 worker: the `protocol.TeacherSource` that gives the targets, and
                             the teacher's vocabulary when it is known here (checked against the student's).

Module-level imports here and in every source file are config modules only: `teacher.source` is checked when a
config is built, which must not load the teacher's implementation (torch, Ray, the model); a method that
needs one imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hylo.pipeline.teacher.config import SourceSection
from hylo.weight_files import check_weights_dir


@dataclass(frozen=True)
class ResourceDemand:
    """`count` Ray actors of `resources` each; `keys`: the config keys that size them (named when a run cannot
    fit the cluster)."""

    what: str
    count: int
    resources: dict[str, float] = field(default_factory=dict)
    keys: str = ""


@dataclass(frozen=True)
class TeacherFiles:
    """What a source knows of its teacher before Ray starts, for the comparison with the student: its model
    directory (config.json, tokenizer.json), a tokenizer directory of its own, or only its vocabulary size;
    `key`: the config key that names it, `value`: what that key holds (shown in errors; default: model_dir)."""

    key: str
    model_dir: Path | None = None
    tokenizer_dir: Path | None = None
    vocab_size: int | None = None
    value: str | None = None


class TeacherSourceKind:
    """One value of `teacher.source`: see the module docstring for what each method is for."""

    name: ClassVar[str]
    # The keys it reads: SourceSection's and its own (a subclass of SourceSection, in pipeline/teacher/config.py).
    section: ClassVar[type[SourceSection]] = SourceSection
    # The exact teacher (k: 0) forms it can give, the one `exact_form: auto` picks first; () = top-k only.
    exact_forms: ClassVar[tuple[str, ...]] = ()
    # Where its teacher model (`t.model`) runs: "step" inside each training step, on every worker; "replicas" on
    # GPUs of its own beside the workers (the step receives the targets); None: nowhere (stored targets).
    model_runs: ClassVar[str | None] = None
    # Where its targets come from, in words (`hylo estimate`'s header).
    where: ClassVar[str] = ""

    def check_config(self, t: Any) -> None:
        """What this source needs of the section beyond the form; raise FieldError(key, value, why)."""

    def auto_form(self, t: Any) -> str:
        """The exact form `exact_form: auto` picks for section `t` (the first of `exact_forms` unless the source
        says otherwise; config files only, no torch)."""
        return self.exact_forms[0]

    def check_inputs(self, t: Any) -> None:
        """Before Ray starts: the files this source reads are there and whole (ConfigError naming the key)."""

    def compared_with_student(self, t: Any) -> TeacherFiles | None:
        """What is compared with the student before Ray starts; None: nothing known here."""
        return None

    def check_ports(self, t: Any, local: bool) -> None:
        """Before Ray starts: the ports a port key of this source names are free, where `local` (the run starts a
        local Ray: what `start` deploys listens on this machine). RayStartupError naming the key."""

    def resources(self, t: Any) -> list[ResourceDemand]:
        """The Ray resources of what `start` deploys."""
        return []

    def start(self, t: Any, fault: Any) -> Callable[[], None] | None:
        """Deploy what this source needs on the cluster (the driver, after Ray started; `fault`: stage 2's
        `fault.teacher`); returns what stops it again, or None when there is nothing to start."""
        return None

    def open(self, t: Any, data_path: str | None) -> tuple[Any, int | None]:
        """(the source giving the targets, its vocabulary size or None when it is not known here); `data_path`:
        the prepared data the teacher's targets must belong to (None: not checked)."""
        raise NotImplementedError


def check_model_weights(model_cfg: Any) -> None:
    """The teacher model (TeacherModelConfig) of a source that loads it: a directory or asset whose
    config.json fields a model can be built from, with whole .safetensors files holding no NaN / inf value.

    The weights are scanned here, in the driver before Ray starts, one tensor at a time (memory: the largest
    tensor): a corrupt teacher then stops the run with one line naming the file and tensor instead of in
    every replica or worker after Ray started. It reads the teacher once (an 8B teacher in bf16: 16 GB, at
    the disk's speed: 512 MiB of bf16, page-cached, took 0.11-0.17 s on one loaded core), small against a
    stage-2 run."""
    from hylo.model_files import check_finite_weights  # lazy: layering
    from hylo.pipeline.teacher.model import resolve_model_path  # lazy: torch

    path = resolve_model_path(model_cfg.path)
    check_weights_dir(path)
    check_finite_weights(path, "teacher model (teacher.model.path)")


def model_files(model_cfg: Any) -> TeacherFiles:
    """What the student is compared with for a source that loads the teacher model: its directory, and its own
    tokenizer when `model.tokenizer` names one."""
    from hylo.assets import resolve_path_or_asset  # lazy: layering
    from hylo.pipeline.teacher.model import resolve_model_path  # lazy: torch

    tok = resolve_path_or_asset(model_cfg.tokenizer, "teacher.model.tokenizer", directory=True) \
        if model_cfg.tokenizer else None
    return TeacherFiles("teacher.model.path", model_dir=resolve_model_path(model_cfg.path), tokenizer_dir=tok)
