"""Policy 1: DeepSeek-style balanced packing with redundancy, hierarchical and global branches (specs §2.2, §2.6).

Replication: each redundant slot goes to the expert with the largest per-copy load ``w / count`` (at most one copy
per rank, so an expert never gets more copies than ranks). Packing: replicas by per-copy load descending, each onto
the lightest rank with a free slot that does not hold the expert yet (if every free rank holds it, the lightest
free rank). Hierarchical (``num_nodes > 1`` and ``num_groups % num_nodes == 0``): expert groups are first packed onto
nodes (equal group count per node), then each node replicates and packs its own experts. Experts that stay on a rank
keep their slot; a layer is only replaced when its estimated max rank load drops.
"""

from __future__ import annotations

import numpy as np

from ascent.eplb.placement import preserve_slots, rank_loads
from ascent.eplb.policy.base import EplbPolicy, select_layers


def replicate(weight: np.ndarray, num_slots: int, max_copies: int) -> np.ndarray:
    """``weight`` float [B, n] -> int64 replica counts [B, n] summing to ``num_slots`` per row, each in
    ``[1, max_copies]`` when possible (greedy argmax of weight / count, ties to the lower id)."""
    batch, n = weight.shape
    if num_slots < n:
        raise ValueError(f"num_slots={num_slots} < experts={n}")
    counts = np.ones((batch, n), dtype=np.int64)
    rows = np.arange(batch)
    for _ in range(num_slots - n):
        per_copy = weight / counts
        capped = np.where(counts >= max_copies, -np.inf, per_copy)
        full = np.isneginf(capped).all(axis=1)
        pick = np.where(full, per_copy.argmax(axis=1), capped.argmax(axis=1))
        counts[rows, pick] += 1
    return counts


def pack(weight: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Greedy LPT packing of replicas. ``weight`` float [B, n], ``counts`` int [B, n] with row sums
    ``num_ranks * slots_per_rank`` -> int64 [B, num_ranks, slots_per_rank] expert indices in ``[0, n)``."""
    batch, n = weight.shape
    total = num_ranks * slots_per_rank
    if not (counts.sum(axis=1) == total).all():
        raise ValueError(f"replica counts must sum to {total} per row, got {counts.sum(axis=1).tolist()}")
    items = np.repeat(np.tile(np.arange(n), batch), counts.ravel()).reshape(batch, total)
    unit = np.take_along_axis(weight / counts, items, axis=1)
    order = np.argsort(-unit, axis=1, kind="stable")
    items, unit = np.take_along_axis(items, order, axis=1), np.take_along_axis(unit, order, axis=1)
    rows = np.arange(batch)
    loads = np.zeros((batch, num_ranks))
    fill = np.zeros((batch, num_ranks), dtype=np.int64)
    holds = np.zeros((batch, num_ranks, n), dtype=bool)
    out = np.zeros((batch, num_ranks, slots_per_rank), dtype=np.int64)
    for i in range(total):
        expert = items[:, i]
        free = fill < slots_per_rank
        ok = free & ~holds[rows, :, expert]
        ok = np.where(ok.any(axis=1, keepdims=True), ok, free)
        rank = np.where(ok, loads, np.inf).argmin(axis=1)
        out[rows, rank, fill[rows, rank]] = expert
        fill[rows, rank] += 1
        loads[rows, rank] += unit[:, i]
        holds[rows, rank, expert] = True
    return out


def balanced_placement(weight: np.ndarray, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Global branch: float [B, n] -> int64 [B, R, S] expert indices."""
    counts = replicate(weight, num_ranks * slots_per_rank, num_ranks)
    return pack(weight, counts, num_ranks, slots_per_rank)


def hierarchical_placement(weight: np.ndarray, num_ranks: int, slots_per_rank: int, num_groups: int,
                           num_nodes: int) -> np.ndarray:
    """Hierarchical branch: float [L, E] -> int64 [L, R, S] logical ids."""
    layers, num_experts = weight.shape
    if num_experts % num_groups or num_groups % num_nodes or num_ranks % num_nodes:
        raise ValueError(f"experts={num_experts}, num_groups={num_groups}, ranks={num_ranks} must be divisible "
                         f"by num_groups / num_nodes={num_nodes}")
    group_size = num_experts // num_groups
    group_w = weight.reshape(layers, num_groups, group_size).sum(axis=2)
    node_groups = pack(group_w, np.ones_like(group_w, dtype=np.int64), num_nodes, num_groups // num_nodes)
    experts = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(layers * num_nodes, -1)
    node_w = np.take_along_axis(np.repeat(weight, num_nodes, axis=0), experts, axis=1)
    local = balanced_placement(node_w, num_ranks // num_nodes, slots_per_rank)
    ids = np.take_along_axis(experts, local.reshape(layers * num_nodes, -1), axis=1)
    return ids.reshape(layers, num_ranks, slots_per_rank)


class DefaultEplb(EplbPolicy):
    """DeepSeek-style rebalance. ``min_gain``: the re-planned layers are only applied when the sum over layers of
    the max rank load drops by at least this fraction (legacy: 5 %)."""

    name = "default"

    def __init__(self, num_groups: int = 1, num_nodes: int = 1, min_gain: float = 0.05) -> None:
        if num_groups < 1 or num_nodes < 1 or not 0 <= min_gain < 1:
            raise ValueError(f"num_groups={num_groups}, num_nodes={num_nodes}, min_gain={min_gain} invalid")
        self.num_groups, self.num_nodes, self.min_gain = num_groups, num_nodes, min_gain

    def plan(self, weight: np.ndarray, num_ranks: int, slots_per_rank: int) -> np.ndarray:
        """Placement for [L, E] weights, ignoring the current one."""
        if self.num_nodes > 1 and self.num_groups % self.num_nodes == 0:
            return hierarchical_placement(weight, num_ranks, slots_per_rank, self.num_groups, self.num_nodes)
        return balanced_placement(weight, num_ranks, slots_per_rank)

    def _rebalance(self, placement: np.ndarray, load: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        weight = load.sum(axis=0)
        _, ranks, slots = placement.shape
        new = preserve_slots(placement, self.plan(weight, ranks, slots))
        before, after = rank_loads(placement, weight).max(axis=1), rank_loads(new, weight).max(axis=1)
        if after.sum() >= (1 - self.min_gain) * before.sum():
            return np.zeros(0, dtype=np.int64), placement.copy()
        return select_layers(placement, new, before, after)
