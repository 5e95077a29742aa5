"""Engine side of the EPLB metrics: the engine core polls the workers' compact EPLB summaries
(``Worker.eplb_summary`` -> ``EplbMetrics.summary``) and hands them to the stat loggers through
``SchedulerStats.eplb``; :func:`format_rebalance_log` is the stat logger's one-line summary of a rebalance.

A summary is a dict: ``enabled``, ``steps``, ``rebalances``, ``plans_failed``, ``moves_total``, ``bytes_total``,
``stall_s_total``, ``imbalance`` (per MoE layer, max / mean load per rank of the current placement on the last load
window), ``hot_experts`` (per layer the hottest experts as ``[expert, load share]``), ``new_rebalances`` (the
rebalances since the previous summary, each a ``RebalanceStats`` dict) and ``disabled_reason``.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

MULTIPROC_POLL_STEPS = 8  # an RPC round trip to the worker processes; in-process workers are polled every step


class EplbStatsCollector:
    """Polls EP rank 0's EPLB summary every ``interval`` engine steps through ``rpc(method, args) -> list``
    (``Executor.collective_rpc``). ``take()`` returns the newest summary not yet taken, whose ``new_rebalances``
    accumulates every rebalance since the previous ``take()``."""

    def __init__(self, rpc: Any, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self._rpc, self.interval = rpc, interval
        self._steps = 0
        self._version, self._rebalances = -1, 0
        self._pending: dict[str, Any] | None = None
        self._failed = False

    def after_step(self) -> None:
        """Count one engine step; poll the workers when the interval is reached."""
        self._steps += 1
        if self._steps % self.interval == 0:
            self.poll()

    def poll(self) -> None:
        """Fetch a summary if the workers have new values (errors are logged once, never raised)."""
        try:
            summary = self._rpc("eplb_summary", (self._version, self._rebalances))[0]
        except Exception:
            if not self._failed:
                logger.exception("fetching EPLB stats from the workers failed (further errors are not logged)")
                self._failed = True
            return
        if summary is None:
            return
        self._version, self._rebalances = summary["version"], summary["rebalances"]
        if self._pending is not None:
            summary["new_rebalances"] = self._pending["new_rebalances"] + summary["new_rebalances"]
        self._pending = summary

    def take(self) -> dict[str, Any] | None:
        """The newest summary since the previous call (None if nothing new)."""
        out, self._pending = self._pending, None
        return out


def _span(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"mean {sum(values) / len(values):.3f} max {max(values):.3f}"


def format_rebalance_log(summary: dict[str, Any] | None) -> list[str]:
    """One log line per rebalance reported in ``summary`` (empty when none)."""
    if not summary:
        return []
    lines = []
    for r in summary.get("new_rebalances", []):
        lines.append(
            f"EPLB rebalance at step {r['step']}: {r['changed_layers']} layers changed, {r['moves']} slots moved "
            f"({r['bytes_moved'] / 2 ** 20:.2f} MiB), stall {r['stall_s'] * 1e3:.1f} ms, plan "
            f"{r['plan_s'] * 1e3:.1f} ms; imbalance {_span(r['imbalance_before'])} -> {_span(r['imbalance_after'])}")
    return lines
