"""Placement maps and metrics against hand-computed cases (specs §1.2, §4)."""

from __future__ import annotations

import numpy as np
import pytest

from ascent.eplb.placement import imbalance, initial_placement, log2phy, move_stats, per_step_imbalance, \
    preserve_local_slots, preserve_slots, rank_loads, received_slots, replica_counts, slot_moves
from ascent.eplb.policy.validate import normalize_load, validate_placement


def test_initial_placement_matches_legacy_ut() -> None:
    assert initial_placement(1, 8, 2, 5)[0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]]


def test_log2phy_and_counts() -> None:
    placement = initial_placement(1, 8, 2, 5)
    assert replica_counts(placement, 8)[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    l2p = log2phy(placement, 8)[0]
    assert l2p[0].tolist() == [0, 8] and l2p[1].tolist() == [1, 9] and l2p[7].tolist() == [7, -1]


def test_rank_loads_split_replicas_evenly() -> None:
    placement = np.array([[[0, 1], [0, 2]]])
    weight = np.array([[10.0, 3.0, 5.0]])
    assert rank_loads(placement, weight)[0].tolist() == [8.0, 10.0]
    assert imbalance(placement, weight)[0] == pytest.approx(10.0 / 9.0)


def test_imbalance_reduces_over_ranks_per_layer_not_over_layers() -> None:
    # vLLM #51784/#51813: balancedness reduced over the wrong axis. Layer 0 is balanced, layer 1 is not.
    placement = np.array([[[0], [1]], [[0], [1]]])
    weight = np.array([[5.0, 5.0], [9.0, 1.0]])
    assert imbalance(placement, weight).tolist() == pytest.approx([1.0, 1.8])
    assert per_step_imbalance(placement, weight[None]).shape == (1, 2)


def test_moves_count_multisets_not_positions() -> None:
    old = np.array([[[0, 1, 1], [2, 3, 0]]])
    new = np.array([[[1, 0, 2], [0, 3, 0]]])
    assert received_slots(old, new).tolist() == [[1, 1]]
    assert slot_moves(old, new).tolist() == [2]
    stats = move_stats(old, new, bytes_per_expert=10)
    assert stats == {"slots_moved": 2, "bytes_moved": 20, "max_rank_receive_bytes": 10}


def test_preserve_local_slots_keeps_retained_experts_in_place() -> None:
    out = preserve_local_slots(np.array([4, 5, 6, 5]), np.array([7, 5, 6, 8]))
    assert out.tolist() == [7, 5, 6, 8]
    out = preserve_local_slots(np.array([4, 5, 6]), np.array([6, 9, 4]))
    assert out.tolist() == [4, 9, 6]
    old = np.array([[[1, 2], [3, 0]]])
    assert preserve_slots(old, np.array([[[2, 0], [0, 3]]])).tolist() == [[[0, 2], [3, 0]]]


def test_validate_placement_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="no replica"):
        validate_placement(np.array([[[0, 0], [1, 1]]]), num_experts=3)
    with pytest.raises(ValueError, match="outside"):
        validate_placement(np.array([[[0, -1], [1, 2]]]))
    with pytest.raises(ValueError, match="shape"):
        validate_placement(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="dtype"):
        validate_placement(np.zeros((1, 2, 1)))
    assert validate_placement(np.array([[[0, 1], [2, 0]]])) == 3


def test_normalize_load_shapes_and_values() -> None:
    assert normalize_load(np.ones((3, 4)), 3).shape == (1, 3, 4)
    with pytest.raises(ValueError, match="negative"):
        normalize_load(-np.ones((1, 3, 4)), 3)
    with pytest.raises(ValueError, match="shape"):
        normalize_load(np.ones((2, 4, 4)), 3)
