"""Drive an executor directly (scheduler + KV cache manager + executor), the way the engine core does, so executor
tests do not depend on how the engine core is wired."""

from __future__ import annotations

from collections.abc import Callable

from ascent.args import EngineArgs
from ascent.config import EngineConfig
from ascent.core.kv_cache.hashing import make_block_hasher
from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request
from ascent.core.scheduler import Scheduler
from ascent.executor import Executor
from ascent.sampling_params import SamplingParams


def make_config(model: str, tensor_parallel_size: int = 1, **kwargs) -> EngineConfig:
    """An EngineConfig for ``model``; the TP size is set after validation (works before ParallelConfig allows it)."""
    args = dict(dtype="float32", max_model_len=256, disable_log_stats=True, max_num_seqs=8,
                kv_cache_memory_bytes=4 << 20)
    config = EngineArgs(model=model, **{**args, **kwargs}).create_engine_config()
    config.parallel_config.tensor_parallel_size = tensor_parallel_size
    return config


def greedy_generate(executor: Executor, config: EngineConfig, prompts: list[list[int]], max_tokens: int,
                    on_step: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy tokens for every prompt (``ignore_eos``); ``on_step(i)`` runs before step ``i``."""
    cc, mc = config.cache_config, config.model_config
    num_blocks = executor.determine_num_blocks()
    executor.initialize_kv_cache(num_blocks)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=cc.block_size, max_model_len=mc.max_model_len,
                        enable_caching=cc.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler_config, cc, mc.max_model_len, kv)
    hasher = make_block_hasher(cc.block_size) if cc.enable_prefix_caching else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, params, block_hasher=hasher))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while scheduler.has_unfinished_requests():
        if on_step is not None:
            on_step(step)
        scheduler_output = scheduler.schedule()
        runner_output = executor.execute_model(scheduler_output)
        for o in scheduler.update_from_output(scheduler_output, runner_output):
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return [out[str(i)] for i in range(len(prompts))]
