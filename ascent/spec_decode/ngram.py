"""N-gram (prompt lookup) proposer, vLLM's ``NgramProposer`` semantics.

For a context of ``L`` tokens: the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` whose last-``n``
tokens occur earlier in the context (the occurrence must end before the last token; overlap allowed) wins; among
occurrences of that length the earliest one wins (vLLM's KMP keeps the earliest start). The draft is the tokens that
follow the occurrence, at most ``min(k, max_model_len - L)``.
"""

from __future__ import annotations

import numpy as np

from ascent.spec_decode.base import Proposer, SpeculativeConfig, pad_drafts
from ascent.spec_decode.registry import register_proposer


def find_ngram_draft(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Draft for one request: int64 1-D of length ``<= k`` (empty when no n-gram of length >= ``min_n`` matches).

    Grows the match one token at a time: a start ``s`` matches the last ``n + 1`` tokens iff ``s + 1`` matches the
    last ``n`` and ``context[s] == context[L - n - 1]``, so each step filters the previous candidate starts.
    """
    ctx = np.asarray(context, dtype=np.int64)
    length = ctx.shape[0]
    if k <= 0 or length < max(min_n, 2):
        return ctx[:0]
    starts = np.flatnonzero(ctx[: length - 1] == ctx[length - 1])
    best_n, best_start = 0, -1
    n = 1
    while starts.size:
        if n >= min_n:
            best_n, best_start = n, int(starts[0])
        if n == max_n:
            break
        starts = starts[starts >= 1] - 1
        starts = starts[ctx[starts] == ctx[length - 1 - n]]
        n += 1
    if best_n < min_n:
        return ctx[:0]
    begin = best_start + best_n
    return ctx[begin: begin + k].copy()


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt-lookup drafts from each request's own context; stateless across steps."""

    deterministic = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, req_ids: list[str], token_ids: list[np.ndarray], max_num_tokens: list[int]) -> np.ndarray:
        self._check_batch(req_ids, token_ids, max_num_tokens)
        drafts = []
        for ctx, cap in zip(token_ids, max_num_tokens):
            k = min(self.k, cap, self.max_model_len - len(ctx))
            drafts.append(find_ngram_draft(ctx, self.min_n, self.max_n, k))
        return pad_drafts(drafts, self.k)
