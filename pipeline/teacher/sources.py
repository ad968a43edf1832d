"""Build the teacher stage 2's `teacher` section names: one `Teacher` over whichever source it says.

Apart from `protocol.py` so that the protocol imports none of its implementations (they import it).
"""

from __future__ import annotations

from typing import Any

from hylo.pipeline.config import ConfigError
from hylo.pipeline.teacher.protocol import TargetSpec, Teacher, check_k_fits


def open_teacher(cfg: Any, student_vocab: int, data_path: str | None = None) -> Teacher:
    """The teacher stage 2's `teacher` section (TeacherSection) names; `data_path`: the prepared data the
    offline cache must have been made from (None: not checked)."""
    spec = TargetSpec(cfg.k, cfg.form)
    vocab: int | None
    if cfg.source == "inprocess":
        from hylo.pipeline.teacher.model import TeacherModel

        source: Any = TeacherModel.from_config(cfg.model)
        vocab = source.vocab_size
    elif cfg.source == "serve":
        from hylo.pipeline.teacher.client import TeacherClient

        source = TeacherClient.from_config(cfg.pool.app_name, cfg.client, cfg.k, cfg.model.logits_chunk_tokens)
        vocab = None
    else:
        from hylo.pipeline.teacher.cache import TopKCacheReader

        source = TopKCacheReader(cfg.cache_path, expect_k=cfg.k, expect_data=data_path)
        vocab = int(source.manifest["vocab_size"])
    if vocab is not None:
        if vocab != student_vocab:
            raise ConfigError(f"teacher vocabulary {vocab} != student vocabulary {student_vocab}: "
                              f"teacher and student must share a tokenizer")
        check_k_fits(cfg.k, vocab, "teacher.k")
    return Teacher(source, spec, vocab)
