"""Truncation of the sampling distribution: min-p, top-k and top-p (vLLM v1 semantics).

Order inside the sampler (vLLM v1 ``Sampler.sample``): temperature -> min-p (an argmax-invariant logits processor)
-> top-k -> top-p -> softmax. So min-p compares probabilities of the temperature-scaled distribution, top-k keeps the
tokens whose logit is >= the k-th largest *surviving* logit, and top-p works on the softmax renormalised over the
top-k survivors.

- min-p: drop tokens with ``p_v < min_p * max_u p_u``; ``min_p = 0`` is off.
- top-k: keep logits ``>= `` the k-th largest (ties at the cut-off are kept); ``k = 0`` or ``k >= V`` is off.
- top-p: keep the smallest descending prefix whose probability reaches ``p`` (a token is kept iff the tokens more
  likely than it sum to ``< p``; the largest is always kept). vLLM states it as "sort ascending, drop positions whose
  cumulative probability is ``<= 1 - p``" -- the same set up to float rounding. ``p = 1`` is off.

All functions take float32 logits ``[B, V]``, write ``-inf`` into dropped positions (in place) and return them.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p * max_prob``. ``min_p``: float32 ``[B]`` (0 = off)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k without sorting the whole vocabulary. ``k``: int64 ``[B]``; 0 or >= V means off for that row."""
    vocab_size = logits.shape[1]
    off = (k <= 0) | (k >= vocab_size)
    k_eff = torch.where(off, torch.ones_like(k), k)
    max_k = int(k_eff.max().item())
    top_values = logits.topk(max_k, dim=-1).values
    kth = top_values.gather(1, (k_eff - 1).unsqueeze(1))
    kth.masked_fill_(off.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def _top_p_drop(
    sorted_probs: torch.Tensor, sorted_idx: torch.Tensor, p: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop mask bool ``[b, V]`` from descending probs ``[b, n]`` (a prefix of each row's sorted distribution).

    A token is kept iff the probability of the tokens before it is ``< p`` (the largest is always kept); tokens past
    the prefix are dropped, which is exact for the rows where the prefix's total reaches ``p`` (second output, bool
    ``[b]``).
    """
    cumulative = sorted_probs.cumsum(dim=-1)
    keep = (cumulative - sorted_probs) < p.unsqueeze(1)
    keep[:, 0] = True
    drop = torch.ones(sorted_probs.shape[0], vocab_size, dtype=torch.bool, device=sorted_probs.device)
    return drop.scatter_(1, sorted_idx, ~keep), cumulative[:, -1] >= p


def apply_top_p(logits: torch.Tensor, p: torch.Tensor, num_candidates: int = 1024) -> torch.Tensor:
    """Top-p over ``softmax(logits)``. ``p``: float32 ``[B]``, ``>= 1`` = off.

    Rows are first resolved on their ``num_candidates`` most likely tokens (``topk``, much cheaper than a full sort on
    CPU); rows whose candidates do not reach ``p`` fall back to a full sort. Both give the same set.
    """
    active = torch.nonzero(p < 1.0).flatten()
    if active.numel() == 0:
        return logits
    vocab_size = logits.shape[1]
    sub_p = p.to(torch.float32)[active]
    probs = torch.softmax(logits.index_select(0, active), dim=-1)
    cand_probs, cand_idx = probs.topk(min(num_candidates, vocab_size), dim=-1)
    drop, reached = _top_p_drop(cand_probs, cand_idx, sub_p, vocab_size)
    short = torch.nonzero(~reached).flatten()
    if cand_probs.shape[1] < vocab_size and short.numel() > 0:
        sorted_probs, sorted_idx = probs[short].sort(dim=-1, descending=True, stable=True)
        drop[short] = _top_p_drop(sorted_probs, sorted_idx, sub_p[short], vocab_size)[0]
    full_drop = torch.zeros_like(logits, dtype=torch.bool)
    full_drop[active] = drop
    return logits.masked_fill_(full_drop, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Apply top-k then top-p (renormalised over the top-k set).

    ``k``: int64 ``[B]`` (0 = off) or None; ``p``: float32 ``[B]`` in ``(0, 1]`` or None. Returns ``logits``.
    """
    if k is not None:
        apply_top_k_only(logits, k)
    if p is not None:
        apply_top_p(logits, p)
    return logits
