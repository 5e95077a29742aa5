"""EPLB observability: per-layer imbalance (max / mean load per rank), expert hotness, moves and bytes per
rebalance, rebalance stall time. ``EplbMetrics.as_dict()`` holds everything; ``EplbMetrics.summary(since)`` is the
compact form the engine polls from the workers and exports on ``/metrics`` and in the stat log line."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ascent.eplb import placement as placement_model


def rank_loads(load: torch.Tensor, placement: torch.Tensor) -> torch.Tensor:
    """Expected load per rank ``[L, R]`` (float64) of logical ``load [L, E]`` under ``placement [L, R, S]`` (logical
    id per slot), a replicated expert's load split evenly among its replicas — ``ascent.eplb.placement.rank_loads``
    on torch tensors."""
    if load.dim() != 2 or placement.dim() != 3 or load.shape[0] != placement.shape[0]:
        raise ValueError(f"load shape {tuple(load.shape)} / placement shape {tuple(placement.shape)} must be "
                         f"[L, E] / [L, R, S] with the same L")
    per_rank = placement_model.rank_loads(placement.cpu().numpy().astype(np.int64), load.double().cpu().numpy())
    return torch.from_numpy(per_rank)


def imbalance(per_rank: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dim, per layer (1.0 = perfectly balanced or no load)."""
    mean = per_rank.double().mean(-1)
    ratio = per_rank.double().amax(-1) / mean.clamp_min(1e-12)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


HOT_EXPERTS = 4  # hottest experts per layer exported (bounds the label cardinality of the load-share series)
HISTORY = 32  # rebalances kept for the engine to collect


def load_shares(load: torch.Tensor, top: int = HOT_EXPERTS) -> list[list[tuple[int, float]]]:
    """Per layer of a logical load ``[L, E]``: the ``top`` hottest experts as (expert id, share of the layer's load),
    hottest first (shares are 0 for a layer without load)."""
    load = load.double()
    total = load.sum(-1, keepdim=True)
    share = torch.where(total > 0, load / total.clamp_min(1e-12), torch.zeros_like(load))
    values, ids = share.topk(min(top, load.shape[-1]), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def hotness(load: torch.Tensor, top: int = 3) -> tuple[torch.Tensor, list[list[int]]]:
    """Per layer: hottest expert load / mean expert load ``[L]``, and the ``top`` hottest expert ids."""
    ratio = imbalance(load)
    k = min(top, load.shape[-1])
    return ratio, load.double().topk(k, dim=-1).indices.tolist()


@dataclass
class RebalanceStats:
    """One rebalance: imbalance before/after per layer (from the same load window), moves and bytes, times."""

    step: int
    changed_layers: int = 0
    moves: int = 0
    p2p_transfers: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    plan_s: float = 0.0
    imbalance_before: list[float] = field(default_factory=list)
    imbalance_after: list[float] = field(default_factory=list)
    hotness: list[float] = field(default_factory=list)
    hottest: list[list[int]] = field(default_factory=list)

    def log_line(self) -> str:
        def fmt(values: list[float]) -> str:
            return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"

        return (f"EPLB rebalance at step {self.step}: {self.changed_layers} layers changed, {self.moves} slot moves, "
                f"{self.p2p_transfers} P2P experts ({self.bytes_moved} B), stall {self.stall_s * 1e3:.1f} ms, "
                f"plan {self.plan_s * 1e3:.1f} ms; imbalance {fmt(self.imbalance_before)} -> "
                f"{fmt(self.imbalance_after)}; hotness {fmt(self.hotness)} hottest {self.hottest}")


@dataclass
class EplbMetrics:
    """Cumulative EPLB values of one rank."""

    enabled: bool = True
    steps: int = 0
    rebalances: int = 0
    plans_failed: int = 0
    moves_total: int = 0
    bytes_total: int = 0
    stall_s_total: float = 0.0
    imbalance: list[float] = field(default_factory=list)
    hotness: list[float] = field(default_factory=list)
    hot_experts: list[list[tuple[int, float]]] = field(default_factory=list)
    last: RebalanceStats | None = None
    disabled_reason: str | None = None
    version: int = 0  # bumped whenever an exported value changes
    history: list[RebalanceStats] = field(default_factory=list)  # the last HISTORY rebalances

    def observe_load(self, load: torch.Tensor, placement: torch.Tensor) -> None:
        """Refresh the current per-layer imbalance and hotness from a logical load ``[L, E]``."""
        self.imbalance = imbalance(rank_loads(load, placement)).tolist()
        self.hotness = hotness(load)[0].tolist()
        self.hot_experts = load_shares(load)
        self.version += 1

    def add(self, stats: RebalanceStats) -> None:
        self.rebalances += 1
        self.moves_total += stats.moves
        self.bytes_total += stats.bytes_moved
        self.stall_s_total += stats.stall_s
        self.last = stats
        if stats.imbalance_after:  # the current placement on the last load window
            self.imbalance = list(stats.imbalance_after)
        self.history = (self.history + [stats])[-HISTORY:]
        self.version += 1

    def disable(self, reason: str) -> None:
        self.enabled, self.disabled_reason = False, reason
        self.version += 1

    def as_dict(self) -> dict:
        out = asdict(self)
        out["last"] = asdict(self.last) if self.last is not None else None
        out.pop("history")
        return out

    def summary(self, since_version: int = -1, since_rebalances: int = 0) -> dict[str, Any] | None:
        """Compact values for the engine, or None if nothing changed since ``since_version``. ``new_rebalances``
        holds the rebalances after the first ``since_rebalances`` (at most the last ``HISTORY``)."""
        if self.version <= since_version:
            return None
        fresh = max(0, min(self.rebalances - since_rebalances, len(self.history)))
        return {"version": self.version, "enabled": self.enabled, "steps": self.steps,
                "rebalances": self.rebalances, "plans_failed": self.plans_failed, "moves_total": self.moves_total,
                "bytes_total": self.bytes_total, "stall_s_total": self.stall_s_total,
                "imbalance": list(self.imbalance), "hot_experts": [list(x) for x in self.hot_experts],
                "new_rebalances": [asdict(r) for r in self.history[len(self.history) - fresh:]],
                "disabled_reason": self.disabled_reason}
