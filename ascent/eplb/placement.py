"""Placement tables of expert-parallel MoE layers and the metrics computed on them (specs/eplb_moe_lora.md §1, §4).

A *placement* is an int64 array ``[layers, ranks, slots_per_rank]`` of logical expert ids; the physical id of
``placement[l, r, s]`` is ``r * slots_per_rank + s``. Every logical expert ``0..E-1`` holds >= 1 slot per layer. A
*weight* is a float array ``[layers, E]`` of logical expert loads (tokens); a replicated expert's load is split evenly
over its replicas.
"""

from __future__ import annotations

import numpy as np

DEEPSEEK_V3_EXPERT_BYTES = 3 * 7168 * 2048 * 2  # gated MLP, bf16


def initial_placement(num_layers: int, num_experts: int, num_ranks: int, slots_per_rank: int) -> np.ndarray:
    """Legacy initial layout: physical ``p`` holds expert ``p % E`` (``[0..E-1]`` then round-robin redundancy)."""
    total = num_ranks * slots_per_rank
    if total < num_experts:
        raise ValueError(f"num_ranks*slots_per_rank={total} < num_experts={num_experts}")
    row = np.arange(total, dtype=np.int64) % num_experts
    return np.broadcast_to(row.reshape(num_ranks, slots_per_rank), (num_layers, num_ranks, slots_per_rank)).copy()


def phy2log(placement: np.ndarray) -> np.ndarray:
    """``[L, P]`` logical id of each physical slot."""
    return placement.reshape(placement.shape[0], placement.shape[1] * placement.shape[2])


def replica_counts(placement: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E]`` int64 number of slots holding each logical expert."""
    flat = phy2log(placement)
    offsets = (np.arange(flat.shape[0], dtype=np.int64) * num_experts)[:, None]
    counts = np.bincount((flat + offsets).ravel(), minlength=flat.shape[0] * num_experts)
    return counts.reshape(flat.shape[0], num_experts)


def log2phy(placement: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, E, max_count]`` int64 physical ids of each logical expert's replicas in ascending order, -1 padded."""
    flat = phy2log(placement)
    counts = replica_counts(placement, num_experts)
    out = np.full((flat.shape[0], num_experts, max(int(counts.max()), 1)), -1, dtype=np.int64)
    for layer in range(flat.shape[0]):
        order = np.argsort(flat[layer], kind="stable")
        ids = flat[layer][order]
        starts = np.searchsorted(ids, ids, side="left")
        out[layer, ids, np.arange(ids.size) - starts] = order
    return out


def rank_loads(placement: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``[L, R]`` per-rank load: sum over the rank's slots of ``weight[l, e] / replica_count[l, e]``."""
    counts = replica_counts(placement, weight.shape[-1])
    unit = weight / np.maximum(counts, 1)
    per_slot = np.take_along_axis(unit, phy2log(placement), axis=1)
    return per_slot.reshape(placement.shape).sum(axis=2)


def imbalance(placement: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``[L]`` peak-to-average ratio max_r / mean_r of :func:`rank_loads` (1.0 for an all-zero layer)."""
    loads = rank_loads(placement, weight)
    mean = loads.mean(axis=1)
    return np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def per_step_imbalance(placement: np.ndarray, load: np.ndarray) -> np.ndarray:
    """``[T, L]`` imbalance of each step of a ``[T, L, E]`` load series under a fixed placement."""
    return np.stack([imbalance(placement, step) for step in load])


def _row_overlap(old: np.ndarray, new: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, R]`` multiset intersection size of old and new rank rows."""
    layers, ranks, _ = old.shape
    offsets = (np.arange(layers * ranks, dtype=np.int64) * num_experts).reshape(layers, ranks, 1)
    size = layers * ranks * num_experts
    c_old = np.bincount((old + offsets).ravel(), minlength=size)
    c_new = np.bincount((new + offsets).ravel(), minlength=size)
    return np.minimum(c_old, c_new).reshape(layers, ranks, num_experts).sum(axis=2)


def received_slots(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``[L, R]`` slots each rank must receive: ``S - |multiset(old_r) ∩ multiset(new_r)|``."""
    if old.shape != new.shape:
        raise ValueError(f"placement shapes differ: {old.shape} vs {new.shape}")
    num_experts = int(max(old.max(), new.max())) + 1
    return old.shape[2] - _row_overlap(old, new, num_experts)


def slot_moves(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``[L]`` number of slots whose expert weights must be transferred between the two placements."""
    return received_slots(old, new).sum(axis=1)


def move_stats(old: np.ndarray, new: np.ndarray, bytes_per_expert: int = DEEPSEEK_V3_EXPERT_BYTES) -> dict:
    """Slots moved (total), bytes moved, and max per-rank receive bytes (max over layers and ranks)."""
    recv = received_slots(old, new)
    return {"slots_moved": int(recv.sum()), "bytes_moved": int(recv.sum()) * bytes_per_expert,
            "max_rank_receive_bytes": int(recv.max(initial=0)) * bytes_per_expert}


def preserve_local_slots(old_row: np.ndarray, new_row: np.ndarray) -> np.ndarray:
    """Reorder ``new_row`` (one rank's experts) so experts also in ``old_row`` keep their old slot index; the
    remaining new experts fill the vacated slots left to right in ``new_row`` order (multisets respected)."""
    out = np.full_like(old_row, -1)
    remaining = list(new_row.tolist())
    for slot, expert in enumerate(old_row.tolist()):
        if expert in remaining:
            remaining.remove(expert)
            out[slot] = expert
    free = np.flatnonzero(out == -1)
    out[free] = remaining
    return out


def preserve_slots(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """:func:`preserve_local_slots` for every (layer, rank) row of ``[..., S]`` placements, vectorised.

    Old slot ``i`` keeps its expert ``e`` iff ``e``'s occurrence index among ``old[:i]`` is below ``e``'s count in the
    new row; the first that-many occurrences of ``e`` in the new row are consumed; the unconsumed new experts (in
    new-row order) fill the freed slots left to right."""
    if old.shape != new.shape:
        raise ValueError(f"placement shapes differ: {old.shape} vs {new.shape}")
    slots = old.shape[-1]
    o, n = old.reshape(-1, slots), new.reshape(-1, slots)
    before = np.tri(slots, k=-1, dtype=bool)  # before[i, j]: j < i
    occ_old = ((o[:, :, None] == o[:, None, :]) & before).sum(axis=2)
    occ_new = ((n[:, :, None] == n[:, None, :]) & before).sum(axis=2)
    kept = occ_old < (o[:, :, None] == n[:, None, :]).sum(axis=2)
    consumed = occ_new < (n[:, :, None] == o[:, None, :]).sum(axis=2)
    free = np.argsort(kept, axis=1, kind="stable")  # freed slots first, left to right
    rest = np.argsort(consumed, axis=1, kind="stable")  # unconsumed new experts first, in new-row order
    out = np.where(kept, o, -1)
    fill = np.arange(slots)[None, :] < (~kept).sum(axis=1, keepdims=True)
    rows = np.broadcast_to(np.arange(o.shape[0])[:, None], fill.shape)
    out[rows[fill], free[fill]] = np.take_along_axis(n, rest, axis=1)[fill]
    return out.reshape(old.shape)
