"""Policy 0: deterministic plumbing test that forces one transfer per layer (specs §2.1)."""

from __future__ import annotations

import numpy as np

from ascent.eplb.policy.base import EplbPolicy


class RandomLoadBalance(EplbPolicy):
    """Swap the last slot of rank ``rank_a`` with the last slot of rank ``rank_b`` in every layer (ranks are taken
    modulo R, so any R >= 2 works; with R == 1 nothing changes)."""

    name = "random"

    def __init__(self, rank_a: int = 3, rank_b: int = 1) -> None:
        if rank_a < 0 or rank_b < 0:
            raise ValueError(f"ranks ({rank_a}, {rank_b}) must be >= 0")
        self.rank_a, self.rank_b = rank_a, rank_b

    def _rebalance(self, placement: np.ndarray, load: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        ranks = placement.shape[1]
        a, b = self.rank_a % ranks, self.rank_b % ranks
        new = placement.copy()
        new[:, a, -1], new[:, b, -1] = placement[:, b, -1], placement[:, a, -1]
        changed = np.flatnonzero((new != placement).any(axis=(1, 2)))
        return changed.astype(np.int64), new
