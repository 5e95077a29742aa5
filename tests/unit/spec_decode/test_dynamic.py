"""Dynamic speculation: batch-size schedule rules, the shared-budget allocator vs brute force, budget updates,
and acceptance statistics driving per-request lengths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.spec_decode.dynamic import (PROBE_BACKOFF, AcceptanceStats, DraftGate, DynamicSpecParams,
                                        DynamicSpecScheduler, batch_size_k, build_batch_size_lookup,
                                        validate_batch_size_schedule)

# ---------------------------------------------------------------------------------------------- batch-size schedule


def test_schedule_lookup_gaps_tail_and_clamp():
    lookup = build_batch_size_lookup([[1, 2, 5], [4, 6, 2], [10, 12, 0]], max_batch_size=14, max_k=4)
    assert lookup[0] == 0
    assert lookup[1:3] == [4, 4]  # K=5 clamped to the configured max 4
    assert lookup[3] == 4  # gap inherits the previous K
    assert lookup[4:10] == [2] * 6  # 7..9 inherit 2
    assert lookup[10:15] == [0] * 5  # tail inherits the last K
    with pytest.raises(IndexError):
        _ = lookup[15]


def test_schedule_sorted_and_truncated_to_max_batch_size():
    assert build_batch_size_lookup([[3, 100, 1], [1, 2, 3]], max_batch_size=4, max_k=3) == [0, 3, 3, 1, 1]


@pytest.mark.parametrize("bad, needle", [
    ([], "non-empty"),
    (None, "non-empty"),
    ([[1, 2]], "3 integers"),
    ([[1, 2, 3.5]], "3 integers"),
    ([[0, 2, 1]], "1 <= start"),
    ([[1, 2, -1]], "K >= 0"),
    ([[3, 2, 1]], "start <= end"),
    ([[2, 4, 1]], "start at batch size 1"),
    ([[1, 4, 1], [4, 8, 2]], "overlap"),
])
def test_schedule_validation(bad, needle):
    with pytest.raises(ValueError, match=needle):
        validate_batch_size_schedule(bad)


# ---------------------------------------------------------------------------------------------- allocator


def _brute_best_sum(survival: np.ndarray, min_k: int, budget_k: int) -> float:
    b, d = survival.shape
    extra = b * max(budget_k - min_k, 0)
    best = 0.0
    for lens in itertools.product(range(min_k, d + 1), repeat=b):
        if sum(lens) - b * min_k <= extra:
            best = max(best, sum(float(survival[i, min_k:n].sum()) for i, n in enumerate(lens)))
    return best


@settings(max_examples=120, deadline=None)
@given(b=st.integers(1, 3), d=st.integers(1, 4), min_k=st.integers(0, 2), budget=st.integers(0, 4),
       data=st.data())
def test_allocation_maximizes_selected_survival_within_budget(b, d, min_k, budget, data):
    probs = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=b * d, max_size=b * d))).reshape(b, d)
    sched = DynamicSpecScheduler(d, DynamicSpecParams(initial_verify_budget_per_req=budget, min_verify_tokens=min_k,
                                                      budget_update_interval=10**6))
    keep = sched.update(probs)
    survival = np.cumprod(np.clip(probs, 1e-6, 1.0), axis=1)
    lo = min(min_k, d)
    assert keep.dtype == np.int32 and ((keep >= lo) & (keep <= d)).all()
    assert keep.sum() <= b * max(sched.budget_k, lo)
    got = sum(float(survival[i, lo:n].sum()) for i, n in enumerate(keep))
    assert got == pytest.approx(_brute_best_sum(survival, lo, sched.budget_k), rel=1e-12, abs=1e-12)


def test_initial_budget_and_min_k():
    assert DynamicSpecScheduler(8).budget_k == 5
    assert DynamicSpecScheduler(3).budget_k == 3
    assert DynamicSpecScheduler(8, DynamicSpecParams(initial_verify_budget_per_req=0, min_verify_tokens=2)).budget_k \
        == 2


def test_budget_updates_on_the_interval_with_odd_bump():
    sched = DynamicSpecScheduler(6, DynamicSpecParams(budget_update_interval=3, budget_threshold=0.5))
    probs = np.array([[1.0, 1.0, 0.1, 1, 1, 1], [1.0, 1.0, 0.1, 1, 1, 1]])  # 2 positions >= 0.5 per row
    sched.update(probs)
    sched.update(probs)
    assert sched.budget_k == 5  # unchanged before the 3rd step
    keep = sched.update(probs)
    assert sched.budget_k == 3  # ceil(2) = 2 is even and < D -> 3
    assert keep.tolist() == [3, 3]
    high = np.ones((2, 6))
    for _ in range(3):
        sched.update(high)
    assert sched.budget_k == 6  # 6 is even but == D: no bump


def test_shared_budget_goes_to_the_confident_request():
    sched = DynamicSpecScheduler(4, DynamicSpecParams(initial_verify_budget_per_req=2, min_verify_tokens=1))
    keep = sched.update(np.array([[0.9, 0.9, 0.9, 0.9], [0.2, 0.2, 0.2, 0.2]]))
    assert keep.tolist() == [3, 1] and keep.sum() == 2 * sched.budget_k


def test_update_rejects_wrong_width():
    with pytest.raises(ValueError, match=r"shape \(1, 3\)"):
        DynamicSpecScheduler(4).update(np.ones((1, 3)))


# ---------------------------------------------------------------------------------------------- acceptance stats


def test_acceptance_stats_counts_and_prior():
    stats = AcceptanceStats(4, prior_strength=2.0, prior_half_life=None)
    stats.record("a", num_drafts=4, num_accepted=2)  # tried 0,1,2; accepted 0,1
    stats.record("a", num_drafts=1, num_accepted=1)  # tried 0; accepted 0
    tried, accepted = np.array([2, 1, 1, 0]), np.array([2, 1, 0, 0])  # "a" is the only request: global == own
    g = (accepted + 1.0) / (tried + 2.0)
    expected_a = (accepted + 2.0 * g) / (tried + 2.0)
    np.testing.assert_allclose(stats.token_probs(["a", "new"]), np.stack([expected_a, g]), rtol=1e-12)
    stats.remove("a")
    np.testing.assert_allclose(stats.token_probs(["a"])[0], g, rtol=1e-12)
    with pytest.raises(ValueError, match="num_accepted=3, num_drafts=2"):
        stats.record("a", 2, 3)
    with pytest.raises(ValueError, match="prior_half_life"):
        AcceptanceStats(4, prior_half_life=0.0)


def test_acceptance_prior_follows_recent_traffic():
    recent, history = AcceptanceStats(2, prior_half_life=16), AcceptanceStats(2, prior_half_life=None)
    for stats in (recent, history):
        for i in range(200):  # repetitive traffic: every first draft accepted
            stats.record(f"rep{i}", 1, 1)
        for i in range(64):  # then non-repetitive: every first draft rejected
            stats.record(f"new{i}", 1, 0)
    g_recent, g_history = recent.token_probs(["unseen"])[0, 0], history.token_probs(["unseen"])[0, 0]
    d = 0.5 ** (1 / 16)  # each record first decays the global counts, then adds its own
    accepted, tried = d ** 64 * (1 - d ** 200) / (1 - d), (1 - d ** 264) / (1 - d)
    assert g_recent == pytest.approx((accepted + 1) / (tried + 2), rel=1e-9)
    assert g_history == pytest.approx(201 / 266, rel=1e-12)
    assert g_recent < 0.1 < 0.7 < g_history


def test_lengths_follow_acceptance_statistics_within_budget():
    k = 5
    stats = AcceptanceStats(k)
    sched = DynamicSpecScheduler(k, DynamicSpecParams(initial_verify_budget_per_req=3, budget_update_interval=4))
    rng = np.random.default_rng(0)
    rates = {"good": 0.95, "mid": 0.6, "bad": 0.1}
    reqs = list(rates)
    for _ in range(40):
        keep = sched.update(stats.token_probs(reqs))
        assert keep.sum() <= len(reqs) * sched.budget_k and ((keep >= 1) & (keep <= k)).all()
        for r, n in zip(reqs, keep):
            accepted = 0
            while accepted < n and rng.random() < rates[r]:
                accepted += 1
            stats.record(r, int(n), accepted)
    keep = dict(zip(reqs, sched.update(stats.token_probs(reqs))))
    assert keep["good"] > keep["mid"] >= keep["bad"] and keep["bad"] == 1, keep


# ---------------------------------------------------------------------------------------------- batch-size cap, gate


def test_batch_size_k_matches_the_dense_lookup():
    schedule = validate_batch_size_schedule([[1, 2, 5], [4, 6, 2], [10, 12, 0]])
    lookup = build_batch_size_lookup(schedule, max_batch_size=14, max_k=4)
    assert [batch_size_k(schedule, bs, 4) for bs in range(15)] == lookup
    assert batch_size_k(schedule, 1000, 4) == 0 and batch_size_k(schedule, 3, 1) == 1


def test_draft_gate_cuts_low_survival_to_zero_and_reprobes():
    gate = DraftGate(min_survival=0.3, probe_interval=3)
    probs = np.array([[0.9, 0.8, 0.5], [0.2, 0.9, 0.9], [0.6, 0.4, 0.9]])  # survival .9 .72 .36 / .2 / .6 .24
    keep = np.array([3, 3, 1])
    assert gate.apply(["a", "b", "c"], probs, keep).tolist() == [3, 0, 1]
    assert gate.apply(["a", "b", "c"], probs, keep).tolist() == [3, 0, 1]
    assert gate.apply(["a", "b", "c"], probs, keep).tolist() == [3, 1, 1]  # "b" idle for 3 steps: one probe
    assert gate.apply(["b"], probs[1:2], keep[1:2]).tolist() == [0]  # the idle count restarts after a probe
    gate.remove("b")
    off = DraftGate(0.0, probe_interval=2)  # no cut; a request at 0 (zero budget) is still probed
    assert off.apply(["x"], probs[1:2], np.array([0])).tolist() == [0]
    assert off.apply(["x"], probs[1:2], np.array([0])).tolist() == [1]
    with pytest.raises(ValueError):
        DraftGate(1.5)
    with pytest.raises(ValueError, match="min_draft_survival"):
        DynamicSpecParams(min_draft_survival=-0.1)
    with pytest.raises(ValueError, match="probe_interval"):
        DynamicSpecParams(probe_interval=0)


def test_failed_probes_back_off_and_drafting_resets_the_interval():
    """A probe that does not earn the request its drafts back doubles its probe interval (up to PROBE_BACKOFF x);
    once the request drafts on its own merit again, the next idle spell probes at the base interval."""
    gate = DraftGate(min_survival=0.3, probe_interval=3)
    low, high, keep = np.array([[0.2, 0.9]]), np.array([[0.9, 0.9]]), np.array([2])
    probe_steps = [step for step in range(1, 40) if gate.apply(["r"], low, keep)[0] == 1]
    assert probe_steps == [3, 9, 21, 33]  # gaps 3, 6, 12, then capped at PROBE_BACKOFF * 3 = 12
    assert PROBE_BACKOFF == 4
    assert gate.apply(["r"], high, keep).tolist() == [2]  # drafting again: the backoff is forgotten
    assert [gate.apply(["r"], low, keep)[0] for _ in range(3)] == [0, 0, 1]
    gate.remove("r")
    assert not gate._interval and not gate._probed and not gate._idle


def test_always_rejected_request_drops_to_zero_with_probes():
    """AcceptanceStats + scheduler + gate: a request that never gets a draft accepted ends up drafting only on
    probe steps, while an always-accepted one keeps k."""
    k = 3
    params = DynamicSpecParams(min_draft_survival=0.25, probe_interval=4)
    stats, sched, gate = AcceptanceStats(k), DynamicSpecScheduler(k, params), DraftGate(0.25, 4)
    history = {"good": [], "bad": []}
    for _ in range(60):
        probs = stats.token_probs(list(history))
        keep = gate.apply(list(history), probs, sched.update(probs))
        for r, n in zip(history, keep):
            history[r].append(int(n))
            if n:
                stats.record(r, int(n), int(n) if r == "good" else 0)
    bad_tail = history["bad"][-20:]
    assert bad_tail.count(0) >= 14 and 0 < sum(bad_tail) <= 6 and max(bad_tail) == 1
    assert history["good"][-10:] == [k] * 10


def test_no_probes_where_only_near_certain_drafts_could_pay():
    """A probe is there to find requests whose drafts would pay again; at a batch size where a lone first draft needs
    a survival above MAX_PROBE_BAR, the idle requests are not probed (each probe costs a token of a compute-bound
    step), while a batch size with a lower bar probes them on the shared probe step."""
    from ascent.spec_decode.dynamic import MAX_PROBE_BAR
    from tests.unit.test_spec_step_cost import _FixedCost

    ids, probs, drafted = ["a", "b"], np.full((2, 3), 0.1), np.array([3, 3])
    steep = _FixedCost(0.002, 0.004)  # bar = 0.004 * 2 / (0.002 + 0.008) = 0.8
    gentle = _FixedCost(0.006, 0.001)  # bar = 0.002 / 0.008 = 0.25
    for cost, probed in ((steep, False), (gentle, True)):
        gate = DraftGate(0.0, probe_interval=4, cost=cost)
        bar = gate._first_draft_bar(cost, 2)
        assert (bar > MAX_PROBE_BAR) is not probed
        outs = [gate.apply(ids, probs, drafted, drafted=True).tolist() for _ in range(8)]
        assert all(o == [0, 0] for i, o in enumerate(outs) if i != 3)  # 0.1 never pays alone
        assert outs[3] == ([1, 1] if probed else [0, 0])
