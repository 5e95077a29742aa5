"""Token-budget continuous-batching scheduler (vLLM v1 semantics).

There is no prefill or decode phase: every request tries to bring ``num_computed_tokens`` up to
``num_tokens_with_spec`` within the step's token budget, which unifies chunked prefill, decode and speculation.
Running requests are served first (in admission order); when KV blocks run out the policy's victim is preempted
(recompute: blocks freed, state reset, request put back at the front of the waiting queue). Waiting requests are
admitted only when nothing was preempted in the step.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ascent.config import CacheConfig, SchedulerConfig
from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request, RequestStatus, check_stop
from ascent.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # since the previous stats call
    spec_decoding: "SpecDecodingStats | None" = None  # since the previous stats call (None without speculation)
    eplb: "dict | None" = None  # new EPLB summary since the previous stats call (ascent.eplb.engine_stats)


@dataclass
class SpecDecodingStats:
    """Draft verification counts: acceptance rate = accepted / draft tokens; mean acceptance length =
    1 + accepted / drafts; ``accepted_per_pos[i]`` counts drafts whose position i was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class WaitingQueue:
    """FCFS deque or priority heap keyed by (priority, arrival_time); ``prepend`` puts preempted requests first."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._deque.append(request)

    def prepend(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._deque.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0] if self.policy == "priority" else self._deque[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap) if self.policy == "priority" else self._deque.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            self._deque.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._deque)

    def __iter__(self):
        return iter(sorted(self._heap) if self.policy == "priority" else self._deque)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        kv_cache_manager: KVCacheManager,
        num_lookahead_tokens: int = 0,
        zero_new_blocks: bool = False,
    ) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.max_num_scheduled_tokens = int(scheduler_config.max_num_batched_tokens or 2048)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.zero_new_blocks = zero_new_blocks
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._num_preemptions = 0
        self.num_preemptions_total = 0
        self._capped: list[Request] = []
        self._spec_stats = SpecDecodingStats()
        self.spec_stats_total = SpecDecodingStats()  # cumulative, for benchmarks and tests

    # ------------------------------------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], finished_status: RequestStatus) -> None:
        """Finish (abort) requests from outside the step loop; frees their blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    # ------------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_scheduled_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []

        req_index = 0
        while req_index < len(self.running) and budget > 0:
            request = self.running[req_index]
            n = self._num_new_tokens(request, request.num_tokens_with_spec, budget)
            if n == 0:
                req_index += 1
                continue
            while True:
                blocks = self.kv_cache_manager.allocate_slots(
                    request, n, num_lookahead_tokens=self.num_lookahead_tokens)
                if blocks is not None:
                    break
                if len(self.running) == 1:
                    # Alone and still out of blocks: the KV cache can never hold this request. Cap it.
                    self._cap_at_kv_capacity(request)
                    break
                victim = self._pick_victim()
                if victim in scheduled_running:  # (the priority policy can pick a request already scheduled)
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                    self.kv_cache_manager.uncache_uncomputed(victim)
                if self.running.index(victim) < req_index:
                    req_index -= 1  # the requests after it move up one place
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                if request.is_finished():
                    continue
                break
            scheduled_running.append(request)
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = [b.block_id for b in blocks]
            budget -= n
            num_spec = n + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
            req_index += 1

        scheduled_new: list[Request] = []
        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, scheduled_new)

        assert sum(num_scheduled.values()) <= self.max_num_scheduled_tokens and budget >= 0
        assert len(self.running) <= self.config.max_num_seqs
        output = SchedulerOutput(
            scheduled_new_reqs=[self._new_request_data(r) for r in scheduled_new],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in scheduled_running],
                new_block_ids=[new_blocks[r.request_id] for r in scheduled_running],
                num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            new_block_ids_to_zero=self.kv_cache_manager.take_new_block_ids() if self.zero_new_blocks else [],
        )
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        self.finished_req_ids = set()
        return output

    def _num_new_tokens(self, request: Request, target: int, budget: int) -> int:
        n = target - request.num_computed_tokens
        if 0 < self.config.long_prefill_token_threshold < n:
            n = self.config.long_prefill_token_threshold
        n = min(n, budget, self.max_model_len - 1 - request.num_computed_tokens)
        return max(n, 0)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int], scheduled_new: list[Request]) -> int:
        while len(self.waiting) > 0 and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit = [], 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if 0 < self.config.long_prefill_token_threshold < n:
                n = self.config.long_prefill_token_threshold
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            blocks = self.kv_cache_manager.allocate_slots(
                request, n, num_new_computed_tokens=num_hit, new_computed_blocks=hit_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens)
            if blocks is None:
                if self.running or scheduled_new:
                    break  # blocks come back as running requests finish
                # nothing else holds a block and it still does not fit: it never will (else it would wait forever)
                self.waiting.pop()
                self._cap_at_kv_capacity(request)
                continue
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.time()
            scheduled_new.append(request)
            num_scheduled[request.request_id] = n
            budget -= n
        return budget

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(request)

    def _cap_at_kv_capacity(self, request: Request) -> None:
        logger.warning("request %s needs more KV blocks than the cache holds (%d tokens); finishing it as 'length'.",
                       request.request_id, request.num_tokens)
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._capped.append(request)
        self._free_request(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_name=request.lora_name,
        )

    # ------------------------------------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, roll back rejected drafts, apply stop checks, free finished requests."""
        outputs = [EngineCoreOutput(r.request_id, [], finish_reason="length") for r in self._capped]
        self._capped = []
        index = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id not in index:
                continue
            sampled = runner_output.sampled_token_ids[index[req_id]]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                self._spec_stats.observe(len(drafts), len(sampled) - 1)
                self.spec_stats_total.observe(len(drafts), len(sampled) - 1)
            new_tokens: list[int] = []
            stopped = False
            for token in sampled:
                request.append_output_token_ids(token)
                new_tokens.append(token)
                if check_stop(request, self.max_model_len):
                    stopped = True
                    break
            if req_id in runner_output.spec_token_ids and not stopped:
                request.spec_token_ids = list(runner_output.spec_token_ids[req_id])
            logprobs = runner_output.logprobs.get(req_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if new_tokens or prompt_logprobs or stopped:
                outputs.append(EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_tokens,
                    finish_reason=request.get_finished_reason() if stopped else None,
                    stop_reason=request.stop_reason,
                    new_logprobs=logprobs[: len(new_tokens)] if logprobs else None,
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=request.first_scheduled_time,
                ))
            if stopped:
                self.running.remove(request)
                self._free_request(request)
        return outputs

    # ------------------------------------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries if prefix else 0,
            prefix_cache_hits=prefix.hits if prefix else 0,
            num_preemptions=self._num_preemptions,
            spec_decoding=self._spec_stats if self._spec_stats.num_drafts else None,
        )
        self._num_preemptions = 0
        self._spec_stats = SpecDecodingStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    @staticmethod
    def now() -> float:
        return time.monotonic()
