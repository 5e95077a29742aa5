"""EngineMetrics: drive ``observe`` with hand-made stats, render with ``generate_latest`` and parse the text with
prometheus_client's own parser; names, types, labels, counter movement and histogram buckets are checked."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ascent.core.output_processor import FinishedRequestStats, IterationStats
from ascent.core.scheduler import SchedulerStats, SpecDecodingStats
from ascent.metrics.prometheus import EngineMetrics, build_1_2_5_buckets, make_metrics_app

MODEL = "tiny-model"
LABELS = {"model_name": MODEL, "engine": "0"}
EXPECTED_TYPES = {
    "ascent:num_requests_running": "gauge", "ascent:num_requests_waiting": "gauge",
    "ascent:kv_cache_usage_perc": "gauge", "ascent:prompt_tokens": "counter",
    "ascent:generation_tokens": "counter", "ascent:prefix_cache_queries": "counter",
    "ascent:prefix_cache_hits": "counter", "ascent:num_preemptions": "counter",
    "ascent:request_success": "counter", "ascent:time_to_first_token_seconds": "histogram",
    "ascent:inter_token_latency_seconds": "histogram", "ascent:e2e_request_latency_seconds": "histogram",
    "ascent:request_time_per_output_token_seconds": "histogram",
}


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **extra}.items())))]


def _step(running: int = 1, waiting: int = 0, usage: float = 0.25, queries: int = 0, hits: int = 0,
          preemptions: int = 0) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=usage,
                          prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions)


def _finished(reason: str = "length", e2e: float = 0.7, gen: int = 4, tpot: float = 0.05) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency=e2e, num_prompt_tokens=12,
                                num_generation_tokens=gen, mean_time_per_output_token=tpot)


@pytest.fixture()
def metrics() -> EngineMetrics:
    return EngineMetrics(CollectorRegistry(), MODEL)


def test_families_names_types_and_labels(metrics: EngineMetrics) -> None:
    metrics.observe(_step(), IterationStats(num_prompt_tokens=3, time_to_first_tokens=[0.02]))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    for name, kind in EXPECTED_TYPES.items():
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == MODEL for s in families[name].samples)
    names = {s.name for f in families.values() for s in f.samples}
    assert {"ascent:prompt_tokens_total", "ascent:generation_tokens_total", "ascent:num_preemptions_total",
            "ascent:prefix_cache_queries_total", "ascent:prefix_cache_hits_total"} <= names
    reasons = {s.labels["finished_reason"] for s in families["ascent:request_success"].samples
               if s.name == "ascent:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}


def test_gauges_follow_the_latest_step(metrics: EngineMetrics) -> None:
    metrics.observe(_step(running=3, waiting=2, usage=0.5), None)
    s = _samples(metrics.registry)
    assert _value(s, "ascent:num_requests_running") == 3
    assert _value(s, "ascent:num_requests_waiting") == 2
    assert _value(s, "ascent:kv_cache_usage_perc") == 0.5
    metrics.observe(_step(running=0, waiting=0, usage=0.0), None)
    s = _samples(metrics.registry)
    assert _value(s, "ascent:num_requests_running") == 0
    assert _value(s, "ascent:kv_cache_usage_perc") == 0.0


def test_counters_accumulate_deltas(metrics: EngineMetrics) -> None:
    metrics.observe(_step(queries=32, hits=16, preemptions=1),
                    IterationStats(num_prompt_tokens=20, num_generation_tokens=2))
    metrics.observe(_step(queries=16, hits=16), IterationStats(num_prompt_tokens=5, num_generation_tokens=3))
    s = _samples(metrics.registry)
    assert _value(s, "ascent:prompt_tokens_total") == 25
    assert _value(s, "ascent:generation_tokens_total") == 5
    assert _value(s, "ascent:prefix_cache_queries_total") == 48
    assert _value(s, "ascent:prefix_cache_hits_total") == 32
    assert _value(s, "ascent:num_preemptions_total") == 1


def test_histograms_and_finished_requests(metrics: EngineMetrics) -> None:
    stats = IterationStats(num_generation_tokens=2, time_to_first_tokens=[0.003, 0.3],
                           inter_token_latencies=[0.02, 0.02, 0.2],
                           finished_requests=[_finished("length", e2e=0.7), _finished("stop", e2e=3.0, gen=1)])
    metrics.observe(_step(), stats)
    s = _samples(metrics.registry)
    ttft = "ascent:time_to_first_token_seconds"
    assert _value(s, ttft + "_count") == 2
    assert _value(s, ttft + "_sum") == pytest.approx(0.303)
    assert _value(s, ttft + "_bucket", le="0.005") == 1
    assert _value(s, ttft + "_bucket", le="0.5") == 2
    itl = "ascent:inter_token_latency_seconds"
    assert _value(s, itl + "_bucket", le="0.025") == 2 and _value(s, itl + "_count") == 3
    e2e = "ascent:e2e_request_latency_seconds"
    assert _value(s, e2e + "_bucket", le="0.8") == 1 and _value(s, e2e + "_count") == 2
    assert _value(s, "ascent:request_time_per_output_token_seconds_count") == 1  # 1-token requests have no TPOT
    assert _value(s, "ascent:request_success_total", finished_reason="length") == 1
    assert _value(s, "ascent:request_success_total", finished_reason="stop") == 1
    assert _value(s, "ascent:request_success_total", finished_reason="abort") == 0
    assert _value(s, "ascent:request_prompt_tokens_count") == 2


def test_counters_are_monotonic_over_many_steps(metrics: EngineMetrics) -> None:
    previous = 0.0
    for step in range(5):
        metrics.observe(_step(), IterationStats(num_generation_tokens=step % 3,
                                                finished_requests=[_finished()] if step % 2 else []))
        current = _value(_samples(metrics.registry), "ascent:generation_tokens_total")
        assert current >= previous
        previous = current
    assert previous == 0 + 1 + 2 + 0 + 1
    assert _value(_samples(metrics.registry), "ascent:request_success_total", finished_reason="length") == 2


def test_observe_never_raises_into_the_engine(metrics: EngineMetrics) -> None:
    bad = IterationStats(time_to_first_tokens=["not-a-number"])  # type: ignore[list-item]
    metrics.observe(_step(running=4), bad)
    metrics.observe(None, None)
    assert _value(_samples(metrics.registry), "ascent:num_requests_running") == 4


def test_live_kv_usage_function() -> None:
    usage = {"value": 0.125}
    metrics = EngineMetrics(CollectorRegistry(), MODEL, kv_cache_usage_fn=lambda: usage["value"])
    metrics.observe(_step(usage=0.9), None)
    assert _value(_samples(metrics.registry), "ascent:kv_cache_usage_perc") == 0.125
    usage["value"] = 0.75
    assert _value(_samples(metrics.registry), "ascent:kv_cache_usage_perc") == 0.75


def _spec(drafts: list[tuple[int, int]]) -> SpecDecodingStats:
    stats = SpecDecodingStats()
    for num_draft_tokens, num_accepted in drafts:
        stats.observe(num_draft_tokens, num_accepted)
    return stats


def test_spec_decode_counters() -> None:
    metrics = EngineMetrics(CollectorRegistry(), MODEL, num_speculative_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    for name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"):
        assert families[f"ascent:spec_decode_num_{name}"].type == "counter"
    per_pos = "ascent:spec_decode_num_accepted_tokens_per_pos_total"
    s = _samples(metrics.registry)
    assert [_value(s, per_pos, position=str(p)) for p in range(3)] == [0, 0, 0]
    metrics.observe(_step(), None)  # spec_decoding None: speculation off, nothing moves
    step1 = SchedulerStats(spec_decoding=_spec([(3, 3), (3, 1), (2, 0)]))
    step2 = SchedulerStats(spec_decoding=_spec([(3, 2), (4, 4)]))
    metrics.observe(step1, None)
    metrics.observe(step2, None)
    s = _samples(metrics.registry)
    assert _value(s, "ascent:spec_decode_num_drafts_total") == 5
    assert _value(s, "ascent:spec_decode_num_draft_tokens_total") == 3 + 3 + 2 + 3 + 4
    assert _value(s, "ascent:spec_decode_num_accepted_tokens_total") == 3 + 1 + 0 + 2 + 4
    counts = [_value(s, per_pos, position=str(p)) for p in range(4)]
    assert counts == [4, 3, 2, 1]  # position 3 appeared in step 2 (a longer draft)
    assert sum(counts) == _value(s, "ascent:spec_decode_num_accepted_tokens_total")


def test_make_metrics_app_precreates_spec_positions() -> None:
    engine = _FakeEngine()
    engine.engine_config = _FakeEngineConfig()
    app = make_metrics_app(engine, MODEL)
    s = _samples(app.engine_metrics.registry)
    per_pos = "ascent:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_value(s, per_pos, position=str(p)) for p in range(2)] == [0, 0]
    assert (per_pos, tuple(sorted({**LABELS, "position": "2"}.items()))) not in s
    assert _value(s, "ascent:spec_decode_num_drafts_total") == 0


def test_build_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(30) == [1, 2, 5, 10, 20]
    with pytest.raises(ValueError):
        build_1_2_5_buckets(0)


class _FakeModelConfig:
    max_model_len = 64


class _FakeSpecConfig:
    num_speculative_tokens = 2


class _FakeEngineConfig:
    speculative_config = _FakeSpecConfig()


class _FakeEngine:
    model_config = _FakeModelConfig()

    def __init__(self) -> None:
        self.observers: list = []

    def add_stat_observer(self, fn) -> None:
        self.observers.append(fn)

    def kv_cache_usage(self) -> float:
        return 0.5


async def _get_metrics(app) -> tuple[int, str]:
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        resp = await client.get("/")
    return resp.status_code, resp.text


def test_make_metrics_app_registers_observer_and_serves_text() -> None:
    engine = _FakeEngine()
    app = make_metrics_app(engine, MODEL)
    assert engine.observers == [app.engine_metrics.observe]
    engine.observers[0](_step(running=2), IterationStats(num_prompt_tokens=7, finished_requests=[_finished()]))
    status, text = asyncio.run(_get_metrics(app))
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["ascent:num_requests_running"].samples[0]
    assert running.value == 2 and running.labels["model_name"] == MODEL
    assert families["ascent:kv_cache_usage_perc"].samples[0].value == 0.5
    prompt = [s for s in families["ascent:prompt_tokens"].samples if s.name == "ascent:prompt_tokens_total"]
    assert prompt[0].value == 7
