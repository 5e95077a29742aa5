"""Periodic stats log line (vLLM style): throughput, running/waiting, KV usage, prefix-cache hit rate."""

from __future__ import annotations

import logging
import time

from ascent.core.scheduler import SchedulerStats

logger = logging.getLogger("ascent.stats")


class LoggingStatLogger:
    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries = 0
        self._hits = 0
        self._preemptions = 0
        self._last: SchedulerStats | None = None

    def record(self, stats: SchedulerStats, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._prompt_tokens += num_prompt_tokens
        self._generation_tokens += num_generation_tokens
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        self._preemptions += stats.num_preemptions
        self._last = stats
        if stats.eplb:
            from ascent.eplb.engine_stats import format_rebalance_log

            for line in format_rebalance_log(stats.eplb):
                logger.info("%s", line)
        if time.monotonic() - self._last_log >= self.interval_s:
            self.log()

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log, 1e-9)
        s = self._last or SchedulerStats()
        hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, Preemptions: %d",
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, s.num_running_reqs,
            s.num_waiting_reqs, 100.0 * s.kv_cache_usage, hit_rate, self._preemptions)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._queries = self._hits = self._preemptions = 0
