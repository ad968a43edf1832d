"""What Ray Train's controller holds for the workers, in modules that import nothing of the training stack.

    TorchTrainer(WorkerEntry.of(stage), torch_config=<a backend calling collective.collective_backend>)

The controller (an actor process of its own per run) unpickles the train function and the backend config it is
given, and only passes the function on to the workers. Handed `partial(loop.train_worker, stage)` and a backend
that called `loop.collective_backend`, it imported the whole training stack to unpickle them (the loop, the
stage's model code, transformers, DeepSpeed: ~3 CPU-s of every Ray Train run's start, for nothing). Here the
stage travels as cloudpickle bytes that only a worker opens, and the loop is imported where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerEntry:
    """Ray Train's `train_loop_per_worker`: `loop.train_worker(stage, loop_config)` on each worker, the stage
    (a `worker.Stage`) kept as cloudpickle bytes until then."""

    stage: bytes

    @classmethod
    def of(cls, stage: Any) -> WorkerEntry:
        from ray import cloudpickle

        return cls(cloudpickle.dumps(stage))

    def __call__(self, loop_config: dict[str, Any]) -> None:
        from ray import cloudpickle

        from hylo.pipeline.train.loop import train_worker

        train_worker(cloudpickle.loads(self.stage), loop_config)
