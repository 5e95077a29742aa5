"""Executors: run the model on one in-process worker or on one spawned process per rank."""

from ascent.executor.base import (
    Executor,
    ExecutorError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    executor_world_size,
)

__all__ = [
    "Executor",
    "ExecutorError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
    "executor_world_size",
]
