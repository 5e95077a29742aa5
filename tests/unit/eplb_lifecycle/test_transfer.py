"""Transfer planning (pure bookkeeping) and, over gloo with two spawned processes, batched P2P expert moves: after
a rebalance every slot holds exactly the checkpoint weights of its new logical expert; the layer output is unchanged."""

from __future__ import annotations

import traceback

import pytest
import torch

from ascent.distributed import parallel_state as ps
from ascent.eplb.transfer import Transfer, exchange_layer, make_fetch, plan_transfers
from ascent.layers.fused_moe import FusedMoE
from ascent.layers.fused_moe.expert_map import ExpertMove
from tests.fixtures.spawn import run_spawned
from tests.unit.moe.helpers import load_experts, random_experts

WORLD, TIMEOUT_S = 2, 120.0
E, K, H, INTER = 4, 2, 8, 6


def test_plan_swaps_experts_between_ranks() -> None:
    plan = plan_transfers([0, 1, 2, 3], [0, 2, 1, 3], ep_size=2)
    assert plan == [Transfer(2, 1, 0, 0), Transfer(1, 0, 1, 1)]


def test_plan_skips_local_reshuffles_and_receives_once() -> None:
    assert plan_transfers([0, 1, 2, 3], [1, 0, 3, 2], ep_size=2) == []
    plan = plan_transfers([0, 1, 2, 3, 0, 1], [3, 3, 2, 0, 1, 2], ep_size=2)  # rank 0 needs 3 twice: one receive
    assert plan == [Transfer(3, 1, 0, 0), Transfer(2, 0, 2, 1)]


def test_plan_spreads_sources_over_replica_holders() -> None:
    plan = plan_transfers([0, 1, 0, 1, 2, 3], [2, 3, 2, 3, 0, 1], ep_size=3)
    to_rank2 = [t for t in plan if t.dst_rank == 2]
    assert [(t.logical, t.src_rank) for t in to_rank2] == [(0, 0), (1, 1)]
    assert len(plan) == 6 and all(t.src_rank != t.dst_rank for t in plan)


def test_plan_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="ep_size=2"):
        plan_transfers([0, 1, 2], [0, 1, 2], ep_size=2)
    with pytest.raises(ValueError, match="logical expert 5"):
        plan_transfers([0, 1, 2, 3], [0, 1, 5, 3], ep_size=2)


def test_fetch_serves_received_weights_and_names_missing() -> None:
    w = (torch.ones(2, 2), torch.zeros(2, 1))
    fetch = make_fetch({3: w})
    assert fetch(ExpertMove(0, 0, 1, 3, (2,))) is w
    with pytest.raises(ValueError, match="expert 2"):
        fetch(ExpertMove(1, 1, 0, 2, (3,)))


def test_single_rank_exchange_is_local_rearrangement() -> None:
    ckpt = random_experts(E, H, INTER, seed=2)
    layer = FusedMoE(E, K, H, INTER, torch.float32)
    load_experts(layer, ckpt)
    x, logits = torch.randn(7, H), torch.randn(7, E)
    before = layer(x, logits)
    result = exchange_layer(layer, torch.tensor([3, 2, 1, 0]), ps.get_ep_group())
    assert result.transfers == [] and result.bytes_received == 0 and len(result.moves) == 4
    torch.testing.assert_close(layer(x, logits), before, rtol=0, atol=1e-6)


def _check_weights(layer: FusedMoE, reference: FusedMoE) -> None:
    for slot, e in enumerate(layer.expert_map.local_physical_to_logical().tolist()):
        for got, want in zip(layer.expert_weights(slot), reference.expert_weights(e)):
            assert torch.equal(got, want), f"slot {slot} does not hold expert {e}"


def _child(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        ckpt = random_experts(E, H, INTER, seed=1)
        reference = FusedMoE(E, K, H, INTER, torch.float32)  # built before the groups exist: all experts local
        load_experts(reference, ckpt)
        ps.init_distributed_environment(rank, WORLD, port, "gloo", timeout_s=TIMEOUT_S)
        ps.initialize_model_parallel(WORLD, 1, enable_expert_parallel=True, timeout_s=TIMEOUT_S)
        layer = FusedMoE(E, K, H, INTER, torch.float32, num_redundant_experts=2)
        load_experts(layer, ckpt)
        g = torch.Generator().manual_seed(5)
        x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
        before = layer(x, logits)
        for new in ([3, 2, 0, 1, 0, 2], [1, 1, 3, 0, 2, 3], [0, 1, 2, 3, 0, 1]):
            result = exchange_layer(layer, torch.tensor(new), ps.get_ep_group())
            assert layer.expert_map.physical_to_logical.tolist() == new
            assert result.bytes_received == sum(t.dst_rank == rank for t in result.transfers) * 4 * (2 * INTER * H
                                                                                                   + H * INTER)
            _check_weights(layer, reference)
            torch.testing.assert_close(layer(x, logits), before, rtol=1e-6, atol=1e-6)
        ps.destroy_distributed_environment()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_two_rank_p2p_moves_keep_weights_and_outputs() -> None:
    run_spawned(_child, WORLD, TIMEOUT_S)
