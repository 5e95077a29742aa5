"""Move-minimising helpers of FlashLB (numpy only): relabel a planned placement onto the current ranks with a greedy
maximum-overlap matching, and build an incremental plan that starts from the current placement.

* :func:`match_ranks`: rows of the plan are assigned to current ranks greedily by descending overlap (multiset
  intersection of the two rows; ties to the lower current rank, then the lower plan row), then experts that stay on a
  rank keep their slot (:func:`ascent.eplb.placement.preserve_slots`). Greedy matching keeps at least half the optimal
  overlap (it is a 1/2-approximation of maximum-weight matching) and in practice almost all of it.
* :func:`incremental_plan`: reach the target replica counts from the current placement with few moves — surplus
  replicas leave the most loaded ranks, missing replicas (heaviest per-copy first) fill the freed slots on the least
  loaded rank that does not hold the expert yet — then the pairwise swap refinement of SwiftBalancer reduces the peak.
"""

from __future__ import annotations

import numpy as np

from ascent.eplb.placement import preserve_slots
from ascent.eplb.policy.swap import swap_experts


def _row_hist(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """[B, R, S] -> int64 [B, R, E] occurrence counts per row."""
    batch, ranks, _ = rows.shape
    offsets = (np.arange(batch * ranks) * num_experts).reshape(batch, ranks, 1)
    hist = np.bincount((rows + offsets).ravel(), minlength=batch * ranks * num_experts)
    return hist.reshape(batch, ranks, num_experts)


def match_ranks(current: np.ndarray, plan: np.ndarray) -> np.ndarray:
    """Relabel the rows of ``plan`` [B, R, S] onto the ranks of ``current`` [B, R, S] (greedy max overlap), then keep
    retained experts in their old slot."""
    batch, ranks, _ = current.shape
    num = int(max(current.max(), plan.max())) + 1
    h_cur, h_plan = _row_hist(current, num), _row_hist(plan, num)
    overlap = np.zeros((batch, ranks, ranks))
    for k in range(1, int(max(h_cur.max(), h_plan.max())) + 1):  # sum_e min(a, b) = sum_k sum_e [a >= k][b >= k]
        overlap += np.matmul((h_cur >= k).astype(np.float64), (h_plan >= k).astype(np.float64).transpose(0, 2, 1))
    ar = np.arange(batch)
    target = np.empty((batch, ranks), dtype=np.int64)
    for _ in range(ranks):
        flat = overlap.reshape(batch, -1).argmax(axis=1)
        rank, row = np.divmod(flat, ranks)
        target[ar, rank] = row
        overlap[ar, rank, :] = -1.0
        overlap[ar, :, row] = -1.0
    relabelled = np.take_along_axis(plan, target[:, :, None], axis=1)
    return preserve_slots(current, relabelled)


def _remove_surplus(rows: np.ndarray, counts: np.ndarray, target: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Blank (-1) ``counts - target`` replicas of every over-replicated expert, taken from its most loaded ranks."""
    batch, ranks, slots = rows.shape
    num = counts.shape[1]
    loads = np.take_along_axis(unit, rows.reshape(batch, -1), axis=1).reshape(rows.shape).sum(axis=2)
    flat = rows.reshape(-1)
    key_group = (np.arange(batch)[:, None] * num + rows.reshape(batch, -1)).ravel()
    key_load = -np.repeat(loads.reshape(-1), slots)
    order = np.lexsort((key_load, key_group))
    group = key_group[order]
    starts = np.searchsorted(group, group, side="left")
    occurrence = np.empty(flat.size, dtype=np.int64)
    occurrence[order] = np.arange(flat.size) - starts
    surplus = np.maximum(counts - target, 0).reshape(-1)[key_group]
    out = flat.copy()
    out[occurrence < surplus] = -1
    return out.reshape(rows.shape)


def _add_missing(out: np.ndarray, counts: np.ndarray, target: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Fill the blank slots (in place) with the missing replicas, heaviest per-copy first, each on the least loaded
    rank with a blank slot that does not hold the expert. Returns bool [B]: every replica found such a rank."""
    batch, ranks, slots = out.shape
    ar = np.arange(batch)
    missing = np.maximum(target - np.minimum(counts, target), 0)
    copies = np.repeat(np.tile(np.arange(counts.shape[1]), batch), missing.ravel())
    owner = np.repeat(ar, missing.sum(axis=1))
    per_row = missing.sum(axis=1)
    width = int(per_row.max(initial=0))
    items = np.full((batch, width), -1, dtype=np.int64)
    pos = np.arange(copies.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    items[owner, pos] = copies
    key = np.where(items >= 0, -np.take_along_axis(unit, np.maximum(items, 0), axis=1), np.inf)
    items = np.take_along_axis(items, np.argsort(key, axis=1, kind="stable"), axis=1)
    safe = np.maximum(out, 0)
    loads = np.where(out >= 0, np.take_along_axis(unit, safe.reshape(batch, -1), 1).reshape(out.shape), 0).sum(2)
    holds = np.zeros((batch, ranks, counts.shape[1]), dtype=bool)
    b_idx, r_idx, s_idx = np.nonzero(out >= 0)
    holds[b_idx, r_idx, out[b_idx, r_idx, s_idx]] = True
    ok_all = np.ones(batch, dtype=bool)
    for i in range(width):
        expert = items[:, i]
        e = np.maximum(expert, 0)
        ok = (out == -1).any(axis=2) & ~holds[ar, :, e]
        g = np.flatnonzero((expert >= 0) & ok.any(axis=1))
        dst = np.where(ok[g], loads[g], np.inf).argmin(axis=1)
        slot = (out[g, dst] == -1).argmax(axis=1)
        out[g, dst, slot] = expert[g]
        holds[g, dst, expert[g]] = True
        loads[g, dst] += unit[g, expert[g]]
        for b in np.flatnonzero((expert >= 0) & ~ok.any(axis=1)):
            ok_all[b] &= _relay(out[b], holds[b], loads[b], unit[b], int(expert[b]))
    return ok_all


def _relay(rows: np.ndarray, holds: np.ndarray, loads: np.ndarray, unit: np.ndarray, expert: int) -> bool:
    """Place ``expert`` when every rank with a blank slot already holds it (in place): the least loaded rank ``q``
    without it gives one of its experts ``x`` (not on the blank rank ``r``) to ``r``'s blank slot and takes
    ``expert`` in ``x``'s slot (two moves). Returns False if no such relay exists."""
    for r in np.argsort(loads, kind="stable"):
        if not (rows[r] == -1).any():
            continue
        for q in np.argsort(loads, kind="stable"):
            if holds[q, expert]:
                continue
            slots = [s for s in range(rows.shape[1]) if rows[q, s] >= 0 and not holds[r, rows[q, s]]]
            if not slots:
                continue
            s = min(slots, key=lambda k: unit[rows[q, k]])
            x, free = int(rows[q, s]), int(np.flatnonzero(rows[r] == -1)[0])
            rows[r, free], rows[q, s] = x, expert
            holds[r, x], holds[q, x], holds[q, expert] = True, False, True
            loads[r] += unit[x]
            loads[q] += unit[expert] - unit[x]
            return True
    return False


def incremental_plan(current: np.ndarray, target: np.ndarray, weight: np.ndarray, swap_fraction: float = 0.01,
                     max_swaps: int = 100, num_max_com: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """current [B, R, S] placements, target [B, E] replica counts (row sums R*S, each in [1, R]), weight [B, E] expert
    loads. Returns (plan [B, R, S], bool [B] valid: no expert twice on a rank)."""
    batch = current.shape[0]
    offsets = (np.arange(batch) * target.shape[1])[:, None]
    counts = np.bincount((current.reshape(batch, -1) + offsets).ravel(),
                         minlength=target.size).reshape(target.shape)
    unit = weight / np.maximum(target, 1)
    out = _remove_surplus(current, counts, target, unit)
    valid = _add_missing(out, counts, target, unit)
    comm = np.zeros((batch, current.shape[1], current.shape[1]), dtype=np.int64)
    threshold = swap_fraction * weight.sum(axis=1) / current.shape[1]
    plan = swap_experts(out, unit, comm, threshold, max_swaps, num_max_com)
    return preserve_slots(current, plan), valid
