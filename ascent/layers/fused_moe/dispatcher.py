"""MoE token dispatch/combine across expert-parallel ranks (specs/eplb_moe_lora.md §5.2).

Every dispatcher takes this rank's tokens (hidden ``[T, H]``, routing weights fp32 ``[T, k]``, *physical* expert
ids ``[T, k]``), hands the local expert MLP the rows routed to this rank's slots sorted by local slot (with counts
per slot, ``group_list`` type 1), and combines the MLP output back into ``[T, H]`` (weighted sum over the k choices,
fp32 accumulation). Token counts may differ between ranks (zero included); every rank enters every collective.

* ``local``: EP = 1, no communication.
* ``allgather``: all-gather tokens/ids/weights of all ranks (padded to the largest rank), route the rows of the local
  slot range, combine locally, then reduce-scatter the partial sums back to their owners (on gloo emulated as
  all-reduce + own-chunk slice by ``ascent.distributed.comm.reduce_scatter``).
* ``alltoall``: send each (token, choice) row to the rank owning its slot with ``all_to_all_single`` (uneven splits
  exchanged first), regroup received rows by local slot, and send the results back the same way.
* ``mc2``: the Ascend fused dispatch/combine, emulated as all-to-all with its fixed per-rank token capacity checked.

:func:`select_moe_comm` turns the hardware profile's ``moe_comm`` policy into one of these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ascent.distributed.parallel_state import GroupCoordinator
from ascent.platform.adaptor import DeviceAdaptor
from ascent.platform.profile import MoECommPolicy

MC2_TOKENS_CAPACITY = 512  # per-rank token capacity of the (emulated) MC2 dispatch
ALLTOALL_MIN_TOKENS = 64  # size-based policy: all-to-all from this many tokens per EP rank
MC2_MIN_EP_SIZE = 16  # A2: MC2 pays off only with many ranks (high expert density per node)

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MoECommType(str, Enum):
    LOCAL = "local"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"
    MC2 = "mc2"


@dataclass
class Dispatched:
    """Rows for the local expert MLP: hidden ``[R, H]`` sorted by local slot, group_list int64 ``[S]`` (counts);
    ``state`` is the dispatcher's private data for :meth:`MoEDispatcher.combine`."""

    hidden: torch.Tensor
    group_list: torch.Tensor
    state: Any


def select_moe_comm(policy: MoECommPolicy | str, ep_size: int, num_tokens: int,
                    mc2_capacity: int = MC2_TOKENS_CAPACITY) -> MoECommType:
    """Dispatcher for ``num_tokens`` tokens per EP rank (must be the same value on every rank).

    EP = 1 -> local. ``allgather`` -> all-gather. ``size_based`` -> all-to-all from ``ALLTOALL_MIN_TOKENS`` tokens,
    else all-gather. ``capacity_density`` (A2) -> MC2 when the tokens fit its capacity and EP >= 16, else all-gather.
    ``fused_or_capacity`` (A3) -> MC2 when they fit, else all-to-all. ``capacity_world`` (A5) -> MC2 when they fit,
    else all-to-all for EP >= 16 and all-gather below.
    """
    policy = MoECommPolicy(policy)
    if ep_size == 1:
        return MoECommType.LOCAL
    fits = num_tokens <= mc2_capacity
    if policy == MoECommPolicy.ALLGATHER:
        return MoECommType.ALLGATHER
    if policy == MoECommPolicy.SIZE_BASED:
        return MoECommType.ALLTOALL if num_tokens >= ALLTOALL_MIN_TOKENS else MoECommType.ALLGATHER
    if policy == MoECommPolicy.CAPACITY_AND_EXPERT_DENSITY:
        return MoECommType.MC2 if fits and ep_size >= MC2_MIN_EP_SIZE else MoECommType.ALLGATHER
    if policy == MoECommPolicy.FUSED_OR_CAPACITY:
        return MoECommType.MC2 if fits else MoECommType.ALLTOALL
    if fits:
        return MoECommType.MC2
    return MoECommType.ALLTOALL if ep_size >= MC2_MIN_EP_SIZE else MoECommType.ALLGATHER


# ----- collectives over the EP group coordinator (gloo-safe forms from ascent.distributed.comm) -----
def _gather_sizes(n: int, group: GroupCoordinator, device: torch.device) -> list[int]:
    """Every rank's ``n`` (the tensor lives on ``device``: the device group may be NCCL)."""
    return [int(v) for v in group.all_gather(torch.tensor([n], dtype=torch.int64, device=device), 0).tolist()]


def _all_gather_padded(x: torch.Tensor, rows: int, fill: float, group: GroupCoordinator) -> torch.Tensor:
    """Pad x ``[n, ...]`` to ``rows`` rows with ``fill`` and concatenate every rank's copy -> ``[size*rows, ...]``."""
    padded = x.new_full((rows, *x.shape[1:]), fill)
    padded[: x.shape[0]] = x
    return group.all_gather(padded, 0)


def weighted_unpermute(adaptor: DeviceAdaptor, expert_out: torch.Tensor, row_idx: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * expert_out[row(t, j)]`` (rows -1 contribute 0) -> ``[T, H]``."""
    if expert_out.shape[0] == 0:
        return expert_out.new_zeros(weights.shape[0], expert_out.shape[1])
    return adaptor.moe_token_unpermute(expert_out, row_idx, weights)


class MoEDispatcher(ABC):
    """Dispatch/combine over the EP ``group`` for a layer with ``num_physical`` slots (``S = num_physical /
    group.world_size`` per rank, group rank r owning ``[r*S, (r+1)*S)``)."""

    comm_type: MoECommType

    def __init__(self, group: GroupCoordinator, num_physical: int, adaptor: DeviceAdaptor | None = None) -> None:
        if num_physical % group.world_size:
            raise ValueError(f"num_physical={num_physical} does not split over ep size {group.world_size}")
        self.group = group
        self.num_physical = num_physical
        self.num_local = num_physical // group.world_size
        self.local_start = group.rank_in_group * self.num_local
        self.adaptor = adaptor or DeviceAdaptor()

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """Rows for this rank's experts (see :class:`Dispatched`)."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """MLP output ``[R, H]`` (rows as dispatched) -> this rank's tokens ``[T, H]``."""

    def run(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            experts: ExpertFn) -> torch.Tensor:
        """``combine(experts(rows, group_list))`` of ``dispatch(...)``."""
        dispatched = self.dispatch(hidden, topk_weights, topk_ids)
        return self.combine(experts(dispatched.hidden, dispatched.group_list), dispatched)


class LocalDispatcher(MoEDispatcher):
    """EP = 1: sort (token, choice) rows by expert, no communication."""

    comm_type = MoECommType.LOCAL

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        routing = self.adaptor.moe_init_routing(hidden, topk_ids, num_experts=self.num_physical,
                                                active_expert_range=(self.local_start,
                                                                     self.local_start + self.num_local))
        return Dispatched(routing.expanded_x, routing.expert_tokens, (routing.expanded_row_idx, topk_weights))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        row_idx, weights = dispatched.state
        return weighted_unpermute(self.adaptor, expert_out, row_idx, weights)


class AllGatherDispatcher(LocalDispatcher):
    """All-gather every rank's tokens, compute the local slots' share, reduce-scatter the partial outputs."""

    comm_type = MoECommType.ALLGATHER

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        rows = max(_gather_sizes(hidden.shape[0], self.group, hidden.device))
        all_hidden = _all_gather_padded(hidden, rows, 0.0, self.group)
        all_ids = _all_gather_padded(topk_ids.to(torch.int64), rows, -1, self.group)
        all_weights = _all_gather_padded(topk_weights.float(), rows, 0.0, self.group)
        local = super().dispatch(all_hidden, all_weights, all_ids)
        local.state = (*local.state, hidden.shape[0])
        return local

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        row_idx, weights, num_tokens = dispatched.state
        partial = weighted_unpermute(self.adaptor, expert_out, row_idx, weights)
        return self.group.reduce_scatter(partial, 0)[:num_tokens]


@dataclass
class _A2AState:
    row_idx: torch.Tensor  # [T*k] position of (t, j) among the rows sent
    weights: torch.Tensor  # [T, k]
    send: list[int]  # rows sent to each rank
    recv: list[int]  # rows received from each rank
    order: torch.Tensor  # MLP input row i = received row order[i] (received rows regrouped by local slot)


class AllToAllDispatcher(MoEDispatcher):
    """All-to-all(v): (token, choice) rows travel to the rank of their slot and back."""

    comm_type = MoECommType.ALLTOALL

    def _check_tokens(self, hidden: torch.Tensor) -> None:
        """Hook for capacity-bound variants (MC2)."""

    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        self._check_tokens(hidden)
        size, s = self.group.world_size, self.num_local
        routing = self.adaptor.moe_init_routing(hidden, topk_ids, num_experts=self.num_physical)
        counts = routing.expert_tokens.to(torch.int64)  # [P] rows per physical slot, sorted order
        all_counts = self.group.all_gather(counts.unsqueeze(0), 0)  # [size, P]
        send = counts.view(size, s).sum(1).tolist()
        from_ranks = all_counts[:, self.local_start: self.local_start + s]  # [size, S] rows for my slots
        recv = from_ranks.sum(1).tolist()
        received = self.group.all_to_all(routing.expanded_x, send, recv)
        slot_of_row = torch.repeat_interleave(torch.arange(s, device=counts.device).repeat(size),
                                              from_ranks.reshape(-1))
        order = torch.sort(slot_of_row, stable=True).indices
        state = _A2AState(routing.expanded_row_idx, topk_weights, send, recv, order)
        return Dispatched(received.index_select(0, order), from_ranks.sum(0), state)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        st: _A2AState = dispatched.state
        back = torch.empty_like(expert_out)
        back[st.order] = expert_out
        returned = self.group.all_to_all(back, st.recv, st.send)
        return weighted_unpermute(self.adaptor, returned, st.row_idx, st.weights)


class MC2Dispatcher(AllToAllDispatcher):
    """Ascend MC2 dispatch/combine emulated as all-to-all; keeps the fixed per-rank token capacity contract."""

    comm_type = MoECommType.MC2

    def __init__(self, group: GroupCoordinator, num_physical: int, adaptor: DeviceAdaptor | None = None,
                 capacity: int = MC2_TOKENS_CAPACITY) -> None:
        super().__init__(group, num_physical, adaptor)
        if capacity < 1:
            raise ValueError(f"MC2 capacity={capacity} must be >= 1")
        self.capacity = capacity

    def _check_tokens(self, hidden: torch.Tensor) -> None:
        """Collective: every rank raises when any rank exceeds the capacity (no rank is left waiting)."""
        sizes = _gather_sizes(hidden.shape[0], self.group, hidden.device)
        if max(sizes) > self.capacity:
            raise ValueError(f"tokens per EP rank {sizes} exceed the MC2 capacity {self.capacity}")


_DISPATCHERS: dict[MoECommType, type[MoEDispatcher]] = {
    MoECommType.LOCAL: LocalDispatcher,
    MoECommType.ALLGATHER: AllGatherDispatcher,
    MoECommType.ALLTOALL: AllToAllDispatcher,
    MoECommType.MC2: MC2Dispatcher,
}


def make_dispatcher(comm_type: MoECommType | str, group: GroupCoordinator, num_physical: int,
                    adaptor: DeviceAdaptor | None = None) -> MoEDispatcher:
    """The dispatcher of ``comm_type`` over the EP ``group``; ``local`` requires a group of size 1."""
    kind = MoECommType(comm_type)
    if kind == MoECommType.LOCAL and group.world_size != 1:
        raise ValueError(f"comm_type 'local' needs ep size 1, got {group.world_size}")
    return _DISPATCHERS[kind](group, num_physical, adaptor)
