"""Tensor-parallel state of this process.

Defaults to rank 0 of a group of size 1 (no parallelism). ``init_tensor_parallel`` sets rank/size and the
``torch.distributed`` process group used by the collectives; a group of ``None`` with size > 1 is allowed for
simulating a shard (weight loading tests) — collectives then fall back to the default process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class _TPState:
    rank: int = 0
    world_size: int = 1
    group: Any = None


_TP = _TPState()


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> None:
    """Set this process's tensor-parallel rank, world size and process group (``init_tensor_parallel(0, 1)`` resets)."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} is outside [0, {size})")
    _TP.rank, _TP.world_size, _TP.group = rank, size, group


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_group() -> Any:
    return _TP.group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place when size > 1); identity for size 1."""
    if _TP.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); identity for size 1."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
