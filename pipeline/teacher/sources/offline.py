"""`teacher.source: offline`: the top-k records of a cache the cache job wrote (pipeline/teacher/cache.py).

Top-k only, of the cache's k (`teacher.k` must be it: checked at load against 0, before Ray starts against the
cache's manifest, and again by each worker's reader, with the data the cache was made from). A sequence-parallel
rank's token range gets the range's records (the reader decompresses the row's values, converts the range's bytes).
"""

from __future__ import annotations

from typing import Any

from hylo.pipeline.config import FieldError
from hylo.pipeline.teacher.config import OfflineSection, check_cache_k
from hylo.pipeline.teacher.sources.base import TeacherFiles, TeacherSourceKind


class OfflineSource(TeacherSourceKind):
    name = "offline"
    section = OfflineSection
    where = "from the top-k cache"

    def check_config(self, t: OfflineSection) -> None:
        if not t.cache_path:
            raise FieldError("cache_path", t.cache_path, "teacher.source=offline needs teacher.cache_path")
        check_cache_k(t.k)

    def check_inputs(self, t: OfflineSection) -> None:
        from hylo.pipeline.teacher.cache import load_manifest  # lazy: torch

        load_manifest(t.cache_path, t.k)

    def compared_with_student(self, t: OfflineSection) -> TeacherFiles:
        from hylo.pipeline.teacher.cache import load_manifest  # lazy: torch

        return TeacherFiles("teacher.cache_path", vocab_size=load_manifest(t.cache_path).get("vocab_size"),
                            value=t.cache_path)

    def open(self, t: OfflineSection, data_path: str | None) -> tuple[Any, int | None]:
        from hylo.pipeline.teacher.cache import TopKCacheReader  # lazy: torch

        reader = TopKCacheReader(t.cache_path, expect_k=t.k, expect_data=data_path)
        return reader, int(reader.manifest["vocab_size"])
