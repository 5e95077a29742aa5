"""Engine core: owns the scheduler, the KV cache manager and the worker; one ``step()`` = schedule, execute, update."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ascent.config import EngineConfig
from ascent.core.kv_cache.hashing import make_block_hasher
from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request, RequestStatus
from ascent.core.scheduler import Scheduler, SchedulerStats
from ascent.core.sched_output import EngineCoreOutput
from ascent.platform.device_config import check_platform, describe, set_current_profile
from ascent.platform.profile import HardwareCapability
from ascent.executor.base import Executor
from ascent.worker.worker import Worker

if TYPE_CHECKING:
    from ascent.eplb.engine_stats import EplbStatsCollector

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        cc, mc = config.cache_config, config.model_config
        profile = config.device_config.profile
        check_platform(profile, config.device_config.device, mc.torch_dtype)
        set_current_profile(profile)  # read by layer/backend selection while the model is built
        logger.info("%s", describe(profile, config.device_config.device, mc.torch_dtype))
        self.executor = Executor.create(config)  # world size 1: in-process worker; TP > 1: worker processes
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_blocks,
            block_size=cc.block_size,
            max_model_len=mc.max_model_len,
            enable_caching=cc.enable_prefix_caching,
        )
        self.block_hasher = make_block_hasher(cc.block_size) if cc.enable_prefix_caching else None
        self.scheduler = Scheduler(config.scheduler_config, cc, mc.max_model_len, self.kv_cache_manager,
                                   zero_new_blocks=profile.supports(HardwareCapability.COMPATIBILITY_OP_IMPLEMENTATIONS))
        self.timings = dict(self.executor.timings)
        self.eplb_stats = self._make_eplb_collector(config)

    def _make_eplb_collector(self, config: EngineConfig) -> "EplbStatsCollector | None":
        """Poller of the workers' EPLB summaries (None when EPLB is off)."""
        eplb = getattr(config, "eplb_config", None)
        if eplb is None or not eplb.enable:
            return None
        from ascent.eplb.engine_stats import MULTIPROC_POLL_STEPS, EplbStatsCollector

        in_process = getattr(self.executor, "driver_worker", None) is not None
        return EplbStatsCollector(self.executor.collective_rpc, 1 if in_process else MULTIPROC_POLL_STEPS)

    @property
    def worker(self) -> Worker:
        """The in-process worker (world size 1 only; with worker processes there is none to inspect)."""
        driver = getattr(self.executor, "driver_worker", None)
        if driver is None:
            raise AttributeError("engine runs its workers in separate processes; use executor.collective_rpc")
        return driver

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    def make_request(self, request_id: str, prompt_token_ids: list[int], params, arrival_time: float | None = None,
                     priority: int = 0) -> Request:
        return Request(request_id, prompt_token_ids, params, arrival_time=arrival_time, priority=priority,
                       block_hasher=self.block_hasher)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        if self.eplb_stats is not None:
            self.eplb_stats.after_step()
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if self.eplb_stats is not None:
            stats.eplb = self.eplb_stats.take()
        return stats

    def shutdown(self) -> None:
        self.executor.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    @staticmethod
    def now() -> float:
        return time.monotonic()
