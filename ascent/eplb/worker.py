"""The EPLB policy process (specs §3.3): plans are computed away from the serving process.

``PolicyWorker`` spawns one process (spawn context, one duplex pipe, ``torch.set_num_threads(1)``) that builds the
policy with ``PolicyFactory.generate_policy(name)`` and answers ``(request_id, placement, load)`` requests with the
policy's result. It never touches a process group. Every wait is bounded; a dead process (or a broken pipe) raises
:class:`PolicyWorkerDied`, which the updater turns into "rebalancing disabled" while serving continues. The process
exits on its own when the parent's pipe closes or the parent dies.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

DEFAULT_POLICY_MODULE = "ascent.eplb.policy"
POLL_S = 0.5
STOP_TIMEOUT_S = 5.0


class PolicyWorkerDied(RuntimeError):
    """The policy process is gone (killed, crashed, or its pipe broke)."""


@dataclass
class PlanResult:
    """A policy answer: ``new_placement`` int64 ``[L, R, S]`` (None with ``error`` when the policy raised)."""

    request_id: int
    changed: bool = False
    layer_order: list[int] | None = None
    new_placement: torch.Tensor | None = None
    compute_s: float = 0.0
    error: str | None = None


def _compute(policy: object, request_id: int, placement: torch.Tensor, load: torch.Tensor) -> PlanResult:
    start = time.perf_counter()
    try:
        changed, order, new = policy.rebalance_experts(placement.numpy(), load.double().numpy())  # type: ignore
    except Exception:
        return PlanResult(request_id, error=traceback.format_exc())
    order_list = [int(v) for v in torch.as_tensor(order).flatten().tolist()] if order is not None else None
    return PlanResult(request_id, bool(changed), order_list, torch.as_tensor(new).to(torch.int64).clone(),
                      time.perf_counter() - start)


def policy_main(policy_name: str, conn: Connection, parent_pid: int, policy_module: str = DEFAULT_POLICY_MODULE
                ) -> None:
    """Entry point of the policy process: ``<policy_module>.PolicyFactory.generate_policy(policy_name)``."""
    torch.set_num_threads(1)
    policy = importlib.import_module(policy_module).PolicyFactory.generate_policy(policy_name)
    while os.getppid() == parent_pid:
        try:
            if not conn.poll(POLL_S):
                continue
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        conn.send(_compute(policy, *message))


class PolicyWorker:
    """Handle on the policy process (owned by EP rank 0 of the updater)."""

    def __init__(self, policy_name: str, policy_module: str = DEFAULT_POLICY_MODULE) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=policy_main, args=(policy_name, child, os.getpid(), policy_module),
                                   name="ascent-eplb-policy", daemon=True)
        self.process.start()
        child.close()
        self._next_id = 0
        self._pending: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def _died(self, what: str) -> PolicyWorkerDied:
        return PolicyWorkerDied(f"EPLB policy process pid={self.pid} died ({what}, exitcode="
                                f"{self.process.exitcode})")

    def submit(self, placement: torch.Tensor, load: torch.Tensor) -> int:
        """Send a planning request (non-blocking for small tensors); returns its id. A previous unanswered request
        is abandoned (its late answer is discarded)."""
        if not self.is_alive():
            raise self._died("before submit")
        self._next_id += 1
        try:
            self._conn.send((self._next_id, placement.to(torch.int64).cpu(), load.float().cpu()))
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise self._died(f"send failed: {exc}") from exc
        self._pending = self._next_id
        return self._next_id

    def result(self, timeout_s: float) -> PlanResult | None:
        """The answer to the pending request, waiting at most ``timeout_s`` (None: no request or not ready)."""
        if self._pending is None:
            return None
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                ready = self._conn.poll(min(POLL_S, max(0.0, deadline - time.monotonic())))
                answer = self._conn.recv() if ready else None
            except (EOFError, OSError) as exc:
                raise self._died(f"pipe closed: {exc}") from exc
            if isinstance(answer, PlanResult) and answer.request_id == self._pending:
                self._pending = None
                return answer
            if answer is None and not self.is_alive():
                raise self._died("while planning")
            if answer is None and time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        """Stop the process (bounded: terminate, then kill)."""
        try:
            self._conn.send(None)
        except (BrokenPipeError, EOFError, OSError):
            pass
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)
        self._conn.close()
