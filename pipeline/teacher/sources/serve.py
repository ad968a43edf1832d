"""`teacher.source: serve`: the Ray Serve teacher pool (pipeline/teacher/serve.py), through `TeacherClient`.

With `start_pool: true` the driver deploys the pool from `teacher.model` and `teacher.pool` before training and
deletes it after (its replicas count in the run's Ray resources); with false the client attaches to a pool
someone else runs under `pool.app_name`, and nothing of it is checked before Ray starts. Gives top-k records
or the exact teacher (k: 0) in one of two forms:
* `hidden`: each row's final hidden states [T, H'] in the teacher's dtype; each training worker reads the teacher's
  LM head [V, H'] from `teacher.model.path` (teacher/head.py) and checks it against the pool's (shape, dtype,
  digest) before the first row. The fused KL computes the logits chunk by chunk, as for the in-process teacher.
  On the wire: H' / V of the logits (Llama-3.1-8B: 4,096 / 128,256, 31x less).
* `logits`: full-vocabulary logits streamed chunk by chunk (the LM head stays on the replicas).
`auto` picks hidden where the driver deploys the pool (`start_pool: true`) from a transformers checkpoint whose
head safetensors can read (`lm_head.weight`, or the tied `model.embed_tokens.weight`), logits otherwise (a HyLo
teacher, a .bin checkpoint, a pool someone else runs).

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
    exact_forms = ("hidden", "logits")
    model_runs = "replicas"
    where = "in the Serve pool"

    def auto_form(self, t: ServeSection) -> str:
        from hylo.assets import local_path  # lazy: layering (no fetch: the path as it is now)
        from hylo.pipeline.teacher.head import find_head  # lazy: safetensors

        if not t.start_pool:
            return "logits"
        d = local_path(t.model.path)
        if d is None:
            return "logits"
        if not d.exists():
            # a published model named by its directory, not mounted here (`hylo estimate`): a transformers
            # teacher; the run reads its head before Ray starts (check_inputs)
            return "hidden"
        if (d / "hybrid_config.json").is_file():
            return "logits"
        return "hidden" if not isinstance(find_head(d), str) else "logits"

    def check_inputs(self, t: ServeSection) -> None:
        if t.start_pool:
            check_model_weights(t.model)
        if t.form == "hidden":
            from hylo.pipeline.config import ConfigError  # lazy: layering
            from hylo.pipeline.teacher.head import find_head  # lazy: safetensors
            from hylo.pipeline.teacher.model import resolve_model_path  # lazy: torch

            where = find_head(resolve_model_path(t.model.path))
            if isinstance(where, str):
                raise ConfigError(f"teacher.model.path={t.model.path}: exact_form hidden reads the teacher's LM head "
                                  f"there, and cannot: {where}; set teacher.exact_form: logits", "teacher.model.path")

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

        if t.form != "hidden":
            # the vocabulary is the replicas': each checks the ids of every row it receives
            return TeacherClient.from_config(t.pool.app_name, t.client, t.model.logits_chunk_tokens), None
        from hylo.pipeline.teacher.head import load_head  # lazy: torch
        from hylo.pipeline.teacher.model import resolve_model_path, torch_dtype  # lazy: torch

        path = resolve_model_path(t.model.path)
        head = load_head(path, torch_dtype(t.model.dtype))
        client = TeacherClient.from_config(t.pool.app_name, t.client, t.model.logits_chunk_tokens, head)
        client.check_head(str(path))
        logger.info(f"[teacher] the pool's LM head checked against {path} ({head.shape[0]:,} x {head.shape[1]:,}, "
                    f"{str(head.dtype).removeprefix('torch.')}): the pool sends hidden states")
        return client, int(head.shape[0])

