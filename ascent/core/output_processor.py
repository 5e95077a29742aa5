"""Front-end output processing: EngineCoreOutputs -> RequestOutputs.

Per request: incremental detokenization, stop strings, logprobs with decoded tokens, prompt logprobs, metrics
timestamps, n > 1 aggregation through ``ParentRequest``, and streaming according to ``SamplingParams.output_kind``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ascent.core.detokenizer import IncrementalDetokenizer, backend_tokenizer
from ascent.core.parallel_sampling import ParentRequest
from ascent.core.sched_output import EngineCoreOutput, LogprobsEntry
from ascent.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from ascent.sampling_params import SamplingParams

TokenText = Callable[[int], str]


def logprobs_to_dict(entry: LogprobsEntry, token_text: TokenText | None) -> dict[int, Logprob]:
    """One position's ``LogprobsEntry`` as vLLM's dict: sampled token first (its own rank), then top-k (ranks 1..k)."""
    ranks = [entry.rank, *range(1, len(entry.token_ids))]
    out: dict[int, Logprob] = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, ranks):
        if token_id not in out:
            text = token_text(token_id) if token_text is not None else None
            out[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=text)
    return out


class _TokenTextCache:
    """Decoded text of single token ids (special tokens shown), memoised."""

    def __init__(self, tokenizer: Any) -> None:
        backend = backend_tokenizer(tokenizer)
        if backend is not None:
            self._decode = lambda tid: backend.decode([tid], skip_special_tokens=False)
        else:
            self._decode = lambda tid: tokenizer.decode([tid])
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode(token_id) or ""
        return text


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token: float


@dataclass
class IterationStats:
    """What one ``process_outputs`` call observed (collected when ``log_stats``); times in seconds."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class OutputProcessorResult:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    iteration_stats: IterationStats | None = None


class RequestOutputCollector:
    """Single-slot mailbox between the output processor and one streaming consumer.

    ``put`` never blocks: an output not yet taken is merged with the next one (DELTA: concatenated; otherwise the
    newer completion replaces the older per index). Exceptions are delivered by ``get``/``get_nowait`` raising them.
    """

    def __init__(self, output_kind: int = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.output is None or isinstance(output, Exception):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        """Wait for the next (possibly merged) output."""
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output


class RequestState:
    """Front-end state of one (child) request."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        token_text: TokenText | None,
        arrival_time: float,
        parent: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_kind = params.output_kind
        self.detokenizer = detokenizer
        self.token_text = token_text
        self.parent = parent
        self.index = index
        self.queue = queue
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self._sent_tokens = 0
        self._sent_logprobs = 0
        self._sent_prompt_logprobs = 0

    @property
    def is_delta(self) -> bool:
        return self.output_kind == RequestOutputKind.DELTA

    def update(self, out: EngineCoreOutput) -> str | None:
        """Apply one core output: text, logprobs, prompt logprobs. Returns a matched stop string or None."""
        stop = self.detokenizer.update(out.new_token_ids, stop_terminated=out.finish_reason == "stop")
        if stop is not None or out.finished:
            self.detokenizer.finish()
        if self.logprobs is not None and out.new_logprobs:
            room = len(self.detokenizer.output_token_ids) - len(self.logprobs)  # tokens a stop string cut off
            for entry in out.new_logprobs[: max(room, 0)]:
                self.logprobs.append(logprobs_to_dict(entry, self.token_text))
                self.cumulative_logprob += entry.logprobs[0]
        if self.prompt_logprobs is not None and out.new_prompt_logprobs:
            self.prompt_logprobs.extend(logprobs_to_dict(e, self.token_text) for e in out.new_prompt_logprobs)
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = out.first_scheduled_time
        return stop

    def make_request_output(self, finish_reason: str | None, stop_reason: int | str | None) -> RequestOutput | None:
        """The RequestOutput to deliver now, or None (FINAL_ONLY before the end, or a parent still waiting)."""
        finished = finish_reason is not None
        if not finished and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        completion = self._completion(finish_reason, stop_reason)
        request_id, outputs = self.request_id, [completion]
        if self.parent is not None:
            request_id, outputs, finished = self.parent.get_outputs(self.request_id, completion)
            if not outputs:
                return None
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._take_prompt_logprobs(),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dataclasses.replace(self.metrics),
        )

    def _completion(self, finish_reason: str | None, stop_reason: int | str | None) -> CompletionOutput:
        token_ids = self.detokenizer.output_token_ids
        text = self.detokenizer.output_text(delta=self.is_delta)
        logprobs = self.logprobs
        if self.is_delta:
            token_ids, self._sent_tokens = token_ids[self._sent_tokens :], len(token_ids)
            if logprobs is not None:
                logprobs, self._sent_logprobs = logprobs[self._sent_logprobs :], len(logprobs)
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason if finish_reason is not None else None,
        )

    def _take_prompt_logprobs(self) -> PromptLogprobs | None:
        if self.prompt_logprobs is None:
            return None
        if not self.is_delta:
            return list(self.prompt_logprobs)
        start, self._sent_prompt_logprobs = self._sent_prompt_logprobs, len(self.prompt_logprobs)
        return self.prompt_logprobs[start:]


class OutputProcessor:
    """Turns core outputs into RequestOutputs; owns the front-end state of every unfinished request."""

    def __init__(self, tokenizer: Any | None, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text = _TokenTextCache(tokenizer) if tokenizer is not None else None

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        """Start tracking a (child) request. With ``parent``, ``request_id`` is the child id from ``get_child_info``."""
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use.")
        if parent is None and params.n != 1:
            raise ValueError(f"n={params.n} needs a ParentRequest fan-out; add each child with n=1.")
        if parent is not None and request_id != parent.child_request_id(index):
            raise ValueError(f"request id {request_id!r} is not child {index} of {parent.request_id!r}.")
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, prompt_token_ids)  # may raise: before any state
        if parent is not None:
            parent.child_requests.add(request_id)
            self.parent_requests[parent.request_id] = parent
        with_text = self.tokenizer is not None and params.detokenize
        self.request_states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detokenizer,
            token_text=self._token_text if with_text else None,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            parent=parent,
            index=index,
            queue=queue,
        )

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorResult:
        """Apply one engine step's outputs; outputs of requests with a queue go to the queue instead."""
        result = OutputProcessorResult([], [], IterationStats() if self.log_stats else None)
        now = time.time()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted by the front end meanwhile
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            stop_string = state.update(out)
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
            self._observe(state, out, finish_reason, now, result.iteration_stats)
            if out.new_token_ids or finish_reason is not None:
                self._deliver(state, state.make_request_output(finish_reason, stop_reason), result)
            if finish_reason is not None:
                self._remove(state)
                if not out.finished:
                    result.reqs_to_abort.append(out.request_id)
        return result

    def abort_requests(self, request_ids: list[str], finals: list[RequestOutput] | None = None) -> list[str]:
        """Stop tracking requests (parent ids expand to their unfinished children); returns the core ids to abort.

        Streaming consumers (requests with a queue) receive a final output with finish_reason "abort"; with
        ``finals`` the others' final outputs are appended to it (for a caller that routes outputs itself).
        """
        aborted: list[str] = []
        for request_id in request_ids:
            if request_id in self.request_states:
                targets = [request_id]
            elif request_id in self.parent_requests:
                parent = self.parent_requests[request_id]
                targets = sorted(c for c in parent.child_requests if c in self.request_states)
            else:
                continue
            for child_id in targets:
                state = self.request_states[child_id]
                state.detokenizer.finish()
                if state.queue is not None:
                    self._deliver(state, state.make_request_output("abort", None), None)
                elif finals is not None:
                    final = state.make_request_output("abort", None)
                    if final is not None:
                        finals.append(final)
                self._remove(state)
                aborted.append(child_id)
        return aborted

    def _deliver(
        self, state: RequestState, output: RequestOutput | None, result: OutputProcessorResult | None
    ) -> None:
        if output is None:
            return
        if state.queue is not None:
            state.queue.put(output)
        elif result is not None:
            result.request_outputs.append(output)

    def _remove(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        parent = state.parent
        if parent is not None:
            parent.child_requests.discard(state.request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)

    def _observe(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        finish_reason: str | None,
        now: float,
        stats: IterationStats | None,
    ) -> None:
        metrics = state.metrics
        if out.new_token_ids:
            if stats is not None:
                stats.num_generation_tokens += len(out.new_token_ids)
                if metrics.first_token_time is None:
                    stats.num_prompt_tokens += len(state.prompt_token_ids)
                    stats.time_to_first_tokens.append(now - metrics.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - metrics.last_token_time)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        if finish_reason is None:
            return
        metrics.finished_time = now
        if stats is not None:
            num_gen = len(state.detokenizer.output_token_ids)
            decode_time = (metrics.last_token_time or now) - (metrics.first_token_time or now)
            stats.finished_requests.append(
                FinishedRequestStats(
                    finish_reason=finish_reason,
                    e2e_latency=now - metrics.arrival_time,
                    num_prompt_tokens=len(state.prompt_token_ids),
                    num_generation_tokens=num_gen,
                    mean_time_per_output_token=decode_time / (num_gen - 1) if num_gen > 1 else 0.0,
                )
            )
