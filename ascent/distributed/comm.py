"""Collective helpers over a ``torch.distributed`` process group (``group=None`` = the default group).

Every helper works on gloo (CPU) and NCCL; where gloo lacks an efficient native path the emulation is stated.
The 310P-style emulations (``broadcast_via_all_gather``, ``all_reduce_int64_via_all_gather``) are exposed so code that
must run with those constraints can be tested on gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def group_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def _is_gloo(group: Any) -> bool:
    return str(dist.get_backend(group)).lower() == "gloo"


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Gather every rank's ``x`` into ``out`` (``[world * x.shape[0], *x.shape[1:]]``, rank order) in place."""
    world = group_size(group)
    expected = (world * x.shape[0], *x.shape[1:])
    if tuple(out.shape) != expected or out.dtype != x.dtype:
        raise ValueError(f"out shape {tuple(out.shape)}/{out.dtype} != expected {expected}/{x.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    dist.all_gather(list(out.view(world, *x.shape).unbind(0)), x.contiguous(), group=group)
    return out


def all_gather(x: torch.Tensor, dim: int = 0, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    world = group_size(group)
    gathered = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(gathered, x, group)
    if dim % x.dim() == 0:
        return gathered
    return torch.cat(gathered.chunk(world, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group: Any = None,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``x`` over the group and return this rank's equal slice along ``dim``.

    gloo: emulated as all_reduce of a copy + slice (one full-size reduction); NCCL: native reduce-scatter.
    """
    world = group_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % world != 0:
        raise ValueError(f"dim {dim} size {x.shape[dim]} is not divisible by group size {world}")
    chunk = x.shape[dim] // world
    rank = dist.get_rank(group)
    if _is_gloo(group):
        reduced = x.clone()
        dist.all_reduce(reduced, op=op, group=group)
        return reduced.narrow(dim, rank * chunk, chunk).contiguous()
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((chunk, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch >= 2.13 name first
    native(out, moved, op=op, group=group)
    return out.movedim(0, dim).contiguous()


def exchange_split_sizes(input_splits: Sequence[int], group: Any = None) -> list[int]:
    """What each rank will send to this one, given what this rank sends to each (``input_splits[r]`` rows to r)."""
    world = group_size(group)
    if len(input_splits) != world:
        raise ValueError(f"input_splits has {len(input_splits)} entries for a group of {world}")
    send = torch.tensor(list(input_splits), dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(v) for v in recv.tolist()]


def all_to_all_uneven(x: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int] | None = None,
                      group: Any = None) -> torch.Tensor:
    """Send rows ``x[sum(input_splits[:r]) : +input_splits[r]]`` to rank r; return the rows received, ordered by
    source rank (``[sum(output_splits), *x.shape[1:]]``). ``output_splits`` is exchanged first when not given."""
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input_splits {list(input_splits)} do not sum to x.shape[0]={x.shape[0]}")
    if output_splits is None:
        output_splits = exchange_split_sizes(input_splits, group)
    out = torch.empty((sum(output_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return out


def broadcast_via_all_gather(x: torch.Tensor, src_in_group: int, group: Any = None) -> torch.Tensor:
    """Broadcast emulated by all-gather + select (for backends without a usable device broadcast); returns the
    source's tensor on every rank (``x`` must have the same shape/dtype everywhere)."""
    world = group_size(group)
    if not 0 <= src_in_group < world:
        raise ValueError(f"src_in_group={src_in_group} is outside [0, {world})")
    return all_gather(x.unsqueeze(0), 0, group)[src_in_group].clone()


def all_reduce_int64_via_all_gather(x: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """int64 all-reduce emulated by all-gather + local sum/max/min (for backends without int64 reductions)."""
    reducers = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}
    if op not in reducers:
        raise ValueError(f"op={op!r} must be one of {sorted(reducers)}")
    if x.dtype != torch.int64:
        raise ValueError(f"x.dtype={x.dtype} must be torch.int64")
    return reducers[op](all_gather(x.unsqueeze(0), 0, group))
