"""Expert weight moves between EP ranks for a new placement: batched P2P ``isend``/``irecv`` (specs §3.4/§3.5).

Every rank derives the same transfer list from the old and new placements (pure function, canonical order), posts
its sends (from the current, old-placement slots) and receives (into fresh buffers) as one ``batch_isend_irecv`` per
layer, waits, and then lets ``FusedMoE.rearrange_experts`` switch the map and copy the weights in: local copies for
experts this rank already held, the received buffers (through :func:`make_fetch`) for the others. Since receives land
in buffers, a rank may send an expert it evicts in the same layer. An expert travels as all of its tensors
(``FusedMoE.expert_tensor_names``: quantized weights with their scales / offsets). gloo needs CPU tensors (CUDA +
gloo would stage through host buffers; not done here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ascent.distributed.parallel_state import GroupCoordinator
from ascent.layers.fused_moe.expert_map import ExpertMove
from ascent.layers.fused_moe.layer import ExpertWeights, FusedMoE


@dataclass(frozen=True)
class Transfer:
    """Logical expert ``logical`` travels from local slot ``src_slot`` of EP rank ``src_rank`` to ``dst_rank``."""

    logical: int
    src_rank: int
    src_slot: int
    dst_rank: int


@dataclass
class LayerMoveResult:
    """What one layer's rearrangement did on this rank (moves: local slots refilled; bytes: received over P2P)."""

    moves: list[ExpertMove]
    transfers: list[Transfer]
    bytes_received: int


def plan_transfers(old: Sequence[int] | torch.Tensor, new: Sequence[int] | torch.Tensor, ep_size: int
                   ) -> list[Transfer]:
    """The experts each rank must receive to go from ``old`` to ``new`` physical->logical placement (same length,
    split evenly over ``ep_size`` ranks). A rank receives each missing expert once, even for several slots; the
    source is the holder with the fewest sends so far (ties: lowest physical slot). Ordered by (dst_rank, logical)."""
    old_l, new_l = [int(v) for v in old], [int(v) for v in new]
    if len(old_l) != len(new_l) or not old_l or len(old_l) % ep_size:
        raise ValueError(f"placements of {len(old_l)} and {len(new_l)} slots do not split over ep_size={ep_size}")
    s = len(old_l) // ep_size
    sends = [0] * ep_size
    out: list[Transfer] = []
    for dst in range(ep_size):
        held = set(old_l[dst * s:(dst + 1) * s])
        needed = sorted({new_l[p] for p in range(dst * s, (dst + 1) * s) if new_l[p] not in held})
        for e in needed:
            sources = [p for p, v in enumerate(old_l) if v == e]
            if not sources:
                raise ValueError(f"logical expert {e} of the new placement is held by no slot of the old one")
            src = min(sources, key=lambda p: (sends[p // s], p))
            sends[src // s] += 1
            out.append(Transfer(e, src // s, src % s, dst))
    return out


def make_fetch(received: dict[int, ExpertWeights]) -> Callable[[ExpertMove], ExpertWeights]:
    """A ``fetch`` for ``FusedMoE.rearrange_experts`` serving the weights received per logical expert."""
    def fetch(move: ExpertMove) -> ExpertWeights:
        if move.new_logical not in received:
            raise ValueError(f"expert {move.new_logical} for local slot {move.local_slot} was not received")
        return received[move.new_logical]
    return fetch


def _post_ops(layer: FusedMoE, transfers: list[Transfer], group: GroupCoordinator
              ) -> tuple[list[dist.P2POp], dict[int, ExpertWeights]]:
    me = group.rank_in_group
    ops: list[dist.P2POp] = []
    received: dict[int, ExpertWeights] = {}
    for t in transfers:
        if t.src_rank == me:
            for tensor in layer.expert_weights(t.src_slot):
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group.ranks[t.dst_rank], group.device_group))
        if t.dst_rank == me:
            buffers = tuple(torch.empty_like(w) for w in layer.expert_weights(0))  # every expert tensor
            received[t.logical] = buffers
            for tensor in buffers:
                ops.append(dist.P2POp(dist.irecv, tensor, group.ranks[t.src_rank], group.device_group))
    return ops, received


def exchange_layer(layer: FusedMoE, new_physical_to_logical: torch.Tensor, group: GroupCoordinator
                   ) -> LayerMoveResult:
    """Move one layer to a new placement on every EP rank (a collective: all ranks call it with the same plan)."""
    new = new_physical_to_logical.to(torch.int64).flatten()
    transfers = plan_transfers(layer.expert_map.physical_to_logical, new, group.world_size)
    ops, received = _post_ops(layer, transfers, group) if group.world_size > 1 else ([], {})
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    moves = layer.rearrange_experts(new, make_fetch(received))
    nbytes = sum(w.numel() * w.element_size() for tensors in received.values() for w in tensors)
    return LayerMoveResult(moves, transfers, nbytes)
