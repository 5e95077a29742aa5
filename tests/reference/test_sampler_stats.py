"""Sampler draws follow the exact target distribution: chi-square against an independent numpy enumeration.

For each (temperature, top-k, top-p, min-p, penalties) combo and RNG placement, N = 20k draws of one row (batched as
N identical rows, plus one run through per-request seeded generators) are compared with the target probabilities
computed in ``tests/unit/sample/reference.py``; tokens outside the target support must never be drawn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rng import RNG_PLACEMENTS, make_generator
from ascent.sample.sampler import Sampler
from ascent.sampling_params import SamplingParams
from tests.unit.sample.reference import target_probs

torch.set_num_threads(1)
CPU = torch.device("cpu")
VOCAB = 12
NUM_DRAWS = 20_000
PROMPT = [0, 3, 3, 7]
OUTPUT = [1, 3, 9, 9, 9]
LOGITS = np.random.default_rng(2024).normal(0.0, 1.2, size=VOCAB).astype(np.float32)

COMBOS = {
    "plain": dict(temperature=1.0),
    "cold_top_k": dict(temperature=0.7, top_k=5),
    "hot_top_p": dict(temperature=1.3, top_p=0.8),
    "all_truncations": dict(temperature=0.9, top_k=7, top_p=0.75, min_p=0.08),
    "penalties_bias": dict(
        temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias={4: 1.0}
    ),
}


def _assert_matches(counts: np.ndarray, target: np.ndarray) -> None:
    """Zero draws outside the support; chi-square (bins with expected < 5 merged) p-value > 1e-3."""
    support = target > 0
    assert counts[~support].sum() == 0
    total = counts.sum()
    expected = target[support] * total
    observed = counts[support].astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    assert len(expected) >= 2
    assert chisquare(observed, expected).pvalue > 1e-3


def _batch_draws(params: SamplingParams, placement: str) -> np.ndarray:
    md = SamplingMetadata.from_requests(
        [params] * NUM_DRAWS, [PROMPT] * NUM_DRAWS, [OUTPUT] * NUM_DRAWS, {}, VOCAB, CPU
    )
    sampler = Sampler(placement, generator=torch.Generator().manual_seed(17))
    logits = torch.tensor(LOGITS).expand(NUM_DRAWS, VOCAB)
    tokens = sampler(logits, md).sampled_token_ids[:, 0].numpy()
    return np.bincount(tokens, minlength=VOCAB)


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_batched_draws_match_target(combo: str, placement: str) -> None:
    params = SamplingParams(**COMBOS[combo])
    target = target_probs(LOGITS, PROMPT, OUTPUT, params)
    assert (target > 0).sum() >= 3
    _assert_matches(_batch_draws(params, placement), target)


@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
def test_seeded_generators_match_target(placement: str) -> None:
    rows, steps = 1000, NUM_DRAWS // 1000
    params = SamplingParams(**COMBOS["all_truncations"])
    gens = {row: make_generator(10_000 + row, placement, CPU) for row in range(rows)}
    md = SamplingMetadata.from_requests([params] * rows, [PROMPT] * rows, [OUTPUT] * rows, gens, VOCAB, CPU)
    sampler = Sampler(placement)
    logits = torch.tensor(LOGITS).expand(rows, VOCAB)
    tokens = np.concatenate([sampler(logits, md).sampled_token_ids[:, 0].numpy() for _ in range(steps)])
    _assert_matches(np.bincount(tokens, minlength=VOCAB), target_probs(LOGITS, PROMPT, OUTPUT, params))
