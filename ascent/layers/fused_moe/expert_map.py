"""Logical -> physical expert placement of one MoE layer under expert parallelism.

Vocabulary (specs/eplb_moe_lora.md §1.1): the router picks *logical* experts ``0..E-1``; the layer stores *physical*
expert slots ``0..P-1`` (``P = E + redundant``) split evenly over the EP ranks: rank r owns the slots
``[r*S, (r+1)*S)`` (``S = P / ep_size``, its *local* slots ``0..S-1``). ``physical_to_logical[p]`` names the logical
expert held by slot p; every logical expert has at least one slot, and a slot holds exactly one expert (replicas of
a hot expert may sit on several slots/ranks). Routed tokens pick a replica per (token, choice) deterministically, so
every rank that routes the same token makes the same choice.

The EPLB updater changes the placement at run time with :meth:`ExpertMap.update_placement`, which returns the local
slots whose expert changed (:class:`ExpertMove`); the layer then moves the weights (``FusedMoE.rearrange_experts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertMove:
    """One local slot of this rank that receives a different logical expert after a placement update.

    ``sources`` are the physical slots (any rank) that held ``new_logical`` under the *old* placement; the weights
    can be copied from any of them.
    """

    local_slot: int
    physical_slot: int
    old_logical: int
    new_logical: int
    sources: tuple[int, ...]


def _as_placement(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = values.detach().cpu() if isinstance(values, torch.Tensor) else torch.tensor(list(values))
    if t.dim() != 1 or t.numel() == 0 or t.is_floating_point():
        raise ValueError(f"physical_to_logical must be a non-empty 1-D integer sequence, got {values!r}")
    return t.to(torch.int64).clone()


def default_placement(num_logical: int, num_physical: int) -> list[int]:
    """Slots ``0..E-1`` hold experts ``0..E-1``; redundant slots ``E..P-1`` replicate experts round-robin."""
    return [p % num_logical for p in range(num_physical)]


class ExpertMap:
    """Placement of ``num_logical`` experts on ``ep_size`` ranks (this process is ``ep_rank``)."""

    def __init__(self, num_logical: int, ep_size: int = 1, ep_rank: int = 0,
                 physical_to_logical: Sequence[int] | torch.Tensor | None = None,
                 num_redundant: int = 0) -> None:
        if num_logical < 1:
            raise ValueError(f"num_logical={num_logical} must be >= 1")
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} / ep_size={ep_size} invalid")
        if num_redundant < 0:
            raise ValueError(f"num_redundant={num_redundant} must be >= 0")
        self.num_logical = num_logical
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        if physical_to_logical is None:
            physical_to_logical = default_placement(num_logical, num_logical + num_redundant)
        self._set(self._validated(_as_placement(physical_to_logical)))

    def _validated(self, p2l: torch.Tensor) -> torch.Tensor:
        if p2l.numel() % self.ep_size:
            raise ValueError(f"{p2l.numel()} physical slots do not split evenly over ep_size={self.ep_size}")
        if bool(((p2l < 0) | (p2l >= self.num_logical)).any()):
            raise ValueError(f"physical_to_logical {p2l.tolist()} names experts outside [0, {self.num_logical})")
        missing = sorted(set(range(self.num_logical)) - set(p2l.tolist()))
        if missing:
            raise ValueError(f"physical_to_logical {p2l.tolist()} places no slot for logical experts {missing}")
        return p2l

    def _set(self, p2l: torch.Tensor) -> None:
        self._p2l = p2l
        counts = torch.bincount(p2l, minlength=self.num_logical)
        table = torch.full((self.num_logical, int(counts.max())), -1, dtype=torch.int64)
        fill = [0] * self.num_logical
        for p, e in enumerate(p2l.tolist()):
            table[e, fill[e]] = p
            fill[e] += 1
        self._replica_counts = counts
        self._l2p = table
        self._identity = p2l.numel() == self.num_logical and bool((p2l == torch.arange(self.num_logical)).all())

    # ----- placement views -----
    @property
    def num_physical(self) -> int:
        return int(self._p2l.numel())

    @property
    def num_local(self) -> int:
        """Slots per rank (S)."""
        return self.num_physical // self.ep_size

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def local_start(self) -> int:
        """First physical slot of this rank."""
        return self.ep_rank * self.num_local

    @property
    def physical_to_logical(self) -> torch.Tensor:
        """int64 ``[P]`` (a copy)."""
        return self._p2l.clone()

    @property
    def logical_to_physical(self) -> torch.Tensor:
        """int64 ``[E, max_replicas]``: the slots of each logical expert in ascending order, -1 padded."""
        return self._l2p.clone()

    @property
    def replica_counts(self) -> torch.Tensor:
        """int64 ``[E]``: slots per logical expert (>= 1)."""
        return self._replica_counts.clone()

    def local_physical_to_logical(self) -> torch.Tensor:
        """int64 ``[S]``: the logical expert of each local slot."""
        return self._p2l[self.local_start: self.local_start + self.num_local].clone()

    def local_slots(self, logical_id: int) -> list[int]:
        """Local slots (``0..S-1``) holding ``logical_id`` on this rank (empty when none)."""
        if not 0 <= logical_id < self.num_logical:
            raise ValueError(f"logical expert id {logical_id} outside [0, {self.num_logical})")
        local = self.local_physical_to_logical()
        return [s for s, e in enumerate(local.tolist()) if e == logical_id]

    def rank_of_physical(self, physical_slot: int) -> int:
        return physical_slot // self.num_local

    # ----- routing -----
    def to_physical(self, topk_ids: torch.Tensor, token_offset: int = 0) -> torch.Tensor:
        """Map logical ``topk_ids [T, k]`` to physical slots (int32 ``[T, k]``). Token ``t`` (global index
        ``token_offset + t``) uses replica ``(token_offset + t) % replica_count`` of each chosen expert. Identity when
        there is no redundancy and placement is the default one."""
        ids = topk_ids.to(torch.int64)
        if self._identity:
            return ids.to(torch.int32)
        l2p, counts = self._l2p.to(ids.device), self._replica_counts.to(ids.device)
        token = torch.arange(token_offset, token_offset + ids.shape[0], device=ids.device).unsqueeze(1)
        replica = token % counts[ids]
        return l2p[ids, replica].to(torch.int32)

    # ----- run-time updates (EPLB) -----
    def plan_placement(self, new_physical_to_logical: Sequence[int] | torch.Tensor) -> list[ExpertMove]:
        """The moves of this rank's local slots that a new placement (same slot count) implies; nothing changes."""
        new = _as_placement(new_physical_to_logical)
        if new.numel() != self.num_physical:
            raise ValueError(f"new placement has {new.numel()} slots; the layer has {self.num_physical}")
        new, old = self._validated(new), self._p2l
        moves = []
        for slot in range(self.num_local):
            p = self.local_start + slot
            if int(new[p]) != int(old[p]):
                sources = tuple(int(s) for s in (old == new[p]).nonzero().flatten().tolist())
                moves.append(ExpertMove(slot, p, int(old[p]), int(new[p]), sources))
        return moves

    def update_placement(self, new_physical_to_logical: Sequence[int] | torch.Tensor) -> list[ExpertMove]:
        """Adopt a new placement (same number of slots). Returns the moves of this rank's local slots whose logical
        expert changes; their weights must be refilled (``FusedMoE.rearrange_experts`` does both)."""
        moves = self.plan_placement(new_physical_to_logical)
        self._set(_as_placement(new_physical_to_logical))
        return moves

    def __repr__(self) -> str:
        return (f"ExpertMap(logical={self.num_logical}, physical={self.num_physical}, ep={self.ep_rank}/"
                f"{self.ep_size}, p2l={self._p2l.tolist()})")
