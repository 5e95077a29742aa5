"""Parallel state of this process: the world and its TP / DP / EP groups.

Layout (vLLM's): global rank ``r = dp_rank * tp + tp_rank``. TP groups are consecutive ranks, DP groups take one
rank per TP group (same ``tp_rank``). With ``enable_expert_parallel`` the EP group spans DP x TP (the TP ranks when
``dp == 1``, vLLM's rule); without it every rank is its own EP group of size 1 (experts are not split).

Without ``init_distributed_environment`` every group is rank 0 of size 1 and collectives are identities.
``init_tensor_parallel(rank, size, group)`` sets a TP group directly (simulated shards in loader tests: a group of
``None`` with size > 1 makes collectives use the default process group).

Each ``GroupCoordinator`` owns a CPU group (gloo) and a device group (NCCL on CUDA, the same gloo group on CPU),
both obtained from the process-group reuse registry (``pg_registry``), so identical groups share one communicator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ascent.distributed import comm
from ascent.distributed.pg_registry import PGLease, ProcessGroupRegistry, reuse_domain_for

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def _destroy_pg(handle: Any) -> None:
    if dist.is_initialized() and handle is not dist.GroupMember.WORLD:
        dist.destroy_process_group(handle)


_REGISTRY = ProcessGroupRegistry(
    destroy_fn=_destroy_pg,
    ranks_of=dist.get_process_group_ranks,
    is_sentinel=lambda handle: handle is dist.GroupMember.NON_GROUP_MEMBER,
)


def get_pg_registry() -> ProcessGroupRegistry:
    return _REGISTRY


class GroupCoordinator:
    """A group of global ``ranks`` containing this process (``rank``) with its CPU and device process groups.

    Collectives act on the device group and are identities when ``world_size == 1``. Source ranks are given
    within the group (``src_in_group``).
    """

    def __init__(self, name: str, ranks: list[int], rank: int, cpu_group: Any = None, device_group: Any = None,
                 leases: list[PGLease] | None = None) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in group {name!r} ranks {ranks}")
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.cpu_group = cpu_group
        self.device_group = device_group
        self._leases = list(leases or [])

    @classmethod
    def trivial(cls, name: str, rank: int = 0) -> "GroupCoordinator":
        return cls(name, [rank], rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns ``x``)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
        return x if self.world_size == 1 else comm.all_gather(x, dim, self.device_group)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over the group, keep this rank's slice of ``dim``."""
        return x if self.world_size == 1 else comm.reduce_scatter(x, dim, self.device_group)

    def all_to_all(self, x: torch.Tensor, input_splits: list[int], output_splits: list[int] | None = None
                   ) -> torch.Tensor:
        """Uneven all-to-all along dim 0 (see ``comm.all_to_all_uneven``)."""
        if self.world_size == 1:
            return x
        return comm.all_to_all_uneven(x, input_splits, output_splits, self.device_group)

    def broadcast(self, x: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(x, self.ranks[src_in_group], group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src_in_group: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, self.ranks[src_in_group], group=self.cpu_group)
        return holder[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Release this coordinator's registry leases (reverse order of acquisition)."""
        for lease in reversed(self._leases):
            if not lease.released:
                _REGISTRY.release(lease)
        self._leases.clear()
        self.cpu_group = self.device_group = None

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group})"


@dataclass
class _ParallelState:
    world: GroupCoordinator = field(default_factory=lambda: GroupCoordinator.trivial("world"))
    tp: GroupCoordinator = field(default_factory=lambda: GroupCoordinator.trivial("tp"))
    dp: GroupCoordinator = field(default_factory=lambda: GroupCoordinator.trivial("dp"))
    ep: GroupCoordinator = field(default_factory=lambda: GroupCoordinator.trivial("ep"))
    model_parallel_initialized: bool = False
    expert_parallel: bool = False


_STATE = _ParallelState()


def default_backend(device: torch.device | str | None = None) -> str:
    """``"nccl"`` for CUDA devices (or when CUDA is present and no device is given), else ``"gloo"``."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def create_rendezvous_store(host: str = "127.0.0.1", timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
                            ) -> dist.TCPStore:
    """A master TCPStore on a free port of ``host`` (``store.port``) for ``init_distributed_environment`` clients."""
    return dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_distributed_environment(rank: int, world_size: int, port: int, backend: str | None = None,
                                 host: str = "127.0.0.1",
                                 timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> GroupCoordinator:
    """Join the world through the rendezvous store at ``host:port`` (see ``create_rendezvous_store``).

    ``backend`` defaults to NCCL when CUDA is available, else gloo; with NCCL the CUDA device ``rank %
    device_count`` becomes current. Collectives time out after ``timeout_s``. Returns the world coordinator.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} / world_size={world_size}: need 0 <= rank < world_size")
    if dist.is_initialized():
        raise ValueError(f"torch.distributed is already initialized (world size {dist.get_world_size()})")
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, None, False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("ascent", store), rank=rank, world_size=world_size,
                            timeout=timeout)
    ranks = list(range(world_size))
    device_lease = _REGISTRY.acquire(ranks, backend, None, "shared", lambda: dist.GroupMember.WORLD)
    leases = [device_lease]
    cpu_lease = device_lease if backend == "gloo" else _acquire(ranks, "gloo", "shared", timeout_s)
    if cpu_lease is not device_lease:
        leases.append(cpu_lease)
    _STATE.world = GroupCoordinator("world", ranks, rank, cpu_lease.handle, device_lease.handle, leases)
    return _STATE.world


def _acquire(ranks: list[int], backend: str, domain: str, timeout_s: float) -> PGLease:
    return _REGISTRY.acquire(
        ranks, backend, None, domain,
        lambda: dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout_s)))


def _make_coordinator(name: str, rank_groups: list[list[int]], timeout_s: float) -> GroupCoordinator:
    """Create (or reuse) every group of ``rank_groups`` on every rank, in order; keep the one holding this rank."""
    rank, backend = dist.get_rank(), str(dist.get_backend())
    domain = reuse_domain_for(name)
    leases: list[PGLease] = []
    mine: tuple[list[int], Any, Any] | None = None
    for ranks in rank_groups:
        if len(ranks) == 1:
            mine = (ranks, None, None) if ranks[0] == rank else mine
            continue
        cpu = _acquire(ranks, "gloo", domain, timeout_s)
        device = _acquire(ranks, backend, domain, timeout_s)
        leases += [cpu, device]
        if rank in ranks:
            mine = (ranks, cpu.handle, device.handle)
    assert mine is not None, f"rank {rank} is in no {name} group"
    return GroupCoordinator(name, mine[0], rank, mine[1], mine[2], leases)


def initialize_model_parallel(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                              enable_expert_parallel: bool = False,
                              timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> None:
    """Build the TP, DP and EP groups from the initialized world (``world_size == tp * dp``). Collective: every
    rank calls it with the same arguments."""
    if not dist.is_initialized():
        raise ValueError("initialize_model_parallel needs init_distributed_environment first")
    tp, dp = tensor_parallel_size, data_parallel_size
    world = dist.get_world_size()
    if tp < 1 or dp < 1 or tp * dp != world:
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} != world size {world}")
    if _STATE.model_parallel_initialized:
        raise ValueError("model parallel groups are already initialized; call destroy_model_parallel first")
    _STATE.tp = _make_coordinator("tp", [[d * tp + t for t in range(tp)] for d in range(dp)], timeout_s)
    _STATE.dp = _make_coordinator("dp", [[d * tp + t for d in range(dp)] for t in range(tp)], timeout_s)
    ep_groups = [list(range(world))] if enable_expert_parallel else [[r] for r in range(world)]
    _STATE.ep = _make_coordinator("ep", ep_groups, timeout_s)
    _STATE.expert_parallel = enable_expert_parallel
    _STATE.model_parallel_initialized = True


def model_parallel_is_initialized() -> bool:
    return _STATE.model_parallel_initialized


def destroy_model_parallel() -> None:
    """Release the TP/DP/EP groups (reverse order) and reset them to size 1."""
    for name in ("ep", "dp", "tp"):
        getattr(_STATE, name).destroy()
        setattr(_STATE, name, GroupCoordinator.trivial(name))
    _STATE.model_parallel_initialized = False
    _STATE.expert_parallel = False


def destroy_distributed_environment() -> None:
    """Tear everything down: model-parallel groups, the world, the registry, then the default process group."""
    destroy_model_parallel()
    _STATE.world.destroy()
    _STATE.world = GroupCoordinator.trivial("world")
    _REGISTRY.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def get_world_group() -> GroupCoordinator:
    return _STATE.world


def get_tp_group() -> GroupCoordinator:
    return _STATE.tp


def get_dp_group() -> GroupCoordinator:
    return _STATE.dp


def get_ep_group() -> GroupCoordinator:
    """Expert-parallel group: DP x TP ranks with ``enable_expert_parallel``, else this rank alone."""
    return _STATE.ep


def expert_parallel_enabled() -> bool:
    return _STATE.expert_parallel


def init_tensor_parallel(rank: int, size: int, group: Any = None) -> None:
    """Set this process's tensor-parallel rank, world size and process group (``init_tensor_parallel(0, 1)`` resets)."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} is outside [0, {size})")
    _STATE.tp = GroupCoordinator("tp", list(range(size)), rank, group, group)


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp.world_size


def get_tensor_model_parallel_group() -> Any:
    return _STATE.tp.device_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (in place when size > 1); identity for size 1."""
    return _STATE.tp.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); identity for size 1."""
    return _STATE.tp.all_gather(x, dim)


def tensor_model_parallel_reduce_scatter(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of ``dim``; identity for size 1."""
    return _STATE.tp.reduce_scatter(x, dim)
