"""Independent references for the policy tests: the DeepSeek EPLB algorithm and a brute-force optimum."""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def deepseek_reference(weight: np.ndarray, num_ranks: int, slots: int) -> np.ndarray:
    """DeepSeek EPLB global branch, written from its description: replicate the expert with the largest
    load-per-replica until all slots are used; pack replicas heaviest first onto the lightest rank with room."""
    layers, experts = weight.shape
    out = np.zeros((layers, num_ranks, slots), dtype=np.int64)
    for layer in range(layers):
        w = weight[layer].tolist()
        reps = [1] * experts
        heap = [(-w[e], e) for e in range(experts)]
        heapq.heapify(heap)
        for _ in range(num_ranks * slots - experts):
            _, e = heapq.heappop(heap)
            reps[e] += 1
            heapq.heappush(heap, (-w[e] / reps[e], e))
        items = sorted(((w[e] / reps[e], e) for e in range(experts) for _ in range(reps[e])), key=lambda x: -x[0])
        loads, rows = [0.0] * num_ranks, [[] for _ in range(num_ranks)]
        for unit, e in items:
            r = min((r for r in range(num_ranks) if len(rows[r]) < slots), key=lambda r: loads[r])
            rows[r].append(e)
            loads[r] += unit
        out[layer] = np.array(rows)
    return out


def max_rank_load(rows: np.ndarray, weight: np.ndarray) -> float:
    counts = np.bincount(rows.ravel(), minlength=weight.size)
    return float((weight[rows] / counts[rows]).sum(axis=1).max())


def brute_force_optimum(weight: np.ndarray, num_ranks: int, slots: int) -> float:
    """Minimum max rank load over every placement (each expert >= 1 replica) of a tiny instance."""
    experts = weight.size
    best = np.inf
    for flat in itertools.product(range(experts), repeat=num_ranks * slots):
        if len(set(flat)) < experts:
            continue
        best = min(best, max_rank_load(np.array(flat).reshape(num_ranks, slots), weight))
    return best
