"""Per-step sampling metadata: the batch's SamplingParams turned into the tensors the sampler reads.

Row ``i`` of every tensor is row ``i`` of the logits. Optional tensors are None when no row in the batch uses the
feature, so a plain batch costs a few small host tensors per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ascent.sample.penalties import pad_token_lists
from ascent.sampling_params import _SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    """What the sampler needs for one step.

    temperature: float32 [B] (0 for greedy rows); top_k: int64 [B] (0 = off) or None; top_p / min_p: float32 [B] or
    None; generators: row -> per-request generator (seeded random rows only); max_num_logprobs: None (no row asked),
    -1 (full vocabulary) or the largest requested count; prompt_token_ids: int64 [B, max_prompt_len] padded with V,
    built only when some row has a repetition penalty; penalty tensors: float32 [B], None when ``no_penalties``;
    allowed_token_ids_mask: bool [B, V], True = NOT allowed; min_tokens: rows still below their min_tokens -> stop
    ids to mask; bad_words_token_ids: row -> the token sequences of its bad_words.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    logit_bias: list[dict[int, float] | None]
    allowed_token_ids_mask: torch.Tensor | None
    min_tokens: dict[int, set[int]]
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingMetadata":
        """Build the metadata for rows ``params[i]`` whose histories are ``prompt_token_ids[i]`` and
        ``output_token_ids[i]`` (kept by reference). Generators of greedy rows are dropped. Raises ValueError on
        mismatched lengths, out-of-range generator rows or out-of-vocabulary token ids."""
        num_rows = len(params)
        _check_lengths(num_rows, prompt_token_ids, output_token_ids, generators)
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        no_penalties = all(_neutral_penalties(p) for p in params)
        uses_rep = any(p.repetition_penalty != 1.0 for p in params)
        return cls(
            temperature=_f32(temps, device),
            all_greedy=all(greedy),
            all_random=num_rows > 0 and not any(greedy),
            top_k=_optional([p.top_k for p in params], 0, torch.int64, device),
            top_p=_optional([p.top_p for p in params], 1.0, torch.float32, device),
            min_p=_optional([p.min_p for p in params], 0.0, torch.float32, device),
            generators={row: gen for row, gen in generators.items() if not greedy[row]},
            max_num_logprobs=_max_num_logprobs(params),
            no_penalties=no_penalties,
            prompt_token_ids=pad_token_lists(prompt_token_ids, vocab_size, device) if uses_rep else None,
            output_token_ids=output_token_ids,
            presence_penalties=None if no_penalties else _f32([p.presence_penalty for p in params], device),
            frequency_penalties=None if no_penalties else _f32([p.frequency_penalty for p in params], device),
            repetition_penalties=None if no_penalties else _f32([p.repetition_penalty for p in params], device),
            logit_bias=[_checked_bias(p.logit_bias, vocab_size) for p in params],
            allowed_token_ids_mask=_allowed_mask(params, vocab_size, device),
            min_tokens=_min_tokens(params, output_token_ids, vocab_size),
            bad_words_token_ids={i: p._bad_words_token_ids for i, p in enumerate(params) if p._bad_words_token_ids},
        )


def _check_lengths(
    num_rows: int,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
) -> None:
    if len(prompt_token_ids) != num_rows:
        raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} rows, expected {num_rows}.")
    if len(output_token_ids) != num_rows:
        raise ValueError(f"output_token_ids has {len(output_token_ids)} rows, expected {num_rows}.")
    bad_rows = [row for row in generators if not 0 <= row < num_rows]
    if bad_rows:
        raise ValueError(f"generators has rows {bad_rows} outside a batch of {num_rows}.")


def _f32(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _optional(values: list, neutral: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def is_plain_greedy(p: SamplingParams) -> bool:
    """Whether the sampler's token for a row with ``p`` is the argmax of its raw logits and nothing else is asked of
    it: greedy, no logprobs, and no logits processor that could change a logit (penalties, logit_bias,
    allowed_token_ids, min_tokens, bad_words)."""
    return (p.temperature < _SAMPLING_EPS and p.logprobs is None and _neutral_penalties(p) and not p.logit_bias
            and p.allowed_token_ids is None and not p.min_tokens and not p.bad_words)


def _neutral_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0


def _max_num_logprobs(params: list[SamplingParams]) -> int | None:
    asked = [p.logprobs for p in params if p.logprobs is not None]
    if not asked:
        return None
    return -1 if -1 in asked else max(asked)


def _checked_bias(bias: dict[int, float] | None, vocab_size: int) -> dict[int, float] | None:
    if bias:
        bad = [t for t in bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias contains out-of-vocabulary token ids {bad} (vocab size {vocab_size}).")
    return bias or None


def _allowed_mask(params: list[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    if all(p.allowed_token_ids is None for p in params):
        return None
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    for row, p in enumerate(params):
        if p.allowed_token_ids is None:
            continue
        bad = [t for t in p.allowed_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"allowed_token_ids contains out-of-vocabulary token ids {bad} (vocab size {vocab_size}).")
        mask[row] = True
        mask[row, p.allowed_token_ids] = False
    return mask.to(device)


def _min_tokens(
    params: list[SamplingParams], output_token_ids: list[list[int]], vocab_size: int
) -> dict[int, set[int]]:
    rows: dict[int, set[int]] = {}
    for row, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[row]) < p.min_tokens:
            stop_ids = {t for t in set(p.all_stop_token_ids) | set(p.stop_token_ids) if 0 <= t < vocab_size}
            if stop_ids:
                rows[row] = stop_ids
    return rows
