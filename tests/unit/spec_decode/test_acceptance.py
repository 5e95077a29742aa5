"""AcceptanceStats' row-slot storage: batched recording equals one-by-one recording, rows are reused and grown."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.spec_decode.acceptance import AcceptanceStats


def _reference_probs(history: list[tuple[str, int, int]], req_ids: list[str], k: int, s: float,
                     decay: float) -> np.ndarray:
    """The estimates from first principles: plain per-request counts and a sequentially decayed global count."""
    tried = {r: np.zeros(k) for r in req_ids}
    accepted = {r: np.zeros(k) for r in req_ids}
    all_tried, all_accepted = np.zeros(k), np.zeros(k)
    for req_id, drafts, acc in history:
        reached = min(acc + 1, drafts)
        all_tried, all_accepted = all_tried * decay, all_accepted * decay
        all_tried[:reached] += 1
        all_accepted[:acc] += 1
        if req_id in tried:
            tried[req_id][:reached] += 1
            accepted[req_id][:acc] += 1
    g = (all_accepted + 1) / (all_tried + 2)
    return np.stack([(accepted[r] + s * g) / (tried[r] + s) for r in req_ids])


verification = st.integers(0, 5).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(st.lists(st.tuples(st.integers(0, 11), verification), max_size=6), max_size=8),
       half_life=st.sampled_from([None, 3.0, 128.0]))
def test_batched_recording_equals_sequential(steps, half_life):
    k = 5
    batched, single = AcceptanceStats(k, prior_half_life=half_life), AcceptanceStats(k, prior_half_life=half_life)
    history = []
    for step in steps:
        ids = [f"r{i}" for i, _ in step]
        batched.record_batch(ids, [d for _, (d, _) in step], [a for _, (_, a) in step])
        for req_id, (_, (d, a)) in zip(ids, step):
            single.record(req_id, d, a)
            history.append((req_id, d, a))
    ids = [f"r{i}" for i in range(12)] + ["never"]
    decay = 1.0 if half_life is None else 0.5 ** (1 / half_life)
    expected = _reference_probs(history, ids, k, 2.0, decay)
    np.testing.assert_allclose(batched.token_probs(ids), expected, rtol=1e-12)
    np.testing.assert_allclose(single.token_probs(ids), expected, rtol=1e-12)


def test_rows_are_reused_after_remove_and_grow_past_the_first_block():
    stats = AcceptanceStats(3, prior_half_life=None)
    ids = [f"r{i}" for i in range(20)]  # more than the 7 rows of the first block
    stats.record_batch(ids, [3] * 20, [i % 4 for i in range(20)])
    assert stats.num_tracked == 20
    stats.remove("r3")
    stats.remove("r3")  # unknown now: a no-op
    stats.record("fresh", 2, 0)  # takes r3's row, which must read as new (tried 1 at position 0 only)
    probs = stats.token_probs(["fresh", "r3", "r4"])
    g = stats.prior()
    np.testing.assert_allclose(probs[0], [(0 + 2 * g[0]) / (1 + 2), g[1], g[2]], rtol=1e-12)
    np.testing.assert_allclose(probs[1], g, rtol=1e-12)  # removed: the prior
    np.testing.assert_allclose(probs[2], 2 * g / (np.array([1, 0, 0]) + 2), rtol=1e-12)  # r4: 3 drafts, 0 accepted
    assert stats.num_tracked == 20


def test_record_batch_rejects_bad_counts_naming_them():
    stats = AcceptanceStats(4)
    with pytest.raises(ValueError, match="num_accepted=3, num_drafts=2"):
        stats.record_batch(["a", "b"], [4, 2], [1, 3])
    with pytest.raises(ValueError, match="num_accepted=0, num_drafts=5"):
        stats.record_batch(["a"], [5], [0])
    with pytest.raises(ValueError, match="equal lengths"):
        stats.record_batch(["a"], [1, 2], [0, 0])
    assert stats.num_tracked == 0  # nothing was recorded
    np.testing.assert_allclose(stats.token_probs(["a"])[0], 0.5)
