"""Prometheus collectors of the EPLB summary (``ascent.eplb.engine_stats``), created on the first summary so that a
server without EPLB exports no EPLB series.

* ``ascent:eplb_imbalance{layer}`` gauge: max / mean load per rank of each MoE layer (current placement, last window);
* ``ascent:eplb_expert_load_share{layer,expert}`` gauge: load share of the ``HOT_EXPERTS`` hottest experts per layer
  (series of experts that left the top set are removed, so at most layers x HOT_EXPERTS series exist);
* ``ascent:eplb_rebalances_total``, ``ascent:eplb_moved_slots_total``, ``ascent:eplb_moved_bytes_total`` counters;
* ``ascent:eplb_rebalance_stall_seconds`` histogram (one observation per rebalance);
* ``ascent:eplb_enabled`` gauge (0 once rebalancing was disabled, e.g. the policy process died).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "ascent:"
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EplbPrometheus:
    """EPLB series with the engine's constant labels (``labels``: e.g. model_name, engine)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._labels = dict(labels)
        names = tuple(labels)
        self.imbalance = Gauge(PREFIX + "eplb_imbalance", "EPLB: max / mean expert load per rank of an MoE layer.",
                               (*names, "layer"), registry=registry)
        self.load_share = Gauge(PREFIX + "eplb_expert_load_share",
                                "EPLB: load share of the hottest experts of an MoE layer (top experts only).",
                                (*names, "layer", "expert"), registry=registry)
        self.enabled = Gauge(PREFIX + "eplb_enabled", "EPLB: 1 while dynamic rebalancing is active.", names,
                             registry=registry).labels(**labels)
        self.rebalances = Counter(PREFIX + "eplb_rebalances", "EPLB: rebalances applied.", names,
                                  registry=registry).labels(**labels)
        self.moved_slots = Counter(PREFIX + "eplb_moved_slots", "EPLB: expert slots whose weights were replaced.",
                                   names, registry=registry).labels(**labels)
        self.moved_bytes = Counter(PREFIX + "eplb_moved_bytes", "EPLB: expert weight bytes moved between ranks.",
                                   names, registry=registry).labels(**labels)
        self.stall = Histogram(PREFIX + "eplb_rebalance_stall_seconds",
                               "EPLB: time serving stalled to apply a rebalance.", names, buckets=STALL_BUCKETS,
                               registry=registry).labels(**labels)
        self._shares: set[tuple[str, str]] = set()

    def record(self, summary: dict[str, Any]) -> None:
        """Export one summary (its ``new_rebalances`` are counted once)."""
        self.enabled.set(1.0 if summary.get("enabled") else 0.0)
        for layer, value in enumerate(summary.get("imbalance", [])):
            self.imbalance.labels(**self._labels, layer=str(layer)).set(value)
        self._record_shares(summary.get("hot_experts", []))
        for r in summary.get("new_rebalances", []):
            self.rebalances.inc()
            if r["moves"] > 0:
                self.moved_slots.inc(r["moves"])
            if r["bytes_moved"] > 0:
                self.moved_bytes.inc(r["bytes_moved"])
            self.stall.observe(r["stall_s"])

    def _record_shares(self, hot: list[list[Any]]) -> None:
        current = set()
        for layer, experts in enumerate(hot):
            for expert, share in experts:
                key = (str(layer), str(int(expert)))
                current.add(key)
                self.load_share.labels(**self._labels, layer=key[0], expert=key[1]).set(share)
        if not hot:
            return
        for layer, expert in self._shares - current:
            self.load_share.remove(*self._labels.values(), layer, expert)
        self._shares = current
