"""/metrics over the running server: Prometheus text that prometheus_client parses, counters moving with requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME, wait_until


def _scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") not in (None, MODEL_NAME):
                continue
            key = sample.name
            if "finished_reason" in sample.labels:
                key += "{" + sample.labels["finished_reason"] + "}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


def test_metrics_names_and_counters_move(server, client):
    before = _scrape(server.base_url)
    for name in ("ascent:num_requests_running", "ascent:num_requests_waiting", "ascent:kv_cache_usage_perc",
                 "ascent:prompt_tokens_total", "ascent:generation_tokens_total",
                 "ascent:time_to_first_token_seconds_count", "ascent:inter_token_latency_seconds_count",
                 "ascent:e2e_request_latency_seconds_count", "ascent:prefix_cache_queries_total",
                 "ascent:prefix_cache_hits_total", "ascent:num_preemptions_total"):
        assert name in before, name
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    for _ in range(3):  # the same prompt again: later ones hit the prefix cache
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})

    def moved() -> bool:
        after = _scrape(server.base_url)
        return after["ascent:e2e_request_latency_seconds_count"] >= before[
            "ascent:e2e_request_latency_seconds_count"] + 3

    assert wait_until(moved, timeout_s=30)
    after = _scrape(server.base_url)
    assert after["ascent:generation_tokens_total"] - before["ascent:generation_tokens_total"] >= 15
    assert after["ascent:prompt_tokens_total"] - before["ascent:prompt_tokens_total"] >= 3 * len(prompt)
    assert after["ascent:request_success_total{length}"] - before["ascent:request_success_total{length}"] >= 3
    assert after["ascent:time_to_first_token_seconds_count"] - before["ascent:time_to_first_token_seconds_count"] >= 3
    assert after["ascent:prefix_cache_queries_total"] > before["ascent:prefix_cache_queries_total"]
    assert after["ascent:prefix_cache_hits_total"] - before["ascent:prefix_cache_hits_total"] >= 16
    assert after["ascent:num_requests_running"] == 0
