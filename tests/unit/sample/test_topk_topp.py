"""Exact support checks: the tokens with non-zero sampling probability equal the set computed with numpy sorting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.sampler import compute_probs
from ascent.sample.topk_topp import apply_min_p, apply_top_k_only, apply_top_k_top_p, apply_top_p
from ascent.sampling_params import SamplingParams
from tests.unit.sample.reference import target_probs

torch.set_num_threads(1)

HAND_LOGITS = [2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 2.5, -2.0]


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def _metadata(params: list[SamplingParams], vocab: int, outputs: list[list[int]] | None = None) -> SamplingMetadata:
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, [[] for _ in params], outputs, {}, vocab, torch.device("cpu"))


def _np_top_k(x: np.ndarray, k: int) -> set[int]:
    kth = np.sort(x)[::-1][k - 1]
    return {i for i in range(len(x)) if x[i] >= kth}


def _np_top_p(x: np.ndarray, p: float) -> set[int]:
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    order = np.argsort(-probs)
    kept, total = set(), 0.0
    for t in order:
        kept.add(int(t))
        total += probs[t]
        if total >= p:
            break
    return kept


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_top_k_only_keeps_the_k_largest(k: int) -> None:
    x = np.array(HAND_LOGITS)
    out = apply_top_k_only(torch.tensor([HAND_LOGITS]), torch.tensor([k]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == _np_top_k(x, k)


def test_top_k_keeps_ties_at_the_cutoff_and_zero_is_off() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_only(logits.clone(), torch.tensor([1, 0, 4]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {1, 2}
    assert torch.isfinite(out[1:]).all()
    both = apply_top_k_top_p(logits.clone(), torch.tensor([1, 0, 4]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(torch.isfinite(both), torch.isfinite(out))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.55, 0.8, 0.95, 1.0])
def test_top_p_keeps_smallest_prefix_reaching_p(p: float) -> None:
    x = np.array(HAND_LOGITS)
    out = apply_top_k_top_p(torch.tensor([HAND_LOGITS]), None, torch.tensor([p]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == _np_top_p(x, p)


def test_top_p_is_renormalised_over_top_k() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == {0}


@pytest.mark.parametrize("min_p", [0.0, 0.1, 0.3, 0.6, 1.0])
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float) -> None:
    x = np.array(HAND_LOGITS)
    probs = np.exp(x) / np.exp(x).sum()
    expected = {i for i in range(len(x)) if probs[i] >= min_p * probs.max()}
    out = apply_min_p(torch.tensor([HAND_LOGITS]), torch.tensor([min_p]))
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == expected


def test_min_p_runs_before_top_p() -> None:
    # min-p first keeps {0, 1, 2}; top-p renormalised over them (.44, .33, .22) stops at {0, 1}.
    # top-p first would keep {0, 1, 2} (0.4 + 0.3 < 0.75) and min-p would not remove token 2.
    params = SamplingParams(temperature=1.0, min_p=0.4, top_p=0.75)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = compute_probs(logits, _metadata([params], 4))
    assert _support(probs[0]) == {0, 1}


COMBOS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.5, top_p=0.7),
    dict(temperature=0.5, top_k=6, top_p=0.8),
    dict(temperature=1.2, min_p=0.12),
    dict(temperature=0.9, min_p=0.05, top_k=5, top_p=0.85),
    dict(temperature=1.0, allowed_token_ids=[1, 4, 7, 9, 12], top_p=0.9),
    dict(temperature=1.0, min_tokens=3, stop_token_ids=[2, 5], top_k=7),
    dict(temperature=0.8, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3, top_p=0.75),
    dict(temperature=0.0, logit_bias={3: 4.0}),
]


def test_support_matches_numpy_reference_for_random_logits() -> None:
    gen = np.random.default_rng(7)
    vocab = 16
    params = [SamplingParams(**combo) for combo in COMBOS]
    for p in params:
        p.update_from_generation_config({0, 15})
    logits = gen.normal(0.0, 2.0, size=(len(params), vocab))
    outputs = [gen.integers(0, vocab, size=2).tolist() for _ in params]
    md = SamplingMetadata.from_requests(
        params, [[1, 2, 3]] * len(params), outputs, {}, vocab, torch.device("cpu")
    )
    probs = compute_probs(torch.tensor(logits, dtype=torch.float32), md)
    for row, p in enumerate(params):
        ref = target_probs(logits[row], [1, 2, 3], outputs[row], p)
        assert _support(probs[row]) == set(np.nonzero(ref > 0)[0].tolist()), COMBOS[row]
        np.testing.assert_allclose(probs[row].numpy(), ref, atol=1e-5)


def test_allowed_and_min_tokens_masks_are_exact() -> None:
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[0, 2, 5])
    min_tok = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[3])
    min_tok.update_from_generation_config({6})
    done = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[3])
    md = _metadata([allowed, min_tok, done], 8, outputs=[[], [1], [1]])
    probs = compute_probs(torch.tensor([HAND_LOGITS] * 3), md)
    assert _support(probs[0]) == {0, 2, 5}
    assert _support(probs[1]) == set(range(8)) - {3, 6}
    assert _support(probs[2]) == set(range(8))


def test_top_p_candidate_fast_path_and_full_sort_fallback_agree() -> None:
    gen = np.random.default_rng(9)
    logits = gen.normal(0.0, 1.0, size=(6, 64))
    logits[0] *= 8.0  # peaked row: resolved inside a few candidates
    p = np.array([0.9, 0.5, 0.95, 0.2, 1.0, 0.7])
    fast = apply_top_p(torch.tensor(logits, dtype=torch.float32), torch.tensor(p, dtype=torch.float32), 4)
    for row in range(6):
        expected = set(range(64)) if p[row] >= 1.0 else _np_top_p(logits[row], p[row])
        assert set(torch.nonzero(torch.isfinite(fast[row])).flatten().tolist()) == expected
