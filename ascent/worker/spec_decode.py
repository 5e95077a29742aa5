"""Speculative decoding inside the model runner: proposer lifecycle, draft placement, verification, proposals.

Per step, for a request with ``k`` scheduled drafts the scheduler scheduled ``num_tokens + k - num_computed`` tokens;
the drafts are written into the persistent token buffer right after the committed tokens (not committed), the model
scores all positions, and the ``k + 1`` last positions' logits go to the rejection sampler, which returns the accepted
drafts plus one recovered/bonus token. Those are committed; the scheduler rolls ``num_computed_tokens`` back by the
rejected count (the rejected drafts' KV slots are simply overwritten later). After sampling, the proposer drafts the
next ``k`` tokens from every request's committed tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from ascent.spec_decode.base import Proposer, SpeculativeConfig
from ascent.spec_decode.registry import get_proposer_cls
from ascent.worker.input_batch import InputBatch


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, rng_placement: str,
                 generator: torch.Generator | None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer: Proposer = get_proposer_cls(config.method)(config, max_model_len)
        self.rejection_sampler = RejectionSampler(method=config.rejection_sample_method, rng_placement=rng_placement,
                                                  generator=generator)
        self._known: set[str] = set()

    def load_model(self, target_model: torch.nn.Module) -> None:
        self.proposer.load_model(target_model)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def add_request(self, req_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        if req_id in self._known:
            self.proposer.remove_request(req_id)
        self.proposer.add_request(req_id, list(prompt_token_ids))
        if output_token_ids:
            self.proposer.update_request(req_id, list(output_token_ids))
        self._known.add(req_id)

    def remove_request(self, req_id: str) -> None:
        if req_id in self._known:
            self._known.discard(req_id)
            self.proposer.remove_request(req_id)

    # ------------------------------------------------------------------------------------------------ drafts
    def verify(self, drafts: list[list[int]], target_logits: torch.Tensor, metadata: SamplingMetadata,
               min_tokens: list[int]) -> list[list[int]]:
        """``target_logits`` fp32 ``[sum(k_i + 1), V]`` -> accepted drafts + one recovered/bonus token per request.
        ``min_tokens`` per request lets each draft position mask stop tokens exactly as plain sampling would."""
        spec = SpecDecodeMetadata(draft_token_ids=drafts, min_tokens=min_tokens)
        return self.rejection_sampler(spec, None, target_logits, metadata,
                                      deterministic_proposer=self.proposer.deterministic)

    def propose(self, batch: InputBatch, req_ids: list[str], new_tokens: list[list[int]]) -> dict[str, list[int]]:
        """Teach the proposer the committed tokens, then draft up to ``k`` tokens per request (never past
        ``max_model_len``)."""
        for req_id, toks in zip(req_ids, new_tokens):
            if toks:
                self.proposer.update_request(req_id, toks)
        rows = [batch.req_id_to_index[r] for r in req_ids]
        token_ids = [batch.token_ids[row, : int(batch.num_tokens[row])] for row in rows]
        budget = [max(0, min(self.k, self.max_model_len - 1 - len(t))) for t in token_ids]
        proposals = self.proposer.propose(req_ids, token_ids, budget)
        out: dict[str, list[int]] = {}
        for i, req_id in enumerate(req_ids):
            drafts = [int(t) for t in np.asarray(proposals[i]).tolist() if t >= 0][: budget[i]]
            if drafts:
                out[req_id] = drafts
        return out
