"""Request outputs with vLLM's names and shapes: RequestOutput, CompletionOutput, Logprob, RequestMetrics."""

from __future__ import annotations

from dataclasses import dataclass

from ascent.sampling_params import RequestOutputKind  # defined with SamplingParams (vLLM); re-exported here

__all__ = ["RequestOutputKind"]  # plus the classes below


@dataclass
class Logprob:
    """Log probability of one token; ``rank`` is 1-based in the sampling distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (sampled token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing scores the first prompt token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()`` seconds) the front end observes for one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` in ``[0, n)``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: None = None  # vLLM's field; LoRA adapters are not served by this build

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request: the prompt and its completions (one per ``index``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # vLLM's positional order from here on
    lora_request: None = None
    encoder_prompt: str | None = None  # decoder-only models: always None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None
    kv_transfer_params: dict | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        ``aggregate=True`` (DELTA) concatenates text, token ids and logprobs per completion index; otherwise the
        later completion replaces the earlier one with the same index. Completions with new indices are appended.
        """
        self.finished |= next_output.finished
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        if self.prompt_logprobs is None or not aggregate:
            self.prompt_logprobs = next_output.prompt_logprobs or self.prompt_logprobs
        for nxt in next_output.outputs:
            pos = next((i for i, c in enumerate(self.outputs) if c.index == nxt.index), None)
            if pos is None:
                self.outputs.append(nxt)
            elif aggregate:
                _extend_completion(self.outputs[pos], nxt)
            else:
                self.outputs[pos] = nxt


def _extend_completion(cur: CompletionOutput, nxt: CompletionOutput) -> None:
    cur.text += nxt.text
    cur.token_ids = cur.token_ids + nxt.token_ids
    if nxt.logprobs:
        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
    cur.cumulative_logprob = nxt.cumulative_logprob
    cur.finish_reason = nxt.finish_reason
    cur.stop_reason = nxt.stop_reason
