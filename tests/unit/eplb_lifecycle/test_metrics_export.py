"""EPLB metrics path: EplbMetrics.summary -> EplbStatsCollector (engine core) -> SchedulerStats.eplb -> Prometheus
series and the stat logger's rebalance line."""

from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from ascent.core.scheduler import SchedulerStats
from ascent.eplb.engine_stats import EplbStatsCollector, format_rebalance_log
from ascent.eplb.stats import HOT_EXPERTS, EplbMetrics, RebalanceStats, load_shares
from ascent.metrics.loggers import LoggingStatLogger
from ascent.metrics.prometheus import EngineMetrics

LABELS = {"model_name": "m", "engine": "0"}


def _metrics_with_rebalance(moves: int = 6, step: int = 5) -> EplbMetrics:
    metrics = EplbMetrics()
    load = torch.tensor([[10.0, 0.0, 30.0, 60.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 95.0]])
    placement = torch.tensor([[[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [3, 4, 5]]])
    metrics.observe_load(load, placement)
    metrics.add(RebalanceStats(step=step, changed_layers=2, moves=moves, p2p_transfers=moves, bytes_moved=moves * 64,
                               stall_s=0.003, plan_s=0.01, imbalance_before=[1.8, 1.9], imbalance_after=[1.2, 1.9]))
    return metrics


def test_load_shares_are_top_experts_with_their_share() -> None:
    shares = load_shares(torch.tensor([[10.0, 0.0, 30.0, 60.0], [0.0, 0.0, 0.0, 0.0]]), top=2)
    assert [e for e, _ in shares[0]] == [3, 2] and shares[0][0][1] == pytest.approx(0.6)
    assert [s for _, s in shares[1]] == [0.0, 0.0]


def test_summary_only_when_changed_and_only_new_rebalances() -> None:
    metrics = _metrics_with_rebalance()
    first = metrics.summary()
    assert first["rebalances"] == 1 and len(first["new_rebalances"]) == 1
    assert first["imbalance"] == [1.2, 1.9]  # the current placement after the rebalance
    assert len(first["hot_experts"]) == 2 and len(first["hot_experts"][0]) == HOT_EXPERTS
    assert metrics.summary(first["version"], first["rebalances"]) is None
    metrics.add(RebalanceStats(step=9, moves=1))
    second = metrics.summary(first["version"], first["rebalances"])
    assert [r["step"] for r in second["new_rebalances"]] == [9]


def test_collector_polls_with_the_seen_version_and_accumulates_rebalances() -> None:
    metrics = _metrics_with_rebalance()
    calls = []

    def rpc(method: str, args: tuple) -> list:
        calls.append((method, args))
        return [metrics.summary(*args)]

    collector = EplbStatsCollector(rpc, interval=2)
    collector.after_step()
    assert calls == [] and collector.take() is None
    collector.after_step()
    metrics.add(RebalanceStats(step=7, moves=2))
    collector.poll()
    taken = collector.take()
    assert calls[0] == ("eplb_summary", (-1, 0)) and calls[1][1] == (taken["version"] - 1, 1)
    assert [r["step"] for r in taken["new_rebalances"]] == [5, 7] and collector.take() is None
    collector.poll()
    assert collector.take() is None


def test_collector_swallows_rpc_errors(caplog) -> None:
    def rpc(method: str, args: tuple) -> list:
        raise RuntimeError("worker gone")

    collector = EplbStatsCollector(rpc)
    with caplog.at_level(logging.ERROR):
        collector.after_step()
        collector.after_step()
    assert collector.take() is None
    assert sum("EPLB stats" in r.message for r in caplog.records) == 1


def test_prometheus_exports_the_summary_values() -> None:
    registry = CollectorRegistry()
    engine_metrics = EngineMetrics(registry, "m")
    assert b"eplb" not in generate_latest(registry)
    summary = _metrics_with_rebalance().summary()
    engine_metrics.observe(SchedulerStats(eplb=summary), None)
    value = registry.get_sample_value
    for layer, imb in enumerate(summary["imbalance"]):
        assert value("ascent:eplb_imbalance", {**LABELS, "layer": str(layer)}) == pytest.approx(imb)
    for layer, experts in enumerate(summary["hot_experts"]):
        for expert, share in experts:
            labels = {**LABELS, "layer": str(layer), "expert": str(expert)}
            assert value("ascent:eplb_expert_load_share", labels) == pytest.approx(share)
    assert value("ascent:eplb_moved_slots_total", LABELS) == 6
    assert value("ascent:eplb_moved_bytes_total", LABELS) == 6 * 64
    assert value("ascent:eplb_rebalances_total", LABELS) == 1
    assert value("ascent:eplb_rebalance_stall_seconds_count", LABELS) == 1
    assert value("ascent:eplb_rebalance_stall_seconds_sum", LABELS) == pytest.approx(0.003)
    assert value("ascent:eplb_enabled", LABELS) == 1


def test_load_share_series_stay_bounded_when_hot_experts_change() -> None:
    registry = CollectorRegistry()
    engine_metrics = EngineMetrics(registry, "m")
    metrics = EplbMetrics()
    placement = torch.arange(16).reshape(1, 4, 4)
    for hot in range(16):
        load = torch.ones(1, 16)
        load[0, hot] = 100.0
        metrics.observe_load(load, placement)
        engine_metrics.observe(SchedulerStats(eplb=metrics.summary()), None)
    text = generate_latest(registry).decode()
    series = [line for line in text.splitlines() if line.startswith("ascent:eplb_expert_load_share{")]
    assert len(series) == HOT_EXPERTS and 'expert="15"' in text


def test_stat_logger_prints_one_line_per_rebalance(caplog) -> None:
    summary = _metrics_with_rebalance(moves=3, step=11).summary()
    lines = format_rebalance_log(summary)
    assert len(lines) == 1 and "step 11" in lines[0] and "3 slots moved" in lines[0]
    assert "imbalance mean 1.850 max 1.900 -> mean 1.550 max 1.900" in lines[0]
    with caplog.at_level(logging.INFO, logger="ascent.stats"):
        LoggingStatLogger(interval_s=1e9).record(SchedulerStats(eplb=summary), 0, 0)
        LoggingStatLogger(interval_s=1e9).record(SchedulerStats(), 0, 0)
    assert [r.getMessage() for r in caplog.records] == lines
