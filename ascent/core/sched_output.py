"""The contracts between scheduler, model runner and output processor.

SchedulerOutput (scheduler -> runner), ModelRunnerOutput (runner -> scheduler), EngineCoreOutput (core -> front end).
All token ids are Python ints; block ids index the physical KV blocks (block 0 is the null block, never handed out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ascent.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption: runner state was dropped).

    ``prompt_token_ids + output_token_ids`` is every token known so far; ``num_computed_tokens`` of them are already
    in the KV cache (prefix-cache hit), and ``block_ids`` is the full block table.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_name: str | None = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds: newly appended block ids and the computed-token count before this step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_common_prefix_blocks: int = 0
    # blocks allocated since the previous step whose pages the worker must zero before the forward (§2.10)
    new_block_ids_to_zero: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsEntry:
    """Logprobs of one position: ``token_ids[0]`` is the sampled (or prompt) token, followed by the top-k tokens.

    ``logprobs`` aligns with ``token_ids``; ``rank`` is the 1-based rank of ``token_ids[0]`` in the distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: sampled ids (empty while a prefill chunk is still incomplete)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # prompt logprobs for the prompt positions computed this step (position i scores prompt token i+1)
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """What the core reports for one request after a step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[LogprobsEntry] | None = None
    new_prompt_logprobs: list[LogprobsEntry] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.time() when the request was first scheduled

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
