"""`teacher.source: serve`: the Ray Serve teacher pool (pipeline/teacher/serve.py), through `TeacherClient`.

With `start_pool: true` the driver deploys the pool from `teacher.model` and `teacher.pool` before training and
deletes it after (its replicas count in the run's Ray resources); with false the client attaches to a pool
someone else runs under `pool.app_name`, and nothing of it is checked before Ray starts. Gives top-k records
or the exact teacher as streamed logits (its lm_head is on the replicas, not on the trainer).

Under sequence parallelism the pool runs each row once per group. One rank of the group asks for every rank's
range of the row; a replica runs one forward and answers them all; that rank sends each other rank its own
tokens' targets over the group (pipeline/teacher/client.py). When the driver deletes the pool it prints the
row forwards its replicas ran (`hylo rehearse` checks them: one per row per group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hylo.logs import get_logger
from hylo.pipeline.teacher.config import ServeSection, pool_port_taken
from hylo.pipeline.teacher.sources.base import (
    ResourceDemand,
    TeacherFiles,
    TeacherSourceKind,
    check_model_weights,
    model_files,
)

logger = get_logger(__name__)


class ServeSource(TeacherSourceKind):
    name = "serve"
    section = ServeSection
    exact_forms = ("logits",)
    model_runs = "replicas"
    where = "in the Serve pool"

    def check_inputs(self, t: ServeSection) -> None:
        if t.start_pool:
            check_model_weights(t.model)

    def compared_with_student(self, t: ServeSection) -> TeacherFiles | None:
        return model_files(t.model) if t.start_pool else None

    def check_ports(self, t: ServeSection, local: bool) -> None:
        from hylo.pipeline.ray_init import RayStartupError, port_is_free, port_is_listening  # lazy: layering

        port, host = t.pool.port, t.pool.host
        if t.start_pool and port is not None and local and not port_is_free(host, port):
            raise RayStartupError(pool_port_taken(host, port, "another process listens there"
                                                  if port_is_listening(host, port) else "it cannot be bound"))

    def resources(self, t: ServeSection) -> list[ResourceDemand]:
        if not t.start_pool:
            return []
        pool = t.pool
        return [ResourceDemand("teacher replica", pool.num_replicas,
                               {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **(pool.resources or {})},
                               "teacher.pool.num_replicas / teacher.pool.num_cpus / num_gpus")]

    def start(self, t: ServeSection, fault: Any) -> Callable[[], None] | None:
        if not t.start_pool:
            return None
        from hylo.pipeline.teacher.serve import start_teacher_pool  # lazy: torch

        logger.info(f"[teacher] deploying pool {t.pool.app_name!r} ({t.pool.num_replicas} replicas)")
        start_teacher_pool(t.model, t.pool, fault)

        def stop() -> None:
            from ray import serve  # lazy: ray

            from hylo.pipeline.teacher.serve import forwards_line, pool_forwards  # lazy: torch

            try:
                line = forwards_line(t.pool.app_name, pool_forwards(t.pool.app_name))
            except Exception as e:  # a count for the log: the pool is deleted all the same
                line = f"[teacher] pool {t.pool.app_name!r}: its replicas' forwards could not be read ({e!r})"
            logger.info(line)
            serve.delete(t.pool.app_name)

        return stop

    def open(self, t: ServeSection, data_path: str | None) -> tuple[Any, int | None]:
        from hylo.pipeline.teacher.client import TeacherClient  # lazy: torch

        # the vocabulary is the replicas': each checks the ids of every row it receives
        return TeacherClient.from_config(t.pool.app_name, t.client, t.model.logits_chunk_tokens), None

