"""Suffix-decoding proposer (vLLM's ``SuffixDecodingProposer`` driving our own ``SuffixCache``).

Per request the draft is the better of the request's prompt tree (prompt + its own output) and the global tree of
responses; its length varies per step, capped by ``suffix_decoding_max_spec_factor * match_len +
suffix_decoding_max_spec_offset``, by ``num_speculative_tokens``, by ``max_num_tokens[i]`` and by
``max_model_len - L - 1``; tokens whose estimated probability falls below ``suffix_decoding_min_token_prob`` are cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ascent.spec_decode.base import Proposer, SpeculativeConfig, pad_drafts
from ascent.spec_decode.calibration import DraftEvidence
from ascent.spec_decode.registry import register_proposer
from ascent.spec_decode.suffix_tree import Draft, SuffixCache


@register_proposer("suffix")
class SuffixDecodingProposer(Proposer):
    """Model-free proposer that learns from prompts and accepted outputs (``update_request``)."""

    deterministic = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.max_tree_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = float(config.suffix_decoding_max_spec_factor)
        self.max_spec_offset = float(config.suffix_decoding_max_spec_offset)
        self.min_token_prob = float(config.suffix_decoding_min_token_prob)
        self.cache = SuffixCache(max_tree_depth=self.max_tree_depth,
                                 max_cached_requests=config.suffix_decoding_max_cached_requests)
        self.last_drafts: list[Draft] = []  # the previous propose() call's drafts (probabilities, match lengths)

    def add_request(self, req_id: str, prompt_token_ids: list[int]) -> None:
        """Start (or restart, after preemption) the request: a fresh prompt tree and global response slot."""
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        self.cache.start_request(req_id, prompt_token_ids)

    def update_request(self, req_id: str, new_token_ids: list[int]) -> None:
        if new_token_ids:
            self.cache.add_active_response(req_id, new_token_ids)

    def update_requests(self, req_ids: Sequence[str], new_token_ids: Sequence[Sequence[int]]) -> None:
        self.cache.add_active_responses(req_ids, new_token_ids)

    def remove_request(self, req_id: str) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        self._check_batch(req_ids, token_ids, max_num_tokens)
        active = self.cache.active_requests
        drafts: list[Draft] = []
        for req_id, ctx, cap in zip(req_ids, token_ids, max_num_tokens):
            if req_id not in active:
                raise ValueError(f"req_id={req_id!r} was never added to the suffix proposer")
            k = min(self.k, cap, self.max_model_len - len(ctx) - 1)
            if k <= 0 or len(ctx) == 0:
                drafts.append(Draft())
                continue
            drafts.append(self.cache.speculate(req_id, ctx, k, self.max_spec_factor, self.max_spec_offset,
                                               self.min_token_prob))
        self.last_drafts = drafts
        return pad_drafts([d.token_ids for d in drafts], self.k)

    def draft_evidence(self) -> list[DraftEvidence | None]:
        """Per draft token the tree's branch ratio ``count(child) / count(node)`` (the ratio of consecutive
        cumulative probabilities) and the context it continues: the match length plus the token's position."""
        out: list[DraftEvidence | None] = []
        for draft in self.last_drafts:
            if not draft.token_ids:
                out.append(None)
                continue
            cumulative = np.asarray(draft.probs, dtype=np.float64)
            before = np.concatenate([[1.0], cumulative[:-1]])
            out.append(DraftEvidence(cond_prob=cumulative / np.maximum(before, 1e-12),
                                     support=draft.match_len + np.arange(len(cumulative), dtype=np.int64)))
        return out
