"""Executor interface: runs the model on one or more worker ranks for the engine core.

``Executor.create(config)`` picks ``UniProcExecutor`` (one in-process worker) when the world size is 1 and
``MultiprocExecutor`` (one spawned process per rank over torch.distributed) otherwise. Every rank executes every
step; the driver rank's (rank 0) ``ModelRunnerOutput`` is returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ascent.config import EngineConfig
from ascent.core.sched_output import ModelRunnerOutput, SchedulerOutput

DEFAULT_RPC_TIMEOUT_S = 300.0
EXECUTOR_BACKENDS = ("uni", "mp")


class ExecutorError(RuntimeError):
    """The executor cannot continue (a worker failed, died or stopped answering, or it was shut down)."""


class WorkerDiedError(ExecutorError):
    """A worker process exited unexpectedly; ``rank`` and ``exitcode`` (negative = killed by that signal)."""

    def __init__(self, rank: int, exitcode: int | None, pid: int | None = None, during: str = "") -> None:
        self.rank, self.exitcode, self.pid = rank, exitcode, pid
        signal_note = ""
        if exitcode is not None and exitcode < 0:
            import signal

            try:
                signal_note = f" (killed by {signal.Signals(-exitcode).name})"
            except ValueError:
                signal_note = f" (killed by signal {-exitcode})"
        where = f" during {during}" if during else ""
        super().__init__(f"worker rank {rank} (pid {pid}) died{where} with exit code {exitcode}{signal_note}; "
                         "the engine cannot continue")


class WorkerError(ExecutorError):
    """A worker raised an exception; ``rank`` and the worker-side ``remote_traceback``."""

    def __init__(self, rank: int, remote_traceback: str, during: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "unknown error"
        where = f" during {during}" if during else ""
        super().__init__(f"worker rank {rank} failed{where}: {last}\n--- worker traceback ---\n{remote_traceback}")


class WorkerTimeoutError(ExecutorError, TimeoutError):
    """Workers did not answer within the allowed time."""


def executor_world_size(config: EngineConfig) -> int:
    """Ranks one executor drives: the tensor-parallel size (data parallelism runs one engine per DP rank)."""
    tp = int(config.parallel_config.tensor_parallel_size)
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
    return tp


class Executor(ABC):
    """Drives the workers of one engine. ``timings`` holds the driver worker's load/KV-allocation timings
    (``load_weights_s``, ``kv_alloc_s``) plus executor-specific ones (``worker_start_s``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = executor_world_size(config)
        self.timings: dict[str, float] = {}

    @staticmethod
    def create(config: EngineConfig, backend: str | None = None) -> "Executor":
        """``backend``: None = by world size, or ``config.parallel_config.distributed_executor_backend`` when set;
        ``"uni"`` (world size 1 only) or ``"mp"`` (worker processes, also for world size 1)."""
        world = executor_world_size(config)
        backend = backend or getattr(config.parallel_config, "distributed_executor_backend", None)
        backend = backend or ("uni" if world == 1 else "mp")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} must be one of {EXECUTOR_BACKENDS}")
        if backend == "uni":
            if world != 1:
                raise ValueError(f"distributed_executor_backend='uni' needs world size 1, got {world}")
            from ascent.executor.uniproc import UniProcExecutor

            return UniProcExecutor(config)
        from ascent.executor.multiproc import MultiprocExecutor

        eplb = getattr(config, "eplb_config", None)
        # workers that run an EPLB policy process must not be daemons (daemons cannot have children)
        return MultiprocExecutor(config, daemon=not (eplb is not None and eplb.enable))

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum of the ranks' own answers."""
        return int(min(self.collective_rpc("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every rank."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be at least 2")
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        self.timings.update(self.collective_rpc("get_timings")[0])

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return the driver rank's output."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> list[Any]:
        """Call ``method`` (a public ``Worker`` method or a host built-in: ``ping``, ``get_timings``, ``get_env``,
        ``parallel_info``) on every rank; results in rank order. Raises ``WorkerError`` if a rank raised."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise ``ExecutorError`` (``WorkerDiedError`` for a dead worker) when the workers cannot serve."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources; idempotent."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
