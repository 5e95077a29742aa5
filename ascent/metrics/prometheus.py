"""Prometheus metrics of the engine with vLLM's metric suffixes under the ``ascent:`` prefix.

``EngineMetrics`` owns its collectors in a caller-supplied ``CollectorRegistry`` (never the global one), so several
engines or tests never collide. ``observe`` is the engine's stat observer: it runs in the engine thread after every
step (prometheus_client collectors are thread-safe) and never raises into the engine loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app

from ascent.core.output_processor import FinishedRequestStats, IterationStats
from ascent.core.scheduler import SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

PREFIX = "ascent:"
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """``[1, 2, 5, 10, 20, 50, ...]`` up to and including ``max_value`` (the token-count histogram buckets)."""
    if max_value < 1:
        raise ValueError(f"max_value={max_value!r} must be at least 1")
    buckets: list[int] = []
    base = 1
    while base <= max_value:
        buckets.extend(v for v in (base, 2 * base, 5 * base) if v <= max_value)
        base *= 10
    return buckets


class EngineMetrics:
    """The engine's collectors; every series carries ``model_name`` and ``engine`` labels.

    ``kv_cache_usage_fn`` (optional) makes ``ascent:kv_cache_usage_perc`` read the live value at scrape time instead
    of the value of the last engine step (which goes stale once the engine idles). ``num_speculative_tokens`` (k)
    pre-creates the per-position acceptance series ``position="0".."k-1"``; positions seen later are added on the fly.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 8192,
                 kv_cache_usage_fn: Callable[[], float] | None = None, engine_index: int = 0,
                 num_speculative_tokens: int = 0) -> None:
        self.registry = registry
        self.model_name = model_name
        self._labels = {"model_name": model_name, "engine": str(engine_index)}
        self._gauges()
        self._counters()
        self._spec_counters(num_speculative_tokens)
        self._histograms(max_model_len)
        self._kv_usage_fn = kv_cache_usage_fn
        self._last_kv_usage = 0.0
        if kv_cache_usage_fn is not None:
            self.kv_cache_usage.set_function(self._read_kv_usage)
        self._error_logged = False
        self._eplb: Any = None

    def _read_kv_usage(self) -> float:
        try:
            return float(self._kv_usage_fn())  # type: ignore[misc]
        except Exception:
            return self._last_kv_usage

    # ------------------------------------------------------------------------------------------------ collectors
    def _child(self, metric: Any) -> Any:
        return metric.labels(**self._labels)

    def _gauges(self) -> None:
        reg = self.registry
        self.num_requests_running = self._child(Gauge(
            PREFIX + "num_requests_running", "Number of requests in model execution batches.", LABELS, registry=reg))
        self.num_requests_waiting = self._child(Gauge(
            PREFIX + "num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=reg))
        self.kv_cache_usage = self._child(Gauge(
            PREFIX + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=reg))

    def _counters(self) -> None:
        reg = self.registry

        def counter(name: str, doc: str) -> Any:
            return self._child(Counter(PREFIX + name, doc, LABELS, registry=reg))

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=reg)
        self._request_success = success
        for reason in FINISHED_REASONS:
            success.labels(**self._labels, finished_reason=reason)

    def _spec_counters(self, num_speculative_tokens: int) -> None:
        reg = self.registry

        def counter(name: str, doc: str) -> Any:
            return self._child(Counter(PREFIX + name, doc, LABELS, registry=reg))

        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        self._spec_accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            (*LABELS, "position"), registry=reg)
        for pos in range(max(int(num_speculative_tokens), 0)):
            self._spec_accepted_per_pos.labels(**self._labels, position=str(pos))

    def _histograms(self, max_model_len: int) -> None:
        reg = self.registry

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return self._child(Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=reg))

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(int(max_model_len), 1))
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)

    # ------------------------------------------------------------------------------------------------ recording
    def observe(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Record one engine step; errors are logged once and swallowed so the engine loop never dies here."""
        try:
            if scheduler_stats is not None:
                self._record_scheduler(scheduler_stats)
            if iteration_stats is not None:
                self._record_iteration(iteration_stats)
        except Exception:
            if not self._error_logged:
                logger.exception("recording Prometheus metrics failed (further errors are not logged)")
                self._error_logged = True

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self._last_kv_usage = float(stats.kv_cache_usage)
        if self._kv_usage_fn is None:
            self.kv_cache_usage.set(stats.kv_cache_usage)
        _inc(self.prefix_cache_queries, stats.prefix_cache_queries)
        _inc(self.prefix_cache_hits, stats.prefix_cache_hits)
        _inc(self.num_preemptions, stats.num_preemptions)
        if stats.spec_decoding is not None:
            self._record_spec(stats.spec_decoding)
        if stats.eplb:
            self._record_eplb(stats.eplb)

    def _record_eplb(self, summary: dict) -> None:
        """EPLB series (``ascent.eplb.prometheus_export``), registered on the first EPLB summary."""
        if self._eplb is None:
            from ascent.eplb.prometheus_export import EplbPrometheus

            self._eplb = EplbPrometheus(self.registry, self._labels)
        self._eplb.record(summary)

    def _record_spec(self, spec: SpecDecodingStats) -> None:
        _inc(self.spec_decode_num_drafts, spec.num_drafts)
        _inc(self.spec_decode_num_draft_tokens, spec.num_draft_tokens)
        _inc(self.spec_decode_num_accepted_tokens, spec.num_accepted_tokens)
        for pos, accepted in enumerate(spec.accepted_per_pos):
            _inc(self._spec_accepted_per_pos.labels(**self._labels, position=str(pos)), accepted)

    def _record_iteration(self, stats: IterationStats) -> None:
        _inc(self.prompt_tokens, stats.num_prompt_tokens)
        _inc(self.generation_tokens, stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished_requests:
            self._record_finished(finished)

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        reason = str(finished.finish_reason or "stop")
        self._request_success.labels(**self._labels, finished_reason=reason).inc()
        self.e2e_request_latency.observe(finished.e2e_latency)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        if finished.num_generation_tokens > 1:
            self.time_per_output_token.observe(finished.mean_time_per_output_token)


def _inc(counter: Any, amount: float) -> None:
    if amount > 0:
        counter.inc(amount)


def make_metrics_app(engine: Any, model_name: str, registry: CollectorRegistry | None = None) -> Any:
    """Register an ``EngineMetrics`` observer on ``engine`` (an ``AsyncLLM``) and return the ``/metrics`` ASGI app.

    A fresh ``CollectorRegistry`` is used unless one is given. The returned app has an ``engine_metrics`` attribute.
    """
    registry = registry if registry is not None else CollectorRegistry()
    max_model_len = int(getattr(getattr(engine, "model_config", None), "max_model_len", 0) or 8192)
    usage_fn = getattr(engine, "kv_cache_usage", None)
    spec = getattr(getattr(engine, "engine_config", None), "speculative_config", None)
    metrics = EngineMetrics(registry, model_name, max_model_len=max_model_len,
                            kv_cache_usage_fn=usage_fn if callable(usage_fn) else None,
                            num_speculative_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0))
    engine.add_stat_observer(metrics.observe)
    app = make_asgi_app(registry)
    app.engine_metrics = metrics
    return app
