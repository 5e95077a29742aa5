"""Per-request, per-position acceptance statistics of verified drafts (the estimates dynamic speculation runs on).

The counts live in two row-slot matrices (one row per live request, row 0 an all-zero row for unknown requests), so
a step's estimates for the whole batch are one gather and a few array operations, and a step's verifications are
recorded in one call: at 16 running requests the per-request dictionaries and ``np.stack`` of the first version
cost about 0.1 ms of every decode step, which a compute-bound batch on few cores cannot spare.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PRIOR_HALF_LIFE = 128.0  # verifications over which the global acceptance prior halves its weight
UNKNOWN_ROW = 0  # the all-zero row that requests without verifications read


class AcceptanceStats:
    """Per-request, per-position acceptance counts from verification; estimates for model-free proposers.

    ``p_i(req) = (accepted_i + s * g_i) / (tried_i + s)`` with the global Laplace estimate
    ``g_i = (all_accepted_i + 1) / (all_tried_i + 2)`` as prior of strength ``s = prior_strength``. The global counts
    are exponentially weighted, halving every ``prior_half_life`` verifications (None: all history), so the prior of
    a new request follows the recent traffic: an all-history prior carried a repetitive workload's acceptance (0.65
    at the first position) into non-repetitive traffic (0.3), where the cost gate then kept drafts that did not pay.
    """

    def __init__(self, num_speculative_tokens: int, prior_strength: float = 2.0,
                 prior_half_life: float | None = PRIOR_HALF_LIFE) -> None:
        if num_speculative_tokens < 1 or not prior_strength > 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}, prior_strength={prior_strength} "
                             "are invalid: need k >= 1 and a positive prior strength")
        if prior_half_life is not None and not prior_half_life > 0:
            raise ValueError(f"prior_half_life={prior_half_life} is invalid: must be > 0 (verifications) or None")
        self.max_k = num_speculative_tokens
        self.prior_strength = prior_strength
        self._decay = 1.0 if prior_half_life is None else 0.5 ** (1.0 / float(prior_half_life))
        self._slot: dict[str, int] = {}
        self._tried = np.zeros((8, self.max_k), dtype=np.float64)  # [rows, k]; row UNKNOWN_ROW stays zero
        self._free: list[int] = list(range(self._tried.shape[0] - 1, UNKNOWN_ROW, -1))  # popped from the end
        self._accepted = np.zeros_like(self._tried)
        self._all_tried = np.zeros(self.max_k, dtype=np.float64)
        self._all_accepted = np.zeros(self.max_k, dtype=np.float64)
        self._positions = np.arange(self.max_k)

    @property
    def num_tracked(self) -> int:
        """Requests with recorded verifications."""
        return len(self._slot)

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification: drafts ``0 .. num_accepted-1`` accepted, draft ``num_accepted`` (if any) rejected."""
        self.record_batch([req_id], [num_drafts], [num_accepted])

    def record_batch(self, req_ids: Sequence[str], num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """A step's verifications, in order: the same counts and decayed prior as ``record`` called for each."""
        drafts = np.asarray(num_drafts, dtype=np.int64).reshape(-1)
        accepted = np.asarray(num_accepted, dtype=np.int64).reshape(-1)
        if not len(req_ids) == len(drafts) == len(accepted):
            raise ValueError(f"record_batch got {len(req_ids)} req_ids, {len(drafts)} num_drafts and "
                             f"{len(accepted)} num_accepted; they must have equal lengths")
        bad = np.flatnonzero((accepted < 0) | (accepted > drafts) | (drafts > self.max_k))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"num_accepted={int(accepted[i])}, num_drafts={int(drafts[i])} are invalid for "
                             f"k={self.max_k}: need 0 <= accepted <= drafts <= k")
        if not len(req_ids):
            return
        tried_mask = self._positions < np.minimum(accepted + 1, drafts)[:, None]  # [n, k]
        accepted_mask = self._positions < accepted[:, None]
        rows = np.fromiter((self._row_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        np.add.at(self._tried, rows, tried_mask)
        np.add.at(self._accepted, rows, accepted_mask)
        # record j (of n) is decayed by the n - 1 - j records after it, the counts before the batch by all n
        weights = self._decay ** np.arange(len(rows) - 1, -1, -1, dtype=np.float64)
        scale = self._decay ** len(rows)
        self._all_tried = self._all_tried * scale + weights @ tried_mask
        self._all_accepted = self._all_accepted * scale + weights @ accepted_mask

    def remove(self, req_id: str) -> None:
        row = self._slot.pop(req_id, None)
        if row is not None:
            self._tried[row] = 0.0
            self._accepted[row] = 0.0
            self._free.append(row)

    def prior(self) -> np.ndarray:
        """float64 ``[k]``: the global (recency-weighted) Laplace estimate per position."""
        return (self._all_accepted + 1.0) / (self._all_tried + 2.0)

    def token_probs(self, req_ids: Sequence[str]) -> np.ndarray:
        """float64 ``[len(req_ids), k]`` conditional acceptance estimates (unknown requests get the global one)."""
        if not req_ids:
            return np.empty((0, self.max_k), dtype=np.float64)
        get = self._slot.get
        rows = np.fromiter((get(r, UNKNOWN_ROW) for r in req_ids), dtype=np.int64, count=len(req_ids))
        s = self.prior_strength
        return (self._accepted[rows] + s * self.prior()) / (self._tried[rows] + s)

    def _row_of(self, req_id: str) -> int:
        row = self._slot.get(req_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._free.pop()
            self._slot[req_id] = row
        return row

    def _grow(self) -> None:
        old = self._tried.shape[0]
        new = 2 * old
        self._tried = np.concatenate([self._tried, np.zeros((new - old, self.max_k))])
        self._accepted = np.concatenate([self._accepted, np.zeros((new - old, self.max_k))])
        self._free.extend(range(new - 1, old - 1, -1))
