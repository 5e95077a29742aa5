"""LLMEngine: tokenize and validate -> engine core -> output processor (detokenize, stop strings, n > 1)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ascent.args import EngineArgs
from ascent.config import EngineConfig, ModelConfig
from ascent.core.engine_core import EngineCore
from ascent.core.scheduler import SchedulerStats
from ascent.core.output_processor import IterationStats, OutputProcessor
from ascent.core.parallel_sampling import ParentRequest
from ascent.metrics.loggers import LoggingStatLogger
from ascent.outputs import RequestOutput
from ascent.sampling_params import SamplingParams, truncate_prompt
from ascent.loader.model_info import get_eos_token_ids, get_generation_defaults
from ascent.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig, log_stats: bool | None = None) -> None:
        start = time.perf_counter()
        self.config = config
        mc = config.model_config
        self.tokenizer = get_tokenizer(mc.model, mc.tokenizer, mc.chat_template)
        mc.eos_token_ids = get_eos_token_ids(mc.model, self.tokenizer, generation_config=mc.generation_config)
        self.engine_core = EngineCore(config)
        self.log_stats = (not config.disable_log_stats) if log_stats is None else log_stats
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=self.log_stats)
        self.stat_logger = LoggingStatLogger() if self.log_stats and not config.disable_log_stats else None
        self.last_scheduler_stats: SchedulerStats | None = None
        self.last_iteration_stats: IterationStats | None = None
        self._request_counter = itertools.count()
        self._generation_defaults: dict[str, Any] | None = None
        self.timings = {"engine_init_s": time.perf_counter() - start, **self.engine_core.timings}

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_model_config(self) -> ModelConfig:
        return self.config.model_config

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generation_defaults(self) -> dict[str, Any]:
        """SamplingParams keywords from the model's ``generation_config.json`` (vLLM's default sampling params);
        read once, a fresh dict per call."""
        if self._generation_defaults is None:
            mc = self.config.model_config
            values = get_generation_defaults(mc.model, mc.generation_config, mc.override_generation_config)
            if "max_new_tokens" in values:
                values["max_tokens"] = values.pop("max_new_tokens")
            self._generation_defaults = values
        return dict(self._generation_defaults)

    # ------------------------------------------------------------------------------------------------ input
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, token ids). Accepts a string, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}``, or a list of token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt={prompt!r} must contain 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt={prompt!r} must be a string, a list of token ids or a dict.")

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        mc = self.config.model_config
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: at least one prompt token is required.")
        if n >= mc.max_model_len:
            raise ValueError(
                f"prompt length {n} is too long: it must be shorter than max_model_len={mc.max_model_len} "
                "to leave room for at least one output token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contain out-of-vocabulary ids {bad[:8]} (vocab size {mc.vocab_size}).")
        params.verify_vocab(mc.vocab_size)
        kv = self.engine_core.kv_cache_manager
        capacity = (kv.num_blocks - 1) * kv.block_size  # block 0 is the null block
        if n + 1 > capacity:
            raise ValueError(f"prompt length {n} does not fit the KV cache: it holds {capacity} tokens "
                             f"({kv.num_blocks - 1} blocks of {kv.block_size}); raise --kv-cache-memory-bytes.")
        for name, asked in (("sample logprobs", params.logprobs), ("prompt logprobs", params.prompt_logprobs)):
            num = mc.vocab_size if asked == -1 else asked
            if num is not None and mc.max_logprobs != -1 and num > mc.max_logprobs:
                raise ValueError(f"Requested {name} of {num}, which is greater than max allowed: {mc.max_logprobs} "
                                 "(engine argument max_logprobs).")
        policy = self.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled "
                             f"(scheduling_policy={policy!r}).")

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Validate and enqueue a request (fanned out to n children when ``params.n > 1``); returns its id."""
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        params = (params or SamplingParams()).clone()
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.config.model_config.max_model_len)
        self._validate(prompt_ids, params, priority)
        params.update_from_generation_config(self.config.model_config.eos_token_ids)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer, self.config.model_config.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.config.model_config.max_model_len - len(prompt_ids)
        arrival_time = time.time() if arrival_time is None else arrival_time
        parent = ParentRequest(request_id, params) if params.n > 1 else None
        self._check_ids_free(request_id, parent)
        if parent is None:
            self._add_core_request(request_id, prompt_text, prompt_ids, params, arrival_time, priority, None, 0)
            return request_id
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            self._add_core_request(child_id, prompt_text, prompt_ids, child_params, arrival_time, priority, parent,
                                   index)
        return request_id

    def _check_ids_free(self, request_id: str, parent: ParentRequest | None) -> None:
        """ValueError when the id, or a child id of the n > 1 fan-out, names a request in flight (checked before
        any child is added, so a rejected request leaves nothing behind)."""
        op = self.output_processor
        ids = [request_id] + ([parent.child_request_id(i) for i in range(parent.n)] if parent else [])
        clash = [i for i in ids if i in op.request_states or i in op.parent_requests]
        if clash:
            raise ValueError(f"request id(s) {clash} already in use (adding request_id={request_id!r}).")

    def _add_core_request(self, req_id, prompt_text, prompt_ids, params, arrival_time, priority, parent, index):
        self.output_processor.add_request(req_id, prompt_text, prompt_ids, params, arrival_time=arrival_time,
                                          parent=parent, index=index)
        request = self.engine_core.make_request(req_id, prompt_ids, params, arrival_time, priority)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (ids or n > 1 parent ids; unknown ids are ignored); returns their final outputs
        (finish_reason "abort"), which a step will not produce."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals: list[RequestOutput] = []
        core_ids = self.output_processor.abort_requests(request_ids, finals)
        self.engine_core.abort_requests(core_ids)
        return finals

    # ------------------------------------------------------------------------------------------------ loop
    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        result = self.output_processor.process_outputs(outputs)
        if result.reqs_to_abort:
            self.engine_core.abort_requests(result.reqs_to_abort)
        if self.log_stats:
            self.last_scheduler_stats = self.engine_core.make_stats()
            self.last_iteration_stats = result.iteration_stats
            if self.stat_logger is not None:
                it = result.iteration_stats
                self.stat_logger.record(self.last_scheduler_stats, it.num_prompt_tokens if it else 0,
                                        it.num_generation_tokens if it else 0)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
