"""`teacher.source: inprocess`: the teacher model on every training worker (a small teacher, or tests).

Gives every form: top-k records (k > 0), or the exact teacher as its hidden states and lm_head (the fused KL
computes the logits chunk by chunk; `exact_form: auto`) or as streamed logits chunks. With a token range (a
sequence-parallel group, `protocol.check_token_range`) it runs unsplit: every rank of a group runs the whole
row's teacher forward and keeps its range (the teacher is a plain transformers model; splitting it needs
sequence-parallel attention in the teacher too).
"""

from __future__ import annotations

from typing import Any

from hylo.pipeline.teacher.config import InProcessSection
from hylo.pipeline.teacher.sources.base import (
    TeacherFiles,
    TeacherSourceKind,
    check_model_weights,
    model_files,
)


class InProcessSource(TeacherSourceKind):
    name = "inprocess"
    section = InProcessSection
    exact_forms = ("hidden", "logits")
    model_runs = "step"
    where = "on every training GPU"

    def check_inputs(self, t: InProcessSection) -> None:
        check_model_weights(t.model)

    def compared_with_student(self, t: InProcessSection) -> TeacherFiles:
        return model_files(t.model)

    def open(self, t: InProcessSection, data_path: str | None) -> tuple[Any, int | None]:
        from hylo.pipeline.teacher.model import TeacherModel  # lazy: torch

        model = TeacherModel.from_config(t.model)
        return model, model.vocab_size
