"""The sampler: logits ``[B, V]`` + SamplingMetadata -> one token per row (+ logprobs). vLLM v1 semantics.

Pipeline, on a float32 copy of the logits (the caller's tensor is not modified):

1. logprobs, if any row asked: ``log_softmax`` of the RAW logits (``logprobs.py``), gathered after sampling;
2. allowed_token_ids -> min_tokens -> logit_bias -> repetition/frequency/presence penalties (``penalties.py``);
3. greedy rows (temperature 0): ``argmax`` of those logits;
4. random rows: divide by temperature -> min-p -> top-k -> top-p (over the top-k survivors, renormalised)
   (``topk_topp.py``; the min-p-before-top-k order is vLLM v1's: min-p is an argmax-invariant logits processor
   that runs before ``TopKTopPSampler``) -> softmax -> one draw per row (``rng.py``: exponential race on device or
   host noise, or inverse CDF on host uniforms). Seeded rows use only their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ascent.sample.logprobs import LogprobsTensors, compute_logprobs_tensors
from ascent.sample.metadata import SamplingMetadata
from ascent.sample.penalties import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from ascent.sample.rng import RandomSampler, argmax_rows
from ascent.sample.topk_topp import apply_min_p, apply_top_k_top_p

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "apply_logits_processors",
    "apply_random_transforms",
    "compute_probs",
]


@dataclass
class SamplerOutput:
    """sampled_token_ids: int64 ``[B, 1]``; logprobs_tensors: None unless some row asked for logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None


def _fp32_copy(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)


def has_logits_processors(metadata: SamplingMetadata) -> bool:
    """Whether :func:`apply_logits_processors` would change any logit of this batch."""
    return (metadata.allowed_token_ids_mask is not None or bool(metadata.min_tokens)
            or any(metadata.logit_bias) or not metadata.no_penalties or bool(metadata.bad_words_token_ids))


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad_words, min_tokens, logit_bias, penalties, in place on float32 ``[B, V]``."""
    apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
    apply_bad_words(logits, metadata.bad_words_token_ids, metadata.output_token_ids)
    apply_min_tokens(logits, metadata.min_tokens)
    apply_logit_bias(logits, metadata.logit_bias)
    if not metadata.no_penalties:
        assert metadata.presence_penalties is not None and metadata.frequency_penalties is not None
        assert metadata.repetition_penalties is not None
        apply_penalties(
            logits,
            metadata.prompt_token_ids,
            metadata.output_token_ids,
            metadata.presence_penalties,
            metadata.frequency_penalties,
            metadata.repetition_penalties,
        )
    return logits


def apply_random_transforms(logits: torch.Tensor, metadata: SamplingMetadata, inplace: bool = True) -> torch.Tensor:
    """Temperature (greedy rows use 1.0), min-p, top-k, top-p on processed float32 ``[B, V]``: in place, or with
    ``inplace=False`` on a new tensor (the division writes it), leaving ``logits`` as it was."""
    temperature = metadata.temperature.to(logits.dtype)
    if not metadata.all_random:
        temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits.div_(temperature.unsqueeze(1)) if inplace else logits.div(temperature.unsqueeze(1))
    if metadata.min_p is not None:
        apply_min_p(logits, metadata.min_p)
    return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row is sampled from: float32 ``[B, V]``, rows sum to 1.

    ``logits``: raw ``[B, V]`` (not modified). Random rows: softmax of the fully processed logits; greedy rows: one-hot
    at the argmax of the processed logits (before temperature).
    """
    processed = apply_logits_processors(_fp32_copy(logits), metadata)
    probs = torch.empty_like(processed)
    if not metadata.all_random:
        probs.zero_().scatter_(1, argmax_rows(processed).unsqueeze(1), 1.0)
    if not metadata.all_greedy:
        random_probs = torch.softmax(apply_random_transforms(processed, metadata), dim=-1)
        greedy_rows = (metadata.temperature <= 0).unsqueeze(1)
        probs = random_probs if metadata.all_random else torch.where(greedy_rows, probs, random_probs)
    return probs


class Sampler(nn.Module):
    """Samples one token per row.

    ``rng_placement``: "device" | "host" | "host_cdf" (see ``rng.py``); ``generator``: the engine generator used by
    rows without a per-request generator (None = the default generator of the placement's device).
    """

    def __init__(self, rng_placement: str = "device", generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.random_sampler = RandomSampler(rng_placement, generator)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits``: ``[B, V]`` (any float dtype, not modified). Returns int64 ``[B, 1]`` tokens (+ logprobs)."""
        if logits.shape[0] != metadata.num_rows:
            raise ValueError(f"logits has {logits.shape[0]} rows but the metadata has {metadata.num_rows}.")
        read_only = not has_logits_processors(metadata) and logits.dtype == torch.float32
        # read only: the argmax and the temperature's (out-of-place) division need no processed copy
        processed = logits if read_only else apply_logits_processors(_fp32_copy(logits), metadata)
        sampled = self._sample(processed, metadata, owned=not read_only)
        logprobs_tensors = None
        if metadata.max_num_logprobs is not None:
            logprobs_tensors = compute_logprobs_tensors(logits, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.unsqueeze(1), logprobs_tensors=logprobs_tensors)

    def _sample(self, processed: torch.Tensor, metadata: SamplingMetadata, owned: bool) -> torch.Tensor:
        """``owned``: ``processed`` is the sampler's own copy, which the random transforms may change in place."""
        greedy = None if metadata.all_random else argmax_rows(processed)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        probs = torch.softmax(apply_random_transforms(processed, metadata, inplace=owned), dim=-1)
        random = self.random_sampler.sample(probs, metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.temperature.to(processed.device) <= 0, greedy, random)
