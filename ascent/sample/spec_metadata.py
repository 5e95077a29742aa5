"""Speculative-decoding batch layout for the rejection sampler, and the per-position sampling metadata.

Layout (specdec spec §2.1): request ``i`` has ``k_i >= 0`` draft tokens ``d_i1..d_ik``; the target model scored
``k_i + 1`` consecutive logits rows for it, requests in batch order. Row ``j`` (0-based) of request ``i`` is the
target distribution after the request's history plus ``d_i1..d_ij``: rows ``0..k_i-1`` verify the drafts, row ``k_i``
is the bonus position. Draft ids may be ``-1`` (placeholder padding): such a draft is always rejected.

Every target row is processed exactly like a plain sampler row (specdec spec §2.2): the request's sampling settings
are repeated per position, and position ``j`` sees the output history ``output_i + drafts_i[:j]`` (penalties,
min_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ascent.sample.metadata import SamplingMetadata

PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SpecDecodeMetadata:
    """Drafts of one verification step.

    draft_token_ids: per request, its ``k_i >= 0`` draft ids (``-1`` = placeholder, always rejected);
    min_tokens: per request, ``SamplingParams.min_tokens`` -- needed only when some request is still below its
    min_tokens and has drafts (position ``j`` masks the stop ids iff ``len(output) + j < min_tokens``); None otherwise.

    Derived (host numpy int64): ``num_draft_tokens [B]``, ``cu_num_draft_tokens [B]`` (inclusive cumsum),
    ``draft_starts [B]`` / ``row_starts [B]`` (first draft index / first target row of each request),
    ``request_of_draft [T]`` / ``position_of_draft [T]``, ``flat_draft_token_ids [T]``,
    ``target_logits_indices [T]`` (target row verifying each flat draft), ``bonus_logits_indices [B]``,
    ``request_of_row [T + B]``, ``position_of_row [T + B]``.
    """

    draft_token_ids: list[list[int]]
    min_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.min_tokens is not None and len(self.min_tokens) != len(self.draft_token_ids):
            raise ValueError(
                f"min_tokens has {len(self.min_tokens)} entries but there are {len(self.draft_token_ids)} requests."
            )

    @property
    def num_requests(self) -> int:
        return len(self.draft_token_ids)

    @cached_property
    def num_draft_tokens(self) -> np.ndarray:
        return np.array([len(d) for d in self.draft_token_ids], dtype=np.int64)

    @cached_property
    def cu_num_draft_tokens(self) -> np.ndarray:
        return np.cumsum(self.num_draft_tokens)

    @property
    def total_draft_tokens(self) -> int:
        return int(self.num_draft_tokens.sum())

    @property
    def total_rows(self) -> int:
        return self.total_draft_tokens + self.num_requests

    @property
    def max_spec_len(self) -> int:
        return int(self.num_draft_tokens.max()) if self.num_requests else 0

    @cached_property
    def draft_starts(self) -> np.ndarray:
        return self.cu_num_draft_tokens - self.num_draft_tokens

    @cached_property
    def row_starts(self) -> np.ndarray:
        return self.draft_starts + np.arange(self.num_requests, dtype=np.int64)

    @cached_property
    def request_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_requests, dtype=np.int64), self.num_draft_tokens + 1)

    @cached_property
    def position_of_row(self) -> np.ndarray:
        return np.arange(self.total_rows, dtype=np.int64) - self.row_starts[self.request_of_row]

    @cached_property
    def request_of_draft(self) -> np.ndarray:
        """int64 ``[T]``: the request owning each flat draft."""
        return np.repeat(np.arange(self.num_requests, dtype=np.int64), self.num_draft_tokens)

    @cached_property
    def position_of_draft(self) -> np.ndarray:
        """int64 ``[T]``: 0-based position of each flat draft within its request."""
        return np.arange(self.total_draft_tokens, dtype=np.int64) - self.draft_starts[self.request_of_draft]

    @cached_property
    def flat_draft_token_ids(self) -> np.ndarray:
        """int64 ``[T]``: the drafts of all requests, concatenated."""
        flat = [t for drafts in self.draft_token_ids for t in drafts]
        return np.array(flat, dtype=np.int64)

    @cached_property
    def target_logits_indices(self) -> np.ndarray:
        return np.arange(self.total_draft_tokens, dtype=np.int64) + self.request_of_draft

    @cached_property
    def bonus_logits_indices(self) -> np.ndarray:
        return self.row_starts + self.num_draft_tokens

    def check_draft_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the first draft id outside ``[-1, vocab_size)``."""
        flat = self.flat_draft_token_ids
        bad = flat[(flat < PLACEHOLDER_TOKEN_ID) | (flat >= vocab_size)]
        if bad.size:
            raise ValueError(f"draft token id {int(bad[0])} is outside [-1, {vocab_size}).")

    def position_histories(self, output_token_ids: list[list[int]]) -> list[list[int]]:
        """Per target row: the request's output tokens followed by its drafts before that position."""
        histories: list[list[int]] = []
        for output, drafts in zip(output_token_ids, self.draft_token_ids):
            histories.extend(list(output) + drafts[:j] for j in range(len(drafts) + 1))
        return histories


def expand_sampling_metadata(md: SamplingMetadata, spec: SpecDecodeMetadata) -> SamplingMetadata:
    """Per-request metadata -> per-target-row metadata (``spec.total_rows`` rows), for the logits processors.

    Settings are repeated per position; output histories (materialised only when penalties or bad_words apply)
    and min_tokens follow the drafts before each position. ``generators`` is empty and ``max_num_logprobs`` None:
    the rejection sampler draws its own randomness per request.
    """
    if md.num_rows != spec.num_requests:
        raise ValueError(f"sampling metadata has {md.num_rows} rows but there are {spec.num_requests} requests.")
    rows_np = spec.request_of_row
    rows = torch.from_numpy(rows_np).to(md.temperature.device)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, rows.to(t.device))

    if md.no_penalties and not md.bad_words_token_ids:
        histories = [md.output_token_ids[r] for r in rows_np.tolist()]
    else:
        histories = spec.position_histories(md.output_token_ids)
    return SamplingMetadata(
        temperature=md.temperature.index_select(0, rows),
        all_greedy=md.all_greedy,
        all_random=md.all_random,
        top_k=pick(md.top_k),
        top_p=pick(md.top_p),
        min_p=pick(md.min_p),
        generators={},
        max_num_logprobs=None,
        no_penalties=md.no_penalties,
        prompt_token_ids=pick(md.prompt_token_ids),
        output_token_ids=histories,
        presence_penalties=pick(md.presence_penalties),
        frequency_penalties=pick(md.frequency_penalties),
        repetition_penalties=pick(md.repetition_penalties),
        logit_bias=[md.logit_bias[r] for r in rows_np.tolist()],
        allowed_token_ids_mask=pick(md.allowed_token_ids_mask),
        min_tokens=_position_min_tokens(md, spec),
        bad_words_token_ids={row: md.bad_words_token_ids[req] for row, req in enumerate(rows_np.tolist())
                             if req in md.bad_words_token_ids},
    )


def _position_min_tokens(md: SamplingMetadata, spec: SpecDecodeMetadata) -> dict[int, set[int]]:
    """Target row -> stop ids, for the positions whose history is still shorter than min_tokens."""
    out: dict[int, set[int]] = {}
    for req, stop_ids in md.min_tokens.items():
        num_drafts = int(spec.num_draft_tokens[req])
        start = int(spec.row_starts[req])
        if num_drafts == 0:
            out[start] = stop_ids
            continue
        if spec.min_tokens is None:
            raise ValueError(
                f"request {req} is below its min_tokens and has {num_drafts} drafts: "
                "SpecDecodeMetadata.min_tokens (per-request SamplingParams.min_tokens) is required."
            )
        remaining = spec.min_tokens[req] - len(md.output_token_ids[req])
        for j in range(min(num_drafts + 1, remaining)):
            out[start + j] = stop_ids
    return out
