"""Logit adjustments that can change the greedy choice, on float32 logits ``[B, V]`` (the sampler applies them in
this order, vLLM v1's).

1. allowed_token_ids: tokens outside a row's allow-list -> ``-inf``.
2. min_tokens: a row's stop ids (EOS set ∪ ``stop_token_ids``) -> ``-inf`` while it has fewer than ``min_tokens``
   output tokens.
3. logit_bias: added.
4. penalties, per row with repetition ``r``, frequency ``f`` and presence ``a``, ``cnt[v]`` = occurrences of ``v`` in
   the output tokens:
   - repetition (tokens seen in the prompt or the output): ``logit / r`` if ``logit > 0`` else ``logit * r``;
   - ``logit -= f * cnt[v] + a * (cnt[v] > 0)``.

Every function works in place and returns ``logits``.
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def apply_allowed_token_ids(logits: torch.Tensor, disallowed_mask: torch.Tensor | None) -> torch.Tensor:
    """``disallowed_mask``: bool ``[B, V]``, True = not allowed (None = no row restricts)."""
    if disallowed_mask is not None:
        logits.masked_fill_(disallowed_mask, _NEG_INF)
    return logits


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, set[int]]) -> torch.Tensor:
    """``min_tokens``: row -> token ids to mask (rows still below their ``min_tokens``)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in min_tokens.items():
        rows.extend([row] * len(token_ids))
        cols.extend(token_ids)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF
    return logits


def apply_bad_words(logits: torch.Tensor, bad_words: dict[int, list[list[int]]],
                    output_token_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's bad_words: for row -> token sequences, the last token of a sequence is masked when the row's output
    ends with the sequence's other tokens (a one-token word is always masked)."""
    rows: list[int] = []
    cols: list[int] = []
    for row, sequences in bad_words.items():
        output = output_token_ids[row]
        for seq in sequences:
            prefix = seq[:-1]
            if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
                rows.append(row)
                cols.append(seq[-1])
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> torch.Tensor:
    """Add ``logit_bias[row][token]`` to ``logits[row, token]``."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend([row] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)
    return logits


def pad_token_lists(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad lists of token ids with ``pad`` into int64 ``[len(token_lists), max_len]`` (at least one column).

    Negative ids (async placeholders) are rewritten to ``pad``.
    """
    width = max((len(t) for t in token_lists), default=0) or 1
    out = np.full((len(token_lists), width), pad, dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        if tokens:
            out[row, : len(tokens)] = tokens
    out[out < 0] = pad
    return torch.from_numpy(out).to(device)


def unique_token_keys(padded: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of padded ids (pad = ``vocab_size``) as flat keys ``row * V + token``.

    Returns (keys int64 ``[M]`` sorted, occurrence counts int64 ``[M]``); cost is O(B * L), never O(B * V).
    """
    rows = torch.arange(padded.shape[0], device=padded.device).unsqueeze(1).expand_as(padded)
    valid = padded < vocab_size
    return torch.unique(rows[valid] * vocab_size + padded[valid], return_counts=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition, frequency and presence penalties, touching only the tokens seen in each row's history.

    ``logits``: contiguous float32 ``[B, V]``; ``prompt_token_ids``: int64 ``[B, L]`` padded with V (None = no prompt
    tokens count for repetition); ``output_token_ids``: per-row lists (negative placeholders ignored); penalties:
    float32 ``[B]``.
    """
    vocab_size = logits.shape[1]
    flat = logits.view(-1)
    out_keys, out_counts = unique_token_keys(pad_token_lists(output_token_ids, vocab_size, logits.device), vocab_size)
    if bool((repetition_penalties != 1.0).any()):
        keys = out_keys
        if prompt_token_ids is not None:
            keys = torch.unique(torch.cat([out_keys, unique_token_keys(prompt_token_ids, vocab_size)[0]]))
        rep = repetition_penalties.to(logits.dtype)[keys // vocab_size]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)
    if bool((frequency_penalties != 0.0).any() or (presence_penalties != 0.0).any()):
        rows = out_keys // vocab_size
        freq = frequency_penalties.to(logits.dtype)[rows] * out_counts.to(logits.dtype)
        flat[out_keys] = flat[out_keys] - freq - presence_penalties.to(logits.dtype)[rows]
    return logits
