"""Expert parallelism over gloo with two spawned processes: every dispatcher (all-gather + reduce-scatter,
all-to-all, MC2 emulation) gives the single-process FusedMoE output, with the default and a redundant-replica placement,
uneven and empty token slices, the profile's size-based choice, and a run-time re-placement that fetches a remote
expert. Plus single-process checks of the policy table and the dispatcher contracts.

Each child reports "ok" or a traceback through a queue; the parent waits with bounded timeouts and kills stragglers.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from ascent.distributed import parallel_state as ps
from ascent.layers.fused_moe import ExpertMap, FusedMoE, MoECommType, select_moe_comm
from ascent.layers.fused_moe.dispatcher import MC2Dispatcher, make_dispatcher
from tests.unit.moe.helpers import load_experts, random_experts
from tests.fixtures.spawn import run_spawned

WORLD, TIMEOUT_S = 2, 120.0
E, K, H, INTER = 8, 2, 16, 12
COMMS = (MoECommType.ALLGATHER, MoECommType.ALLTOALL, MoECommType.MC2)


def _inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, H, generator=g), torch.randn(num_tokens, E, generator=g) * 2


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _check_layer_dispatch(ckpt: dict, ref: FusedMoE) -> None:
    ep = ps.get_ep_group()
    for placement in (None, [0, 1, 2, 3, 4, 5, 6, 7, 2, 5], [7, 2, 5, 0, 2, 1, 6, 3, 4, 5]):
        em = ExpertMap(E, WORLD, ep.rank_in_group, placement) if placement else None
        layer = FusedMoE(E, K, H, INTER, torch.float32, expert_map=em)
        assert layer.use_ep and layer.w13_weight.shape[0] == len(placement or range(E)) // WORLD
        assert load_experts(layer, ckpt) == 3 * len(set(layer.expert_map.local_physical_to_logical().tolist()))
        for num_tokens in (13, 1):  # 7 + 6 tokens per rank; 1 + 0 (an empty rank)
            x, logits = _inputs(num_tokens, seed=num_tokens)
            expected = ref(x, logits)
            outs = {}
            for kind in COMMS:
                layer.forced_comm = kind
                outs[kind] = layer(x, logits)
                _close(outs[kind], expected)
                rows = ep.all_reduce(layer.last_expert_tokens.sum().reshape(1))
                assert int(rows) == num_tokens * K, (kind, int(rows))
            _close(outs[MoECommType.ALLGATHER], outs[MoECommType.ALLTOALL])


def _check_policy_choice(ckpt: dict, ref: FusedMoE) -> None:
    layer = FusedMoE(E, K, H, INTER, torch.float32)
    load_experts(layer, ckpt)
    assert str(layer.profile.moe_comm) == "size_based"
    for num_tokens, kind in ((13, MoECommType.ALLGATHER), (200, MoECommType.ALLTOALL)):
        assert layer.select_comm(-(-num_tokens // WORLD)) == kind
        x, logits = _inputs(num_tokens, seed=3)
        _close(layer(x, logits), ref(x, logits))


def _check_dispatchers_uneven(rank: int) -> None:
    """Different token counts per rank (5 and 3), experts = multiply by (physical slot + 1): exact reference."""
    ep = ps.get_ep_group()
    g = torch.Generator().manual_seed(10 + rank)
    n = 5 if rank == 0 else 3
    x, w = torch.randn(n, H, generator=g), torch.rand(n, K, generator=g)
    ids = torch.stack([torch.randperm(10, generator=g)[:K] for _ in range(n)]).to(torch.int32)
    expected = sum(w[:, j: j + 1] * x * (ids[:, j: j + 1].float() + 1) for j in range(K))
    for kind in COMMS:
        dispatcher = make_dispatcher(kind, ep, 10)

        def scale_by_slot(rows: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
            slot = torch.repeat_interleave(torch.arange(5), group_list) + dispatcher.local_start
            return rows * (slot.float() + 1).unsqueeze(1)

        _close(dispatcher.run(x, w, ids, scale_by_slot), expected)
    # only rank 0 exceeds the capacity, yet both ranks raise (nobody is left waiting in a collective)
    try:
        MC2Dispatcher(ep, 10, capacity=4).dispatch(x, w, ids)
    except ValueError as err:
        assert "[5, 3] exceed the MC2 capacity 4" in str(err)
    else:
        raise AssertionError("MC2 capacity overflow was not reported")


def _check_rearrange_with_fetch(ckpt: dict, ref: FusedMoE) -> None:
    layer = FusedMoE(E, K, H, INTER, torch.float32, num_redundant_experts=2)  # [0..7, 0, 1], 5 slots per rank
    load_experts(layer, ckpt)

    def fetch(move):  # stands in for the EPLB transfer from move.sources
        e = move.new_logical
        assert layer.expert_map.rank_of_physical(move.sources[0]) != layer.ep_group.rank_in_group
        w13 = torch.cat([ckpt[f"experts.{e}.gate_proj.weight"], ckpt[f"experts.{e}.up_proj.weight"]])
        return w13, ckpt[f"experts.{e}.down_proj.weight"]

    moves = layer.rearrange_experts([7, 6, 2, 3, 0, 5, 1, 4, 3, 6], fetch)
    assert moves and all(m.new_logical == layer.expert_map.physical_to_logical[m.physical_slot] for m in moves)
    x, logits = _inputs(9, seed=4)
    for kind in COMMS:
        layer.forced_comm = kind
        _close(layer(x, logits), ref(x, logits))


def _child(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        ckpt = random_experts(E, H, INTER, seed=1)
        ref = FusedMoE(E, K, H, INTER, torch.float32)  # built before the groups exist: EP = 1 reference
        load_experts(ref, ckpt)
        ps.init_distributed_environment(rank, WORLD, port, "gloo", timeout_s=TIMEOUT_S)
        ps.initialize_model_parallel(WORLD, 1, enable_expert_parallel=True, timeout_s=TIMEOUT_S)
        _check_layer_dispatch(ckpt, ref)
        _check_policy_choice(ckpt, ref)
        _check_dispatchers_uneven(rank)
        _check_rearrange_with_fetch(ckpt, ref)
        ps.destroy_distributed_environment()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_expert_parallel_dispatch_equals_single_process() -> None:
    run_spawned(_child, WORLD, TIMEOUT_S)


@pytest.mark.parametrize("policy, ep, tokens, expected", [
    ("size_based", 1, 1000, "local"),
    ("allgather", 2, 1000, "allgather"),
    ("size_based", 2, 63, "allgather"),
    ("size_based", 2, 64, "alltoall"),
    ("capacity_density", 16, 512, "mc2"),
    ("capacity_density", 8, 10, "allgather"),
    ("capacity_density", 16, 513, "allgather"),
    ("fused_or_capacity", 2, 512, "mc2"),
    ("fused_or_capacity", 2, 513, "alltoall"),
    ("capacity_world", 2, 100, "mc2"),
    ("capacity_world", 16, 600, "alltoall"),
    ("capacity_world", 4, 600, "allgather"),
])
def test_select_moe_comm_policy_table(policy: str, ep: int, tokens: int, expected: str) -> None:
    assert select_moe_comm(policy, ep, tokens) == MoECommType(expected)


def test_dispatcher_contracts_single_rank() -> None:
    group = ps.GroupCoordinator.trivial("ep")
    x, w = torch.randn(5, H), torch.rand(5, K)
    ids = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 3], [3, 2]], dtype=torch.int32)
    identity = lambda rows, group_list: rows  # noqa: E731
    for kind in ("local", "allgather", "alltoall", "mc2"):
        dispatched = make_dispatcher(kind, group, 4).dispatch(x, w, ids)
        assert dispatched.group_list.tolist() == [2, 2, 2, 4]
        assert torch.equal(dispatched.hidden[:2], x[[0, 2]])  # expert 0's rows, token order
        _close(make_dispatcher(kind, group, 4).run(x, w, ids, identity), w.sum(1, keepdim=True) * x)
    with pytest.raises(ValueError, match=r"tokens per EP rank \[5\] exceed the MC2 capacity 2"):
        MC2Dispatcher(group, 4, capacity=2).dispatch(x, w, ids)
    with pytest.raises(ValueError, match="does not split"):
        make_dispatcher("alltoall", ps.GroupCoordinator("ep", [0, 1], 0), 5)
    with pytest.raises(ValueError, match="'local' needs ep size 1"):
        make_dispatcher("local", ps.GroupCoordinator("ep", [0, 1], 0), 4)
    with pytest.raises(ValueError, match="'ring'"):
        make_dispatcher("ring", group, 4)
