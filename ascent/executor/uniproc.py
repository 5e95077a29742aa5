"""Uniprocess executor: one ``Worker`` in the engine process (world size 1, no torch.distributed)."""

from __future__ import annotations

from typing import Any

from ascent.config import EngineConfig
from ascent.core.sched_output import ModelRunnerOutput, SchedulerOutput
from ascent.executor.base import DEFAULT_RPC_TIMEOUT_S, Executor, ExecutorError
from ascent.executor.worker_host import WorkerHost, WorkerSpec
from ascent.worker.worker import Worker


class UniProcExecutor(Executor):
    """Builds and loads the worker on construction; RPCs are direct calls (timeouts do not apply)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if self.world_size != 1:
            raise ValueError(f"UniProcExecutor needs world size 1, got tensor_parallel_size={self.world_size}")
        self._host: WorkerHost | None = WorkerHost(WorkerSpec(rank=0, world_size=1, config=config),
                                                   in_subprocess=False)
        self.timings.update(self._host.get_timings())

    @property
    def driver_worker(self) -> Worker:
        """The in-process worker (for callers that inspect the model runner directly)."""
        return self._live_host().worker

    def _live_host(self) -> WorkerHost:
        if self._host is None:
            raise ExecutorError("executor was shut down")
        return self._host

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._live_host().execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> list[Any]:
        return [self._live_host().call(method, tuple(args), kwargs)]

    def check_health(self) -> None:
        self._live_host()

    def shutdown(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
