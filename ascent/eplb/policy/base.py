"""The EPLB policy interface (specs/eplb_moe_lora.md §2)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ascent.eplb.policy.validate import check_inputs, validate_placement, validate_same_slots

RebalanceResult = tuple[bool, np.ndarray, np.ndarray]


class EplbPolicy(ABC):
    """A rebalancing policy.

    ``rebalance_experts(placement, load)``: ``placement`` int ``[L, R, S]`` logical expert ids (each of the ``E``
    experts present >= 1 time per layer); ``load`` float ``[T, L, E]`` per-step logical token counts (or their
    ``[L, E]`` sum). Returns ``(changed, layer_order, new_placement)``: ``layer_order`` int64 ``[K]`` are the layers
    to update, most beneficial first; ``new_placement`` int64 ``[L, R, S]`` equals ``placement`` on every layer not in
    ``layer_order``; ``changed`` is ``K > 0``. The output is validated before it is returned.
    """

    name = "base"

    def rebalance_experts(self, placement: np.ndarray, load: np.ndarray) -> RebalanceResult:
        current, series, num_experts = check_inputs(placement, load)
        order, new = self._rebalance(current, series, num_experts)
        validate_same_slots(current, new)
        validate_placement(new, num_experts)
        order = np.asarray(order, dtype=np.int64)
        untouched = np.ones(current.shape[0], dtype=bool)
        untouched[order] = False
        if not np.array_equal(new[untouched], current[untouched]):
            raise ValueError(f"{self.name}: layers outside layer_order {order.tolist()} were modified")
        return bool(order.size > 0), order, new

    @abstractmethod
    def _rebalance(self, placement: np.ndarray, load: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """Validated inputs (int64 [L, R, S], float64 [T, L, E]) -> (layer_order, new placement)."""


def select_layers(old: np.ndarray, new: np.ndarray, score_old: np.ndarray,
                  score_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep the re-planned layers whose (lower-is-better) score strictly improves, ordered by ratio new/old
    ascending; all other layers revert to ``old``. Returns (layer_order, placement)."""
    ratio = score_new / np.maximum(score_old, 1e-12)
    better = np.flatnonzero(score_new < score_old * (1 - 1e-9))
    order = better[np.argsort(ratio[better], kind="stable")]
    out = old.copy()
    out[order] = new[order]
    return order.astype(np.int64), out
