"""The original implementation's known bugs (specs §2, §7) must be absent; each test is named after one."""

from __future__ import annotations

import numpy as np
import pytest

from ascent.eplb.placement import initial_placement, replica_counts, slot_moves
from ascent.eplb.policy import PolicyFactory
from ascent.eplb.policy.flashlb import FlashLB, minimize_redeploy, peak_to_average, sample_series, statistics
from ascent.eplb.policy.swift import redundant_assignments, split_original_redundant


def test_swift_biased_per_copy_estimate_absent() -> None:
    # original: per-copy estimate 2w/(k+2) -> the 2nd copy would go to expert 0 again (20/3 > 6).
    weight = np.array([10.0, 6.0, 1.0])
    picks = redundant_assignments(weight, np.ones(3, dtype=bool), 2, max_copies=4)
    assert sorted(picks.tolist()) == [0, 1]


def test_swift_original_scan_is_slot_major() -> None:
    redundant, origin = split_original_redundant(np.array([[0, 1], [1, 2]]))
    assert redundant.tolist() == [[False, True], [False, False]] and origin.tolist() == [0, 1, 1]


def test_flashlb_nonpriority_layers_not_returned() -> None:
    # original: the returned table also held re-planned layers with delta <= 0, which the worker applied.
    rng = np.random.default_rng(0)
    placement = initial_placement(4, 16, 4, 5)
    load = rng.random((20, 4, 16)) ** 8 * 100
    load[:, 0] = 50.0
    load[:, 0, :4] = 101.0  # two copies of experts 0-3 in the initial layout: with +1 smoothing all slots = 51
    policy = FlashLB()
    changed, order, new = policy.rebalance_experts(placement, load)
    assert changed and 0 not in order.tolist()
    assert np.array_equal(new[0], placement[0])
    assert set(policy.last_ratio) == set(order.tolist())


def test_flashlb_buffer_length_fixed_at_first_call_absent() -> None:
    rng = np.random.default_rng(1)
    placement = initial_placement(2, 8, 2, 5)
    policy = FlashLB()
    policy.rebalance_experts(placement, rng.random((3, 2, 8)))
    _, _, new = policy.rebalance_experts(placement, rng.random((90, 2, 8)) ** 6)
    assert (replica_counts(new, 8) >= 1).all()


def test_unknown_policy_silent_random_fallback_absent() -> None:
    with pytest.raises(ValueError, match="unknown EPLB policy 'nope'"):
        PolicyFactory.generate_policy("nope")
    with pytest.raises(ValueError, match="7"):
        PolicyFactory.generate_policy(7)
    assert PolicyFactory.generate_policy(2).name == "swift"


def test_invalid_table_applied_absent() -> None:
    # #9151 / check_expert_placement: a table that loses an expert is rejected before use.
    placement = np.array([[[0, 1], [2, 2]]])
    with pytest.raises(ValueError, match="no replica"):
        PolicyFactory.generate_policy("default").rebalance_experts(placement, np.ones((1, 4)))


def test_deepseek_duplicate_replica_on_one_rank_absent() -> None:
    rng = np.random.default_rng(2)
    load = rng.random((3, 32)) ** 10 * 1000
    for name in ("default", "swift", "flashlb"):
        _, _, new = PolicyFactory.generate_policy(name).rebalance_experts(initial_placement(3, 32, 8, 5), load)
        assert all(len(set(row.tolist())) == row.size for row in new.reshape(-1, 5)), name


def test_movement_inside_one_rank_absent() -> None:
    rng = np.random.default_rng(3)
    placement = initial_placement(2, 24, 4, 8)
    load = rng.random((2, 24)) ** 6 * 100
    for name in ("default", "swift", "flashlb"):
        _, _, new = PolicyFactory.generate_policy(name).rebalance_experts(placement, load)
        kept = np.array([[np.isin(new[l, r], placement[l, r]) for r in range(4)] for l in range(2)])
        assert np.array_equal(new[kept], placement[kept]), name


def test_flashlb_statistics_match_numpy() -> None:
    rng = np.random.default_rng(4)
    samples = rng.random((7, 2, 5))
    mean, var, cov = statistics(samples)
    for layer in range(2):
        ref = np.cov(samples[:, layer].T)
        assert np.allclose(cov[layer], ref) and np.allclose(var[layer], np.diag(ref))
        assert np.allclose(mean[layer], samples[:, layer].mean(axis=0))
    assert sample_series(np.ones((100, 1, 2)), 64).shape == (64, 1, 2)


def test_flashlb_score_and_redeploy() -> None:
    samples = np.array([[[4.0, 2.0, 2.0]]])
    dep = np.array([[[0], [1], [2]]])
    score = peak_to_average(samples, np.array([0]), np.ones((1, 3), dtype=np.int64), dep)
    assert score[0] == pytest.approx((4.0 * 3 + 0.01) / (8.0 + 0.01))
    current = np.array([[0, 1], [2, 3], [4, 0]])
    assert slot_moves(current[None], minimize_redeploy(current, current[[2, 0, 1], ::-1])[None])[0] == 0
