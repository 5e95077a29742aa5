"""EPLB observability: per-layer imbalance (max / mean load per rank), expert hotness, moves and bytes per
rebalance, rebalance stall time. ``EplbMetrics.as_dict()`` holds the values to export (e.g. on ``/metrics``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    last: RebalanceStats | None = None
    disabled_reason: str | None = None

    def observe_load(self, load: torch.Tensor, placement: torch.Tensor) -> None:
        """Refresh the current per-layer imbalance and hotness from a logical load ``[L, E]``."""
        self.imbalance = imbalance(rank_loads(load, placement)).tolist()
        self.hotness = hotness(load)[0].tolist()

    def add(self, stats: RebalanceStats) -> None:
        self.rebalances += 1
        self.moves_total += stats.moves
        self.bytes_total += stats.bytes_moved
        self.stall_s_total += stats.stall_s
        self.last = stats

    def as_dict(self) -> dict:
        out = asdict(self)
        out["last"] = asdict(self.last) if self.last is not None else None
        return out
