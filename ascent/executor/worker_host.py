"""The worker side of an executor: process setup, one ``Worker``, RPC dispatch, and the worker-process command loop.

``WorkerHost`` runs in the engine process (uniproc) or in a spawned worker process (multiproc). In a worker process
it applies the propagated environment, sets torch threads (``num_threads`` or 1), sets the hardware profile, joins
``torch.distributed`` through the parent's rendezvous store and builds the TP/DP/EP groups before the model is built.

Protocol of ``worker_main`` (one duplex pipe per rank, pickled tuples): parent -> worker ``("execute",
SchedulerOutput)``, ``("rpc", method, args, kwargs)``, ``("stop",)``; worker -> parent ``("ready", timings)`` once,
then one ``("ok", result)`` or ``("error", traceback_text)`` per command. Only rank 0 returns the step's
``ModelRunnerOutput``; the others reply ``None``.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from ascent.config import EngineConfig
from ascent.worker.worker import Worker

HOST_METHODS = frozenset({"ping", "get_timings", "get_env", "parallel_info"})
PROPAGATED_ENV = ("PYTHONHASHSEED",)
PARENT_POLL_S = 0.5
EXIT_PARENT_GONE = 70
EXIT_INIT_FAILED = 1


@dataclass
class WorkerSpec:
    """Everything a worker needs to start. ``port`` is the rendezvous store's port (None: no torch.distributed)."""

    rank: int
    world_size: int
    config: EngineConfig
    port: int | None = None
    backend: str = "gloo"
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    parent_pid: int | None = None
    collective_timeout_s: float = 300.0


def is_rpc_method(method: str) -> bool:
    """Whether ``collective_rpc`` may call ``method`` (host built-ins and public ``Worker`` methods)."""
    if method in HOST_METHODS:
        return True
    return not method.startswith("_") and callable(getattr(Worker, method, None))


def propagated_env() -> dict[str, str]:
    """The parent's values of the variables every worker must share (e.g. ``PYTHONHASHSEED`` for prefix hashing)."""
    return {name: os.environ[name] for name in PROPAGATED_ENV if name in os.environ}


class WorkerHost:
    """One rank: sets up the process, builds and loads the ``Worker``; ``call`` dispatches RPCs."""

    def __init__(self, spec: WorkerSpec, in_subprocess: bool) -> None:
        from ascent.platform.device_config import set_current_profile

        self.spec = spec
        self.in_subprocess = in_subprocess
        config = spec.config
        if in_subprocess:
            os.environ.update(spec.env)
            torch.set_num_threads(config.device_config.num_threads or 1)
        set_current_profile(config.device_config.profile)
        self.distributed = spec.port is not None
        if self.distributed:
            self._init_distributed()
        self.worker = Worker(config)
        self.worker.load_model()

    def _init_distributed(self) -> None:
        from ascent.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        spec, pc = self.spec, self.spec.config.parallel_config
        init_distributed_environment(spec.rank, spec.world_size, spec.port, spec.backend, spec.host,
                                     spec.collective_timeout_s)
        initialize_model_parallel(spec.world_size, 1, bool(getattr(pc, "enable_expert_parallel", False)),
                                  spec.collective_timeout_s)

    def call(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not is_rpc_method(method):
            raise ValueError(f"method={method!r} is not a worker RPC method")
        target = self if method in HOST_METHODS else self.worker
        return getattr(target, method)(*args, **(kwargs or {}))

    def execute_model(self, scheduler_output: Any) -> Any:
        out = self.worker.execute_model(scheduler_output)
        return out if self.spec.rank == 0 else None

    # -------------------------------------------------------------------------------------------- host built-ins
    def ping(self) -> int:
        return self.spec.rank

    def get_timings(self) -> dict[str, float]:
        return dict(self.worker.timings)

    def get_env(self, name: str) -> str | None:
        return os.environ.get(name)

    def parallel_info(self) -> dict[str, Any]:
        """Rank, pid, threads, hash probe and this rank's TP/DP/EP positions (for diagnostics and tests)."""
        from ascent.distributed import parallel_state as ps

        groups = {"tp": ps.get_tp_group(), "dp": ps.get_dp_group(), "ep": ps.get_ep_group()}
        info: dict[str, Any] = {
            "rank": self.spec.rank, "world_size": self.spec.world_size, "pid": os.getpid(),
            "num_threads": torch.get_num_threads(), "hash_probe": hash("ascent-hash-probe"),
            "backend": self.spec.backend if self.distributed else None,
            "expert_parallel": ps.expert_parallel_enabled(),
        }
        for name, g in groups.items():
            info[f"{name}_ranks"], info[f"{name}_rank"], info[f"{name}_size"] = g.ranks, g.rank_in_group, g.world_size
        return info

    def close(self) -> None:
        updator = getattr(self.worker, "eplb_updator", None) if hasattr(self, "worker") else None
        if updator is not None:
            updator.shutdown()  # stop the EPLB policy process before the groups go away
        if self.distributed:
            from ascent.distributed.parallel_state import destroy_distributed_environment

            destroy_distributed_environment()
            self.distributed = False


# ------------------------------------------------------------------------------------------------ worker process
def _send(conn: Connection, message: tuple) -> None:
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an unpicklable result becomes an error reply
        data = pickle.dumps(("error", traceback.format_exc()), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker as soon as its parent is gone (no orphan keeps running after the engine dies)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(EXIT_PARENT_GONE)


def _handle(host: WorkerHost, message: tuple) -> tuple:
    kind = message[0]
    try:
        if kind == "execute":
            return ("ok", host.execute_model(message[1]))
        if kind == "rpc":
            _, method, args, kwargs = message
            return ("ok", host.call(method, args, kwargs))
        raise ValueError(f"unknown executor command {kind!r}")
    except Exception:
        return ("error", traceback.format_exc())


def _serve(host: WorkerHost, conn: Connection) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        if message[0] == "stop":
            _send(conn, ("ok", None))
            return
        _send(conn, _handle(host, message))


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process (spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops us explicitly
    if spec.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True,
                         name="ascent-parent-watch").start()
    try:
        host = WorkerHost(spec, in_subprocess=True)
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        conn.close()
        sys.exit(EXIT_INIT_FAILED)
    _send(conn, ("ready", host.get_timings()))
    try:
        _serve(host, conn)
    finally:
        host.close()
        conn.close()
