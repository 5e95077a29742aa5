"""Worker: device setup, model loading, and sizing the KV cache from the memory budget."""

from __future__ import annotations

import logging
import time

import torch

from ascent.config import DEFAULT_KV_CACHE_FRACTION, EngineConfig, available_memory_bytes
from ascent.core.sched_output import ModelRunnerOutput, SchedulerOutput
from ascent.loader.gguf import release_gguf_readers
from ascent.platform.cpu_allocator import keep_freed_buffers
from ascent.platform.huge_pages import advise_engine_memory, module_tensors
from ascent.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device_config.num_threads is not None:
            torch.set_num_threads(config.device_config.num_threads)
        if config.device_config.device.type == "cpu":
            keep_freed_buffers()
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config)
        self.timings: dict[str, float] = {}
        self.huge_pages = "not applied"  # how the weights and the KV cache use huge pages (set with the KV cache)
        self.eplb_updator = None

    def load_model(self) -> None:
        start = time.perf_counter()
        self.model_runner.load_model()
        release_gguf_readers()  # the tokenizer and config were read before the worker loads the weights
        self.timings["load_weights_s"] = time.perf_counter() - start
        eplb_config = getattr(self.config, "eplb_config", None)
        if eplb_config is not None and eplb_config.enable:
            from ascent.distributed.parallel_state import get_ep_group
            from ascent.eplb.updator import EplbUpdator

            self.eplb_updator = EplbUpdator(eplb_config, self.model_runner.model, get_ep_group())

    def determine_num_blocks(self) -> int:
        """KV blocks from ``--kv-cache-memory-bytes`` (default: a fraction of available memory), capped at what
        ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use. Block 0 is the null block."""
        cc, mc, sc = self.config.cache_config, self.config.model_config, self.config.scheduler_config
        per_block = self.model_runner.kv_cache_bytes_per_block()
        blocks_per_seq = -(-mc.max_model_len // cc.block_size)
        useful = sc.max_num_seqs * blocks_per_seq + 1
        if cc.num_gpu_blocks_override is not None:  # a test knob: not refused (vLLM), but said at start-up
            if cc.num_gpu_blocks_override - 1 < blocks_per_seq:
                logger.warning("num_gpu_blocks_override=%d holds %d tokens, fewer than max_model_len=%d: a longer "
                               "request finishes with 'length' when it outgrows the cache",
                               cc.num_gpu_blocks_override, (cc.num_gpu_blocks_override - 1) * cc.block_size,
                               mc.max_model_len)
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
            num_blocks = budget // per_block
        else:
            budget = int(available_memory_bytes(self.config.device_config.device) * DEFAULT_KV_CACHE_FRACTION)
            if self.config.device_config.device.type == "cpu":
                budget //= self.config.parallel_config.world_size  # CPU ranks share one machine's RAM
            num_blocks = min(budget // per_block, useful)
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds fewer than 2 KV blocks of {per_block} bytes "
                f"(block_size={cc.block_size}); raise it.")
        if num_blocks - 1 < blocks_per_seq:  # vLLM's check_enough_kv_cache_memory (an override is not checked)
            raise ValueError(
                f"a KV cache of {budget} bytes holds {(num_blocks - 1) * cc.block_size} tokens, fewer than one "
                f"request of max_model_len={mc.max_model_len}: raise kv_cache_memory_bytes to at least "
                f"{(blocks_per_seq + 1) * per_block} or lower max_model_len to at most "
                f"{(num_blocks - 1) * cc.block_size}.")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        self.model_runner.initialize_kv_cache(num_blocks)
        self.timings["kv_alloc_s"] = time.perf_counter() - start
        if self.config.device_config.device.type == "cpu":
            self.huge_pages = advise_engine_memory(module_tensors(self.model_runner.model), self.model_runner.kv_caches)
            logger.info("huge pages: %s", self.huge_pages)
        mc, cc = self.config.model_config, self.config.cache_config
        tokens = (num_blocks - 1) * cc.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, memory %s; %.2f s); max concurrency at "
            "max_model_len=%d: %.2fx", num_blocks, cc.block_size, tokens,
            num_blocks * self.model_runner.kv_cache_bytes_per_block() / 2**20, self.model_runner.kv_commit,
            self.timings["kv_alloc_s"], mc.max_model_len, tokens / mc.max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.model_runner.execute_model(scheduler_output)
        if self.eplb_updator is not None:
            self.eplb_updator.after_forward()
        return output

    def eplb_stats(self) -> dict | None:
        """EPLB metrics of this rank (None when EPLB is off)."""
        return self.eplb_updator.stats() if self.eplb_updator is not None else None

    def eplb_summary(self, since_version: int = -1, since_rebalances: int = 0) -> dict | None:
        """Compact EPLB metrics for the engine's stat loggers; None when EPLB is off or nothing changed since
        ``since_version`` (see ``ascent.eplb.stats.EplbMetrics.summary``)."""
        if self.eplb_updator is None:
            return None
        return self.eplb_updator.summary(since_version, since_rebalances)
