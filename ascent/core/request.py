"""Request state owned by the scheduler."""

from __future__ import annotations

import enum
import time
from typing import Callable

from ascent.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    """One sequence being generated.

    Invariants: ``all_token_ids == prompt_token_ids + output_token_ids``; ``num_computed_tokens`` counts tokens whose
    KV is in the cache or scheduled to be written this step; ``block_hashes`` holds the chained hashes of every *full*
    block of ``all_token_ids`` (grown by ``block_hasher`` whenever tokens are appended).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: Callable[["Request"], list[bytes]] | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1 = not yet scheduled)
        self.first_scheduled_time: float | None = None  # time.time() at first admission (RequestMetrics)
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.max_tokens = sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 30
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    # --- token bookkeeping -------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # --- status ------------------------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    @property
    def use_structured_output(self) -> bool:
        return False

    def __lt__(self, other: "Request") -> bool:
        """Priority-queue order: (priority, arrival_time, request_id)."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_stop(request: Request, max_model_len: int) -> bool:
    """Apply vLLM's stop checks after a token was appended; sets status/stop_reason. Returns True if stopped. A
    request that fills max_model_len stops there even below its min_tokens (nothing could be scheduled for it)."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        if request.num_tokens < max_model_len:
            return False
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    last = request.output_token_ids[-1]
    if last in params._eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
