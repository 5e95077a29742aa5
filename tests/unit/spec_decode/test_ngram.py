"""N-gram proposer vs a brute-force search, plus vLLM's documented examples and edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.ngram import NgramProposer, find_ngram_draft
from tests.unit.spec_decode.reference import ngram_draft


def _proposer(k: int, lo: int, hi: int, max_model_len: int = 1024) -> NgramProposer:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    return NgramProposer(cfg, max_model_len)


def test_vllm_docstring_example():
    # context [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] has no earlier match, [2,3] matches -> [4,2,3]
    assert find_ngram_draft(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4).tolist() == [4, 2, 3]


@pytest.mark.parametrize("ctx, lo, hi, k, expected", [
    # vLLM tests/v1/spec_decode/test_ngram.py vectors
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 1, 2, 3], 1, 1, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # the first (earliest) match
    ([1, 2, 3, 4, 5], 2, 2, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram, not [5, 1]
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # the 3-gram, not [5, 2]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),
])
def test_vllm_ut_vectors(ctx, lo, hi, k, expected):
    assert find_ngram_draft(np.array(ctx), lo, hi, k).tolist() == expected
    assert ngram_draft(ctx, lo, hi, k) == expected  # the brute-force reference agrees with vLLM too


def test_longest_n_wins_over_a_later_shorter_match():
    ctx = np.array([7, 1, 2, 9, 5, 5, 2, 8, 7, 1, 2])  # [7,1,2] occurs at 0 (n=3); [2] alone also at 6
    assert find_ngram_draft(ctx, 1, 3, 2).tolist() == [9, 5]


def test_earliest_occurrence_wins_among_equal_lengths():
    ctx = np.array([4, 5, 10, 4, 5, 20, 4, 5])
    assert find_ngram_draft(ctx, 2, 2, 1).tolist() == [10]  # vLLM's KMP keeps the earliest start


def test_overlapping_occurrence_allowed():
    assert find_ngram_draft(np.array([3, 3, 3, 3]), 2, 3, 3).tolist() == [3]  # [3,3,3] at start 0 -> ctx[3:]


def test_no_match_and_short_context():
    assert find_ngram_draft(np.array([1, 2, 3, 4]), 1, 3, 3).tolist() == []
    assert find_ngram_draft(np.array([5]), 1, 1, 3).tolist() == []
    assert find_ngram_draft(np.array([], dtype=np.int64), 1, 1, 3).tolist() == []
    assert find_ngram_draft(np.array([1, 1]), 2, 2, 3).tolist() == []  # the suffix itself does not count


def test_min_n_excludes_shorter_matches():
    ctx = np.array([1, 2, 9, 2])  # only n=1 matches
    assert find_ngram_draft(ctx, 1, 3, 2).tolist() == [9, 2]
    assert find_ngram_draft(ctx, 2, 3, 2).tolist() == []


def test_propose_pads_truncates_and_respects_max_model_len():
    p = _proposer(k=4, lo=1, hi=2, max_model_len=12)
    ctx_a = np.array([1, 2, 3, 4, 5, 6, 1, 2], dtype=np.int64)  # match [1,2] -> [3,4,5,6]
    ctx_b = np.array([9, 8, 7], dtype=np.int64)  # no match
    ctx_c = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1], dtype=np.int64)  # L=11 -> only 1 token fits
    out = p.propose(["a", "b", "c", "d"], [ctx_a, ctx_b, ctx_c, ctx_a], [4, 4, 4, 2])
    assert out.dtype == np.int64 and out.shape == (4, 4)
    assert out.tolist() == [[3, 4, 5, 6], [-1] * 4, [2, -1, -1, -1], [3, 4, -1, -1]]
    full = np.arange(12, dtype=np.int64) % 3
    assert p.propose(["x"], [full], [4]).tolist() == [[-1] * 4]  # L == max_model_len
    assert p.propose(["x"], [ctx_a], [0]).tolist() == [[-1] * 4]


def test_propose_validates_batch_shapes():
    p = _proposer(k=2, lo=1, hi=3)
    with pytest.raises(ValueError, match="equal lengths"):
        p.propose(["a", "b"], [np.array([1, 1])], [2, 2])
    with pytest.raises(ValueError, match="max_num_tokens=-1 for request 'a'"):
        p.propose(["a"], [np.array([1, 1])], [-1])


def test_propose_accepts_int32_and_lists_of_mixed_lengths():
    p = _proposer(k=2, lo=1, hi=3)
    out = p.propose(["a"], [np.array([5, 6, 5], dtype=np.int32)], [2])
    assert out.tolist() == [[6, 5]]


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=40), lo=st.integers(1, 4), span=st.integers(0, 3),
       k=st.integers(0, 6))
def test_matches_brute_force(ctx, lo, span, k):
    hi = lo + span
    got = find_ngram_draft(np.array(ctx, dtype=np.int64), lo, hi, k).tolist()
    assert got == ngram_draft(ctx, lo, hi, k)


@settings(max_examples=100, deadline=None)
@given(ctxs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=5),
       max_model_len=st.integers(20, 40))
def test_batch_propose_matches_brute_force(ctxs, max_model_len):
    p = _proposer(k=3, lo=1, hi=3, max_model_len=max_model_len)
    caps = [i % 4 for i in range(len(ctxs))]
    out = p.propose([str(i) for i in range(len(ctxs))], [np.array(c) for c in ctxs], caps)
    for row, ctx, cap in zip(out, ctxs, caps):
        expected = ngram_draft(ctx, 1, 3, min(3, cap, max_model_len - len(ctx)))
        assert row.tolist() == expected + [-1] * (3 - len(expected))
