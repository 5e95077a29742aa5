"""Multiprocess executor: one spawned worker process per rank, torch.distributed (gloo on CPU, NCCL on CUDA).

The parent hosts the rendezvous ``TCPStore`` on a free port of 127.0.0.1 (no port race) and talks to each rank over
its own pipe (protocol in ``worker_host``). A step pickles the ``SchedulerOutput`` once and sends it to every rank;
every rank runs the step (logits are all-gathered and the samplers' generators identically seeded, so all ranks
sample the same tokens) and rank 0's output is returned.

Liveness: every wait multiplexes the reply pipes with the processes' exit sentinels, so a worker that dies is seen at
once and raises ``WorkerDiedError`` naming its rank and exit code; all other workers are then stopped and the
executor refuses further work. A worker exception during a step is fatal in the same way (ranks may be out of step).
Workers exit by themselves when the parent dies. ``shutdown()`` sends a stop command, joins with a timeout, then
terminates and finally kills stragglers; a ``weakref.finalize`` guard (also run at interpreter exit) does the same
if the owner forgets.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ascent.config import EngineConfig
from ascent.core.sched_output import ModelRunnerOutput, SchedulerOutput
from ascent.distributed.parallel_state import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    create_rendezvous_store,
    default_backend,
)
from ascent.executor.base import (
    DEFAULT_RPC_TIMEOUT_S,
    Executor,
    ExecutorError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from ascent.executor.worker_host import WorkerSpec, is_rpc_method, propagated_env, worker_main

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_EXECUTE_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 5.0
DEATH_GRACE_S = 1.0  # after an error reply, how long to wait for a peer's exit to show (death explains the error)
POLL_S = 1.0
_STOP = pickle.dumps(("stop",))


@dataclass(eq=False)
class _Workers:
    """What the finalizer needs to clean up (kept apart from the executor so the executor can be collected)."""

    procs: list[Any] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)
    store: Any = None
    closed: bool = False


def _stop_workers(workers: _Workers, graceful: bool = True, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop every worker process: stop command + bounded join (if ``graceful``), then terminate, then kill."""
    if workers.closed:
        return
    workers.closed = True
    if graceful:
        for proc, conn in zip(workers.procs, workers.conns):
            if proc.is_alive():
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in workers.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for escalate in ("terminate", "kill"):
        alive = [p for p in workers.procs if p.is_alive()]
        for proc in alive:
            getattr(proc, escalate)()
        for proc in alive:
            proc.join(2.0)
    for conn in workers.conns:
        conn.close()
    workers.store = None


_LIVE_WORKERS: "weakref.WeakSet[_Workers]" = weakref.WeakSet()


@atexit.register
def _stop_live_workers() -> None:
    """Registered after multiprocessing's own exit hook, so it runs first: no exit waits on a worker."""
    for workers in list(_LIVE_WORKERS):
        _stop_workers(workers)


class MultiprocExecutor(Executor):
    """Spawns ``world_size`` worker processes and waits until all have loaded the model.

    ``collective_timeout_s`` (default ``parallel_config.distributed_timeout_s``) bounds torch.distributed
    collectives inside the workers; ``daemon=False`` lets workers start processes of their own (interpreter exit
    still stops them first, through this module's exit hook).
    """

    def __init__(self, config: EngineConfig, *, startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 execute_timeout_s: float = DEFAULT_EXECUTE_TIMEOUT_S,
                 collective_timeout_s: float | None = None, daemon: bool = True) -> None:
        super().__init__(config)
        if collective_timeout_s is None:
            collective_timeout_s = float(getattr(config.parallel_config, "distributed_timeout_s",
                                                 DEFAULT_COLLECTIVE_TIMEOUT_S))
        for name, value in (("startup_timeout_s", startup_timeout_s), ("execute_timeout_s", execute_timeout_s),
                            ("collective_timeout_s", collective_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name}={value} must be positive")
        self.execute_timeout_s = execute_timeout_s
        self.backend = default_backend(config.device_config.device)
        self._workers = _Workers()
        _LIVE_WORKERS.add(self._workers)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._failure: ExecutorError | None = None
        start = time.perf_counter()
        try:
            self._spawn(collective_timeout_s, daemon)
            ready = self._round_trip(None, "startup", startup_timeout_s, fatal=True)
        except BaseException:
            self._finalizer()
            raise
        self.timings.update(ready[0])
        self.timings["worker_start_s"] = time.perf_counter() - start
        logger.info("started %d worker processes (%s) in %.1fs", self.world_size, self.backend,
                    self.timings["worker_start_s"])

    # -------------------------------------------------------------------------------------------- processes
    def _spawn(self, collective_timeout_s: float, daemon: bool) -> None:
        ctx = mp.get_context("spawn")
        w = self._workers
        w.store = create_rendezvous_store("127.0.0.1", collective_timeout_s)
        for rank in range(self.world_size):
            spec = WorkerSpec(rank=rank, world_size=self.world_size, config=self.config, port=int(w.store.port),
                              backend=self.backend, env=propagated_env(), parent_pid=os.getpid(),
                              collective_timeout_s=collective_timeout_s)
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(spec, child_conn), name=f"ascent-worker-{rank}",
                               daemon=daemon)
            proc.start()
            child_conn.close()
            w.procs.append(proc)
            w.conns.append(parent_conn)

    @property
    def worker_pids(self) -> list[int]:
        return [int(p.pid) for p in self._workers.procs]

    def _dead_rank(self, grace_s: float = 0.0, exclude: int | None = None) -> int | None:
        """The lowest rank (other than ``exclude``) whose process has exited, waiting up to ``grace_s`` for one."""
        procs = [(r, p) for r, p in enumerate(self._workers.procs) if r != exclude]
        if grace_s > 0 and procs and all(p.exitcode is None for _, p in procs):
            wait([p.sentinel for _, p in procs], timeout=grace_s)
        for rank, proc in procs:
            if proc.exitcode is not None:
                return rank
        return None

    def _died(self, rank: int, during: str) -> WorkerDiedError:
        proc = self._workers.procs[rank]
        proc.join(DEATH_GRACE_S)
        return WorkerDiedError(rank, proc.exitcode, proc.pid, during)

    def _fail(self, error: ExecutorError) -> ExecutorError:
        """Record a fatal error and stop all workers; returns ``error`` for the caller to raise."""
        if self._failure is None:
            self._failure = error
            logger.error("executor failed: %s", str(error).splitlines()[0])
            _stop_workers(self._workers, graceful=False)
        return error

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if self._workers.closed:
            raise ExecutorError("executor was shut down")

    # -------------------------------------------------------------------------------------------- messaging
    def _broadcast(self, payload: bytes, during: str) -> None:
        for rank, conn in enumerate(self._workers.conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                dead = self._dead_rank(DEATH_GRACE_S)
                error = self._died(dead, during) if dead is not None else ExecutorError(
                    f"cannot reach worker rank {rank} during {during}: {exc}")
                raise self._fail(error) from exc

    def _receive(self, rank: int, during: str) -> tuple[str, Any]:
        try:
            return pickle.loads(self._workers.conns[rank].recv_bytes())
        except (EOFError, OSError) as exc:
            raise self._fail(self._died(rank, during)) from exc

    def _round_trip(self, payload: bytes | None, during: str, timeout_s: float, fatal: bool) -> list[Any]:
        """Send ``payload`` (if any) to every rank and collect one reply per rank (rank order), failing fast on a
        death, a timeout, or (``fatal``) an error reply. An interruption (e.g. KeyboardInterrupt) leaves messages
        in flight, so it is fatal too."""
        try:
            if payload is not None:
                self._broadcast(payload, during)
            return self._gather_replies(during, timeout_s, fatal)
        except ExecutorError:
            raise
        except BaseException as exc:
            self._fail(ExecutorError(f"interrupted while waiting for workers during {during}: {exc!r}"))
            raise

    def _gather_replies(self, during: str, timeout_s: float, fatal: bool) -> list[Any]:
        w = self._workers
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        conn_rank = {id(c): r for r, c in enumerate(w.conns)}
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(replies))
                raise self._fail(WorkerTimeoutError(f"worker rank(s) {missing} did not answer {during} within "
                                                    f"{timeout_s:g}s"))
            pending = [c for r, c in enumerate(w.conns) if r not in replies]
            for ready in wait(pending + [p.sentinel for p in w.procs], timeout=min(remaining, POLL_S)):
                rank = conn_rank.get(id(ready))
                if rank is not None and rank not in replies:
                    replies[rank] = self._receive(rank, during)
                    if replies[rank][0] == "error" and fatal:
                        self._raise_error_reply(rank, replies[rank][1], during)
            dead = self._dead_rank()
            if dead is not None:
                raise self._fail(self._died(dead, during))
        errors = [(r, payload) for r, (kind, payload) in sorted(replies.items()) if kind == "error"]
        if errors:
            raise WorkerError(errors[0][0], errors[0][1], during)
        return [replies[r][1] for r in range(self.world_size)]

    def _raise_error_reply(self, rank: int, remote_traceback: str, during: str) -> None:
        """A worker failed mid-step: a peer's death explains it best (its collective broke); else report it."""
        dead = self._dead_rank(DEATH_GRACE_S, exclude=rank)
        if dead is not None and not self._sent_error(dead):
            raise self._fail(self._died(dead, during))
        raise self._fail(WorkerError(rank, remote_traceback, during))

    def _sent_error(self, rank: int) -> bool:
        """Whether ``rank`` left an error reply before exiting (it failed by itself rather than being killed)."""
        conn = self._workers.conns[rank]
        try:
            return conn.poll() and pickle.loads(conn.recv_bytes())[0] == "error"
        except (EOFError, OSError):
            return False

    # -------------------------------------------------------------------------------------------- Executor API
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._check_usable()
        payload = pickle.dumps(("execute", scheduler_output), protocol=pickle.HIGHEST_PROTOCOL)
        return self._round_trip(payload, "execute_model", self.execute_timeout_s, fatal=True)[0]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> list[Any]:
        if not is_rpc_method(method):
            raise ValueError(f"method={method!r} is not a worker RPC method")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        self._check_usable()
        payload = pickle.dumps(("rpc", method, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
        return self._round_trip(payload, f"rpc {method}", timeout_s, fatal=False)

    def check_health(self, timeout_s: float = 30.0) -> None:
        self._check_usable()
        dead = self._dead_rank()
        if dead is not None:
            raise self._fail(self._died(dead, "health check"))
        self.collective_rpc("ping", timeout_s=timeout_s)

    def shutdown(self) -> None:
        self._finalizer()
