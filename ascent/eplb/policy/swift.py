"""Policy 2: SwiftBalancer — bounded-move rebalancing for low-bandwidth interconnects (specs §2.3).

Per layer whose imbalance reaches ``imbalance_threshold``: original replicas stay in place; the redundant slots are
re-assigned (greedy argmax of the *exact* per-copy load ``w / count`` — the original's biased ``2w/(k+2)`` estimate is
not copied), distributed heaviest first to the least-loaded rank under a per-rank-pair transfer budget, leftovers
filled; then pairwise swaps between the hottest rank and the others reduce the peak. Optionally all of this is
restricted to each node (``node_local=True``). A layer is only changed when its imbalance drops.

All steps are vectorised over the layers (and node blocks): each layer evolves exactly as the per-layer algorithm
(kept as the test oracle in ``tests/unit/eplb/swift_reference.py``). One fix over the previous per-layer code: blank
redundant slots no longer clear "rank holds expert 0", which could put a second copy of expert 0 on a rank.
"""

from __future__ import annotations

import numpy as np

from ascent.eplb.placement import imbalance, preserve_slots, rank_loads
from ascent.eplb.policy.base import EplbPolicy, select_layers
from ascent.eplb.policy.swap import swap_experts


def split_original_redundant_batch(rows: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Scan each ``rows[b]`` [R, S] slot-major (slot 0 of every rank, then slot 1, ...): the first occurrence of an
    expert is its original. Returns (bool [B, R, S] redundant mask, int64 [B, E] origin rank, -1 if absent)."""
    batch, ranks, slots = rows.shape
    flat = rows.transpose(0, 2, 1).reshape(batch, -1)
    order = np.argsort(flat, axis=1, kind="stable")
    ids = np.take_along_axis(flat, order, axis=1)
    first = np.ones(ids.shape, dtype=bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    b_idx, pos = np.nonzero(first)
    first_pos = order[b_idx, pos]
    redundant = np.ones(flat.shape, dtype=bool)
    redundant[b_idx, first_pos] = False
    origin = np.full((batch, num_experts), -1, dtype=np.int64)
    origin[b_idx, flat[b_idx, first_pos]] = first_pos % ranks
    return redundant.reshape(batch, slots, ranks).transpose(0, 2, 1), origin


def split_original_redundant(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Single-layer form of :func:`split_original_redundant_batch` (``E = max id + 1``)."""
    redundant, origin = split_original_redundant_batch(rows[None], int(rows.max()) + 1)
    return redundant[0], origin[0]


def redundant_assignments_batch(weight: np.ndarray, present: np.ndarray, num_copies: np.ndarray,
                                max_copies: int) -> tuple[np.ndarray, np.ndarray]:
    """Extra copies for ``num_copies[b]`` redundant slots per row: greedy argmax of ``weight / count`` over
    ``present`` experts with ``count < max_copies``. Returns (int64 [B, K] expert ids, heaviest per-copy load first,
    -1 padded; int64 [B, E] replica counts including the copies)."""
    batch = weight.shape[0]
    ar = np.arange(batch)
    counts = present.astype(np.float64)
    width = int(num_copies.max(initial=0))
    picks = np.full((batch, width), -1, dtype=np.int64)
    stopped = np.zeros(batch, dtype=bool)
    for m in range(width):
        score = np.where(present & (counts < max_copies), weight / np.maximum(counts, 1), -np.inf)
        expert = score.argmax(axis=1)
        due = (m < num_copies) & ~stopped
        stopped |= due & np.isneginf(score[ar, expert])
        take = due & ~stopped
        counts[ar[take], expert[take]] += 1
        picks[take, m] = expert[take]
    valid = picks >= 0
    safe = np.maximum(picks, 0)
    denom = np.where(valid, np.take_along_axis(counts, safe, 1), 1.0)
    key = np.where(valid, -(np.take_along_axis(weight, safe, 1) / denom), np.inf)
    picks = np.take_along_axis(picks, np.argsort(key, axis=1, kind="stable"), axis=1)
    return picks, counts.astype(np.int64)


def redundant_assignments(weight: np.ndarray, present: np.ndarray, num_copies: int, max_copies: int) -> np.ndarray:
    """Single-layer form of :func:`redundant_assignments_batch`: the copies' expert ids, heaviest first."""
    picks, _ = redundant_assignments_batch(weight[None], present[None], np.array([num_copies]), max_copies)
    return picks[0][picks[0] >= 0]


def _distribute(out: np.ndarray, copies: np.ndarray, origin: np.ndarray, unit: np.ndarray, loads: np.ndarray,
                holds: np.ndarray, comm: np.ndarray, num_max_com: int) -> None:
    """Step 4 (in place): each copy, heaviest first, to the least-loaded rank with a free redundant slot that does
    not hold the expert and is within the transfer budget from the expert's origin rank."""
    ar = np.arange(out.shape[0])
    for i in range(copies.shape[1]):
        expert = copies[:, i]
        safe = np.maximum(expert, 0)
        src = origin[ar, safe]
        ok = (out == -1).any(axis=2) & ~holds[ar, :, safe] & (comm[ar, np.maximum(src, 0)] < num_max_com)
        ok &= (expert >= 0)[:, None]
        g = np.flatnonzero(ok.any(axis=1))
        dst = np.where(ok[g], loads[g], np.inf).argmin(axis=1)
        slot = (out[g, dst] == -1).argmax(axis=1)
        out[g, dst, slot] = expert[g]
        holds[g, dst, expert[g]] = True
        loads[g, dst] += unit[g, expert[g]]
        comm[g, src[g], dst] += 1


def _fill_leftovers(out: np.ndarray, present: np.ndarray, unit: np.ndarray, holds: np.ndarray) -> None:
    """Step 5 (in place): remaining free slots, in rank-major order, get the heaviest per-copy expert not on that
    rank (transfer budget ignored)."""
    batch, _, slots = out.shape
    while True:
        free = out.reshape(batch, -1) == -1
        g = np.flatnonzero(free.any(axis=1))
        if g.size == 0:
            return
        rank, slot = np.divmod(free[g].argmax(axis=1), slots)
        expert = np.where(present[g] & ~holds[g, rank], unit[g], -np.inf).argmax(axis=1)
        out[g, rank, slot] = expert
        holds[g, rank, expert] = True


def redeploy(rows: np.ndarray, weight: np.ndarray, comm: np.ndarray, num_max_com: int) -> np.ndarray:
    """Steps 1-5 on a batch of rank blocks: rows [B, r, S], weight [B, E], comm [B, r, r] (updated in place)."""
    batch, ranks, slots = rows.shape
    redundant, origin = split_original_redundant_batch(rows, weight.shape[1])
    present = np.zeros(weight.shape, dtype=bool)
    b_idx = np.broadcast_to(np.arange(batch)[:, None, None], rows.shape)
    present[b_idx[~redundant], rows[~redundant]] = True
    copies, counts = redundant_assignments_batch(weight, present, redundant.sum(axis=(1, 2)), ranks)
    counts = present.astype(np.int64)
    valid = copies >= 0
    np.add.at(counts, (np.broadcast_to(np.arange(batch)[:, None], copies.shape)[valid], copies[valid]), 1)
    unit = weight / np.maximum(counts, 1)
    out = np.where(redundant, -1, rows)
    slot_unit = np.take_along_axis(unit, np.maximum(out, 0).reshape(batch, -1), axis=1).reshape(rows.shape)
    loads = np.where(redundant, 0.0, slot_unit).sum(axis=2)
    holds = np.zeros((batch, ranks, weight.shape[1]), dtype=bool)
    r_idx = np.broadcast_to(np.arange(ranks)[None, :, None], rows.shape)
    holds[b_idx[~redundant], r_idx[~redundant], rows[~redundant]] = True
    _distribute(out, copies, origin, unit, loads, holds, comm, num_max_com)
    _fill_leftovers(out, present, unit, holds)
    return out


def swap_thresholds(rows: np.ndarray, weight: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-copy loads ``weight / count`` [B, E] of ``rows`` [B, r, S] and the swap threshold ``fraction`` x mean
    rank load of the experts present [B]."""
    batch = rows.shape[0]
    offsets = (np.arange(batch) * weight.shape[1])[:, None]
    counts = np.bincount((rows.reshape(batch, -1) + offsets).ravel(), minlength=weight.size).reshape(weight.shape)
    thr = np.array([fraction * weight[b][counts[b] > 0].sum() / rows.shape[1] for b in range(batch)])
    return weight / np.maximum(counts, 1), thr


class SwiftBalanceEplb(EplbPolicy):
    """SwiftBalancer. ``ranks_per_node`` with ``node_local`` restricts redundancy and swaps to each node."""

    name = "swift"

    def __init__(self, imbalance_threshold: float = 1.01, max_swap_times: int = 100, num_max_com: int = 1,
                 swap_threshold: float = 0.01, ranks_per_node: int | None = None, node_local: bool = False,
                 min_gain: float = 0.0) -> None:
        if imbalance_threshold < 1 or max_swap_times < 0 or num_max_com < 1 or swap_threshold < 0:
            raise ValueError(f"imbalance_threshold={imbalance_threshold}, max_swap_times={max_swap_times}, "
                             f"num_max_com={num_max_com}, swap_threshold={swap_threshold} invalid")
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")
        if not 0 <= min_gain < 1:
            raise ValueError(f"min_gain={min_gain} must be in [0, 1)")
        self.imbalance_threshold, self.max_swap_times = imbalance_threshold, max_swap_times
        self.num_max_com, self.swap_threshold = num_max_com, swap_threshold
        self.ranks_per_node, self.node_local, self.min_gain = ranks_per_node, node_local, min_gain

    def _block_size(self, ranks: int) -> int:
        size = self.ranks_per_node if self.node_local and self.ranks_per_node else ranks
        if ranks % size:
            raise ValueError(f"ranks={ranks} not divisible by ranks_per_node={size}")
        return size

    def balance_layers(self, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Layers [B, R, S] with weights [B, E] -> new placements (a layer keeps its rows unless imbalance drops)."""
        batch, ranks, slots = rows.shape
        size = self._block_size(ranks)
        blocks = rows.reshape(batch * (ranks // size), size, slots)
        block_w = np.repeat(weight, ranks // size, axis=0)
        comm = np.zeros((blocks.shape[0], size, size), dtype=np.int64)
        placed = redeploy(blocks, block_w, comm, self.num_max_com)
        unit_of, thr = swap_thresholds(placed, block_w, self.swap_threshold)
        new = swap_experts(placed, unit_of, comm, thr, self.max_swap_times, self.num_max_com).reshape(rows.shape)
        better = imbalance(new, weight) < imbalance(rows, weight)
        return np.where(better[:, None, None], new, rows)

    def balance_layer(self, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """One layer: [R, S] placement, [E] weight -> new [R, S] placement (or ``rows`` if not better)."""
        return self.balance_layers(rows[None], weight[None])[0]

    def _rebalance(self, placement: np.ndarray, load: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        weight = load.sum(axis=0)
        start = imbalance(placement, weight)
        new = placement.copy()
        todo = np.flatnonzero(start >= self.imbalance_threshold)
        if todo.size:
            new[todo] = self.balance_layers(placement[todo], weight[todo])
        new = preserve_slots(placement, new)
        before, after = rank_loads(placement, weight).max(axis=1), rank_loads(new, weight).max(axis=1)
        if after.sum() >= (1 - self.min_gain) * before.sum():
            return np.zeros(0, dtype=np.int64), placement.copy()
        return select_layers(placement, new, before, after)
