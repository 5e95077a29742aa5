"""Pairwise expert swaps between the hottest rank and colder ranks, vectorised over a batch of layers (specs §2.3
step 6). Shared by SwiftBalancer (weights = logical load) and FlashLB's incremental plan (weights = mean load).

Per layer, up to ``max_swaps`` rounds: take the hottest rank ``h``; among the ranks ``j`` colder than
``load_h - threshold`` whose transfer budget to and from ``h`` is left (``comm < num_max_com``), find for each ``j`` the
pair (slot ``a`` on ``h``, slot ``b`` on ``j``) minimising ``max(load_h - u_a + u_b, load_j - u_b + u_a)``, where the
two experts are not on the other rank yet and neither slot was swapped before; among the ``j`` whose best pair lowers the
peak by at least ``threshold`` pick the least-loaded ``j``, swap, and charge ``comm[h, j]`` and ``comm[j, h]``. A layer
stops when no swap qualifies. Each layer of the batch evolves exactly as if it were processed alone.
"""

from __future__ import annotations

import numpy as np


def _slot_units(rows: np.ndarray, unit_of: np.ndarray) -> np.ndarray:
    """Per-slot load ``[n, R, S]`` of ``rows`` under per-copy loads ``unit_of`` [n, E]."""
    n = rows.shape[0]
    return np.take_along_axis(unit_of, rows.reshape(n, -1), axis=1).reshape(rows.shape)


def _round(rows: np.ndarray, moved: np.ndarray, comm: np.ndarray, unit_of: np.ndarray, thr: np.ndarray,
           holds: np.ndarray, ids: np.ndarray, num_max_com: int) -> np.ndarray:
    """One swap round for every layer of the working set (arrays updated in place; ``holds`` [B, R, E] is indexed
    by the working set's batch ids ``ids``). Returns bool [n]: a swap happened (the others are finished)."""
    n, ranks, slots = rows.shape
    ar = np.arange(n)
    unit = _slot_units(rows, unit_of)
    loads = unit.sum(axis=2)
    h = loads.argmax(axis=1)
    lh = loads[ar, h]
    cand = (comm[ar, h, :] < num_max_com) & (comm[ar, :, h] < num_max_com) & (loads < (lh - thr)[:, None])
    cand[ar, h] = False
    rh = rows[ar, h]
    a_on_j = holds[ids[:, None, None], np.arange(ranks)[None, :, None], rh[:, None, :]]  # [n, j, a]
    b_on_h = holds[ids[:, None, None], h[:, None, None], rows]  # [n, j, b]
    # invalid pairs get an infinite cost through +inf / -inf per-copy loads (never inf - inf)
    u_a = np.where(cand[:, :, None] & ~moved[ar, h][:, None, :] & ~a_on_j, unit[ar, h][:, None, :], np.inf)
    u_b = np.where(~moved & ~b_on_h, unit, -np.inf)
    delta = u_a[:, :, :, None] - u_b[:, :, None, :]
    cost = lh[:, None, None, None] - delta
    np.add(loads[:, :, None, None], delta, out=delta)
    np.maximum(cost, delta, out=cost)
    cost = cost.reshape(n, ranks, slots * slots)
    best = cost.argmin(axis=2)
    gain = lh[:, None] - np.take_along_axis(cost, best[:, :, None], axis=2)[:, :, 0]
    good = cand & (gain >= np.maximum(thr, 1e-12)[:, None])
    swapped = good.any(axis=1)
    j = np.where(good, loads, np.inf).argmin(axis=1)
    g = np.flatnonzero(swapped)
    g_h, g_j, g_id = h[g], j[g], ids[g]
    a, b = np.divmod(best[g, g_j], slots)
    ea, eb = rows[g, g_h, a], rows[g, g_j, b]
    rows[g, g_h, a], rows[g, g_j, b] = eb, ea
    holds[g_id, g_h, ea] = holds[g_id, g_j, eb] = False
    holds[g_id, g_h, eb] = holds[g_id, g_j, ea] = True
    moved[g, g_h, a] = moved[g, g_j, b] = True
    comm[g, g_h, g_j] += 1
    comm[g, g_j, g_h] += 1
    return swapped


def swap_experts(rows: np.ndarray, unit_of: np.ndarray, comm: np.ndarray, threshold: np.ndarray, max_swaps: int,
                 num_max_com: int) -> np.ndarray:
    """Run the swap rounds on a batch. rows int64 [B, R, S] (no expert twice on a rank), unit_of float [B, E]
    per-copy loads, comm int64 [B, R, R] transfer counts (updated in place), threshold float [B].
    Returns the new rows [B, R, S]."""
    batch, ranks, slots = rows.shape
    holds = np.zeros((batch, ranks, unit_of.shape[1]), dtype=bool)
    holds[np.arange(batch)[:, None, None], np.arange(ranks)[None, :, None], rows] = True
    out = rows.copy()
    live = np.arange(batch)
    w_rows, w_moved = out.copy(), np.zeros(rows.shape, dtype=bool)
    w_comm, w_unit, w_thr = comm.copy(), unit_of, threshold
    for _ in range(max_swaps):
        if live.size == 0:
            break
        swapped = _round(w_rows, w_moved, w_comm, w_unit, w_thr, holds, live, num_max_com)
        if swapped.all():
            continue
        done = ~swapped
        out[live[done]], comm[live[done]] = w_rows[done], w_comm[done]
        live = live[swapped]
        w_rows, w_moved, w_comm = w_rows[swapped], w_moved[swapped], w_comm[swapped]
        w_unit, w_thr = w_unit[swapped], w_thr[swapped]
    out[live], comm[live] = w_rows, w_comm
    return out
