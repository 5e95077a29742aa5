"""Two gloo processes: TP/DP/EP group layout and registry reuse, the collective helpers of ``comm`` and
``GroupCoordinator``, and the TCPStore side-channel group. Each child runs every check and reports a traceback or
"ok" through a queue; the parent waits with bounded timeouts and terminates stragglers."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from ascent.distributed import comm
from ascent.distributed import parallel_state as ps
from ascent.distributed.pg_registry import reuse_domain_for
from ascent.distributed.stateless_group import StatelessProcessGroup
from tests.fixtures.spawn import run_spawned

WORLD = 2
TIMEOUT_S = 120.0


def _check_model_parallel_groups(rank: int) -> None:
    registry = ps.get_pg_registry()
    ps.initialize_model_parallel(2, 1, enable_expert_parallel=True, timeout_s=TIMEOUT_S)
    tp, dp, ep = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group()
    assert (tp.ranks, tp.rank_in_group, dp.ranks, ep.ranks) == ([0, 1], rank, [rank], [0, 1])
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_tensor_model_parallel_rank() == rank
    # "tp" and "ep" have the world's ranks and backend: the registry hands back the default group, no new_group
    assert tp.device_group is dist.GroupMember.WORLD and ep.cpu_group is dist.GroupMember.WORLD
    assert registry.misses == 1 and registry.hits >= 4
    x = torch.full((3,), float(rank + 1))
    assert torch.equal(ps.tensor_model_parallel_all_reduce(x), torch.full((3,), 3.0))
    gathered = ps.tensor_model_parallel_all_gather(torch.full((2, 1), float(rank)), dim=-1)
    assert torch.equal(gathered, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    scattered = ps.tensor_model_parallel_reduce_scatter(torch.arange(4.0).reshape(4, 1))
    assert torch.equal(scattered, (2 * torch.arange(4.0).reshape(4, 1))[2 * rank: 2 * rank + 2])
    assert tp.broadcast_object({"from": rank}, src_in_group=1) == {"from": 1}
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 2, timeout_s=TIMEOUT_S)
    tp, dp, ep = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group()
    assert (tp.ranks, dp.ranks, dp.rank_in_group, ep.ranks) == ([rank], [0, 1], rank, [rank])
    assert dp.device_group is dist.GroupMember.WORLD and not ps.expert_parallel_enabled()
    y = torch.ones(2)
    assert ps.tensor_model_parallel_all_reduce(y) is y and torch.equal(y, torch.ones(2))
    ps.destroy_model_parallel()
    isolated = registry.acquire([0, 1], "gloo", None, reuse_domain_for("eplb"),
                                lambda: dist.new_group([0, 1], backend="gloo"))
    assert isolated.handle is not dist.GroupMember.WORLD
    z = torch.tensor([1.0])
    dist.all_reduce(z, group=isolated.handle)
    assert z.item() == 2.0
    registry.release(isolated)


def _check_comm_helpers(rank: int) -> None:
    out = torch.empty(4, 2)
    comm.all_gather_into(out, torch.full((2, 2), float(rank)))
    assert torch.equal(out, torch.tensor([[0.0] * 2] * 2 + [[1.0] * 2] * 2))
    cols = comm.reduce_scatter(torch.arange(8.0).reshape(2, 4) * (rank + 1), dim=1)
    assert torch.equal(cols, (3 * torch.arange(8.0).reshape(2, 4))[:, 2 * rank: 2 * rank + 2])
    # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 rows to rank 0 and none to itself
    splits = [1, 2] if rank == 0 else [3, 0]
    x = torch.arange(3.0).unsqueeze(1) + 10 * rank
    received = comm.all_to_all_uneven(x, splits)
    expected = torch.tensor([[0.0], [10.0], [11.0], [12.0]]) if rank == 0 else torch.tensor([[1.0], [2.0]])
    assert torch.equal(received, expected)
    assert comm.exchange_split_sizes(splits) == ([1, 3] if rank == 0 else [2, 0])
    assert torch.equal(comm.broadcast_via_all_gather(torch.tensor([rank, 7]), 1), torch.tensor([1, 7]))
    big = torch.tensor([2**40 + rank, -rank], dtype=torch.int64)
    assert comm.all_reduce_int64_via_all_gather(big, "sum").tolist() == [2**41 + 1, -1]
    assert comm.all_reduce_int64_via_all_gather(big, "max").tolist() == [2**40 + 1, 0]


def _check_stateless_group(rank: int) -> None:
    world = ps.get_world_group()
    group = StatelessProcessGroup.create("127.0.0.1", 0, 0, WORLD, timeout_s=30) if rank == 0 else None
    port = world.broadcast_object(group.port if group else None, src_in_group=0)
    group = group or StatelessProcessGroup.create("127.0.0.1", port, rank, WORLD, timeout_s=30)
    peer = 1 - rank
    group.send_obj({"hello": rank}, peer)
    group.send_obj([rank] * 3, peer)
    assert group.recv_obj(peer) == {"hello": peer} and group.recv_obj(peer) == [peer] * 3
    assert group.broadcast_obj("payload" if rank == 1 else None, src=1) == "payload"
    assert group.all_gather_obj(rank * 10) == [0, 10]
    group.barrier()
    world.barrier()  # rank 0 hosts the store: keep it up until rank 1 is done with it
    if rank == 0:  # every consumed message was deleted (the shared ones by their last reader)
        assert group.store.num_keys() == 0, group.store.num_keys()


def _child(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        ps.init_distributed_environment(rank, WORLD, port, "gloo", timeout_s=TIMEOUT_S)
        _check_model_parallel_groups(rank)
        _check_comm_helpers(rank)
        _check_stateless_group(rank)
        ps.destroy_distributed_environment()
        assert not dist.is_initialized() and len(ps.get_pg_registry()) == 0
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_groups_collectives_and_side_channel_over_gloo() -> None:
    run_spawned(_child, WORLD, TIMEOUT_S)


def test_single_process_defaults_and_validation() -> None:
    assert ps.get_tp_group().world_size == 1 and ps.get_ep_group().world_size == 1
    assert ps.get_tensor_model_parallel_group() is None and not ps.model_parallel_is_initialized()
    x = torch.ones(2)
    assert ps.get_tp_group().all_gather(x) is x and ps.get_dp_group().broadcast_object("a") == "a"
    with pytest.raises(ValueError, match="init_distributed_environment"):
        ps.initialize_model_parallel(2)
    with pytest.raises(ValueError, match="backend='mpi'"):
        ps.init_distributed_environment(0, 1, 1, backend="mpi")
    with pytest.raises(ValueError, match="rank=2"):
        ps.init_distributed_environment(2, 2, 1)
    with pytest.raises(ValueError, match="rank=3"):
        StatelessProcessGroup.create("127.0.0.1", 0, 3, 2)
