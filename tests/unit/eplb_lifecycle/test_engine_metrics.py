"""EPLB metrics end to end: a tiny Qwen3-MoE served by LLMEngine with EP=2 (two worker processes, gloo) and the
swift policy rebalancing every few steps; the Prometheus registry of the engine's metrics then holds the EPLB series
with the values ``Worker.eplb_stats()`` reports, and the stat logger printed the rebalance lines."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from ascent.args import EngineArgs
from ascent.core.llm_engine import LLMEngine
from ascent.metrics.prometheus import EngineMetrics
from ascent.sampling_params import SamplingParams
from tests.fixtures.tiny_moe import build_moe_model

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [300, 301, 2, 9], [77] * 6]
LABELS = {"model_name": "tiny-moe", "engine": "0"}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_moe_model(tmp_path_factory.mktemp("tiny_moe_eplb_metrics"), seed=3))


def _serve(moe_dir: str, registry: CollectorRegistry) -> dict:
    eplb = {"enable": True, "policy": "swift", "window_size": 4, "step_interval": 3, "plan_delay_steps": 1}
    args = EngineArgs(model=moe_dir, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
                      eplb_config=eplb, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
    engine = LLMEngine(args.create_engine_config(), log_stats=True)
    try:
        metrics = EngineMetrics(registry, "tiny-moe")
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
            metrics.observe(engine.last_scheduler_stats, engine.last_iteration_stats)
        engine.engine_core.eplb_stats.poll()  # worker processes are polled every few steps: collect the rest
        final = engine.engine_core.make_stats()
        metrics.observe(final, None)
        engine.stat_logger.record(final, 0, 0)
        return engine.engine_core.executor.collective_rpc("eplb_stats")[0]
    finally:
        engine.shutdown()


def test_prometheus_and_log_carry_the_worker_eplb_stats(moe_dir: str, caplog) -> None:
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="ascent.stats"):
        stats = _serve(moe_dir, registry)
    value = registry.get_sample_value
    assert stats["enabled"] and stats["rebalances"] >= 1 and stats["moves_total"] > 0
    assert value("ascent:eplb_enabled", LABELS) == 1
    assert value("ascent:eplb_rebalances_total", LABELS) == stats["rebalances"]
    assert value("ascent:eplb_moved_slots_total", LABELS) == stats["moves_total"]
    assert value("ascent:eplb_moved_bytes_total", LABELS) == stats["bytes_total"]
    assert value("ascent:eplb_rebalance_stall_seconds_count", LABELS) == stats["rebalances"]
    assert value("ascent:eplb_rebalance_stall_seconds_sum", LABELS) == pytest.approx(stats["stall_s_total"])
    assert len(stats["imbalance"]) == 2
    for layer, imb in enumerate(stats["imbalance"]):
        assert value("ascent:eplb_imbalance", {**LABELS, "layer": str(layer)}) == pytest.approx(imb)
    for layer, experts in enumerate(stats["hot_experts"]):
        for expert, share in experts:
            labels = {**LABELS, "layer": str(layer), "expert": str(expert)}
            assert value("ascent:eplb_expert_load_share", labels) == pytest.approx(share)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("EPLB rebalance at step")]
    assert len(lines) == stats["rebalances"]
    assert f"{stats['last']['moves']} slots moved" in lines[-1]
