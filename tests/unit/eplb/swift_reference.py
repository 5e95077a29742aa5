"""Test oracle: the per-layer SwiftBalancer implementation that the vectorised ``ascent.eplb.policy.swift`` replaced.
The vectorised policy must return exactly the same placement (tests/unit/eplb/test_swift_vectorised.py)."""
from __future__ import annotations

import numpy as np

from ascent.eplb.placement import imbalance, preserve_local_slots, rank_loads
from ascent.eplb.policy.base import EplbPolicy, select_layers


def preserve_slots(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Per-row loop of :func:`preserve_local_slots` (the oracle of the vectorised ``placement.preserve_slots``)."""
    out = new.copy()
    for layer in range(new.shape[0]):
        for rank in range(new.shape[1]):
            if not np.array_equal(old[layer, rank], new[layer, rank]):
                out[layer, rank] = preserve_local_slots(old[layer, rank], new[layer, rank])
    return out


def split_original_redundant(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scan ``rows`` [R, S] slot-major (slot 0 of every rank, then slot 1, ...): the first occurrence of an expert
    is its original. Returns (bool [R, S] redundant mask, int64 [E] origin rank, -1 for absent experts)."""
    num = int(rows.max()) + 1
    flat = rows.T.ravel()
    _, first = np.unique(flat, return_index=True)
    redundant = np.ones(flat.size, dtype=bool)
    redundant[first] = False
    origin = np.full(num, -1, dtype=np.int64)
    origin[flat[first]] = first % rows.shape[0]
    return redundant.reshape(rows.shape[1], rows.shape[0]).T, origin


def redundant_assignments(weight: np.ndarray, present: np.ndarray, num_copies: int, max_copies: int) -> np.ndarray:
    """Extra copies (expert ids, heaviest per-copy load first) for ``num_copies`` redundant slots: greedy argmax of
    ``weight / count`` over ``present`` experts with ``count < max_copies``."""
    counts = present.astype(np.float64)
    picks = []
    for _ in range(num_copies):
        score = np.where(present & (counts < max_copies), weight / np.maximum(counts, 1), -np.inf)
        expert = int(score.argmax())
        if np.isneginf(score[expert]):
            break
        counts[expert] += 1
        picks.append(expert)
    picks = np.asarray(picks, dtype=np.int64)
    return picks[np.argsort(-(weight[picks] / counts[picks]), kind="stable")]


class PerLayerSwift(EplbPolicy):
    """SwiftBalancer. ``ranks_per_node`` with ``node_local`` restricts redundancy and swaps to each node."""

    name = "swift_per_layer"

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

    def _blocks(self, ranks: int) -> list[slice]:
        size = self.ranks_per_node if self.node_local and self.ranks_per_node else ranks
        if ranks % size:
            raise ValueError(f"ranks={ranks} not divisible by ranks_per_node={size}")
        return [slice(i, i + size) for i in range(0, ranks, size)]

    def _redeploy(self, rows: np.ndarray, weight: np.ndarray, comm: np.ndarray) -> np.ndarray:
        """Steps 1-5 on one block of ranks [r, S]; ``comm`` [r, r] transfer counts is updated in place."""
        redundant, origin = split_original_redundant(rows)
        present = np.zeros(weight.size, dtype=bool)
        present[rows[~redundant]] = True
        copies = redundant_assignments(weight, present, int(redundant.sum()), rows.shape[0])
        counts = present.astype(np.int64)
        np.add.at(counts, copies, 1)
        unit = weight / np.maximum(counts, 1)
        out = np.where(redundant, -1, rows)
        loads = np.where(redundant, 0.0, unit[np.maximum(out, 0)]).sum(axis=1)
        holds = np.zeros((rows.shape[0], weight.size), dtype=bool)
        # fixed here (and in the vectorised policy): the original wrote ``holds[r, 0] = False`` for every blank
        # redundant slot, which could forget that rank r holds expert 0 and place a second copy of it there
        holds[np.repeat(np.arange(rows.shape[0]), rows.shape[1])[~redundant.ravel()], out[~redundant]] = True
        for expert in copies:
            src = origin[expert]
            ok = (out == -1).any(axis=1) & ~holds[:, expert] & (comm[src] < self.num_max_com)
            if not ok.any():
                continue
            dst = int(np.where(ok, loads, np.inf).argmin())
            out[dst, np.flatnonzero(out[dst] == -1)[0]] = expert
            holds[dst, expert] = True
            loads[dst] += unit[expert]
            comm[src, dst] += 1
        for rank, slot in zip(*np.nonzero(out == -1)):
            expert = int(np.where(present & ~holds[rank], unit, -np.inf).argmax())
            out[rank, slot] = expert
            holds[rank, expert] = True
        return out

    def _swap(self, rows: np.ndarray, weight: np.ndarray, comm: np.ndarray) -> np.ndarray:
        """Step 6 on one block [r, S]: swap pairs between the hottest rank and a colder one."""
        rows = rows.copy()
        counts = np.bincount(rows.ravel(), minlength=weight.size)
        unit_of = weight / np.maximum(counts, 1)
        nr = rows.shape[0]
        holds = np.zeros((nr, weight.size), dtype=bool)
        holds[np.repeat(np.arange(nr), rows.shape[1]), rows.ravel()] = True
        moved = np.zeros(rows.shape, dtype=bool)
        threshold = self.swap_threshold * weight[counts > 0].sum() / nr
        for _ in range(self.max_swap_times):
            unit = unit_of[rows]
            loads = unit.sum(axis=1)
            h = int(loads.argmax())
            cand = (comm[h] < self.num_max_com) & (comm[:, h] < self.num_max_com) & (loads < loads[h] - threshold)
            cand[h] = False
            js = np.flatnonzero(cand)
            if js.size == 0:
                break
            delta = unit[h][None, :, None] - unit[js][:, None, :]
            cost = np.maximum(loads[h] - delta, loads[js, None, None] + delta)
            valid = (~moved[h])[None, :, None] & (~moved[js])[:, None, :]
            valid &= ~holds[js][:, rows[h]][:, :, None] & ~holds[h][rows[js]][:, None, :]
            cost = np.where(valid, cost, np.inf).reshape(js.size, -1)
            best = cost.argmin(axis=1)
            gain = loads[h] - cost[np.arange(js.size), best]
            good = np.flatnonzero(gain >= max(threshold, 1e-12))
            if good.size == 0:
                break
            pick = int(good[np.argmin(loads[js[good]])])
            j = int(js[pick])
            best = {j: best[pick]}
            a, b = divmod(int(best[j]), rows.shape[1])
            ea, eb = rows[h, a], rows[j, b]
            rows[h, a], rows[j, b] = eb, ea
            holds[h, ea], holds[h, eb], holds[j, eb], holds[j, ea] = False, True, False, True
            moved[h, a] = moved[j, b] = True
            comm[h, j] += 1
            comm[j, h] += 1
        return rows

    def balance_layer(self, rows: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """One layer: [R, S] placement, [E] weight -> new [R, S] placement (or ``rows`` if not better)."""
        new = rows.copy()
        for block in self._blocks(rows.shape[0]):
            comm = np.zeros((block.stop - block.start,) * 2, dtype=np.int64)
            new[block] = self._redeploy(rows[block], weight, comm)
            new[block] = self._swap(new[block], weight, comm)
        before = imbalance(rows[None], weight[None])[0]
        return new if imbalance(new[None], weight[None])[0] < before else rows

    def _rebalance(self, placement: np.ndarray, load: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        weight = load.sum(axis=0)
        start = imbalance(placement, weight)
        new = placement.copy()
        for layer in np.flatnonzero(start >= self.imbalance_threshold):
            new[layer] = self.balance_layer(placement[layer], weight[layer])
        new = preserve_slots(placement, new)
        before, after = rank_loads(placement, weight).max(axis=1), rank_loads(new, weight).max(axis=1)
        if after.sum() >= (1 - self.min_gain) * before.sum():
            return np.zeros(0, dtype=np.int64), placement.copy()
        return select_layers(placement, new, before, after)
