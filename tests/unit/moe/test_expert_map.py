"""ExpertMap placement/replica logic, and FusedMoE in one process: vs a naive per-token loop, redundant replicas and
run-time re-placement give identical outputs, TP-sliced loading, shared experts, weight-loader validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ascent.distributed.parallel_state import init_tensor_parallel
from ascent.layers.fused_moe import ExpertMap, FusedMoE, MoECommType
from ascent.layers.fused_moe.router import ChunkedSoftmaxTopKRouter
from ascent.platform import get_hardware_profile, set_current_profile
from tests.unit.moe.helpers import load_experts, naive_moe, random_experts

E, K, H, INTER = 8, 2, 16, 12


def test_default_placement_is_identity() -> None:
    em = ExpertMap(8)
    assert em.num_physical == em.num_local == 8 and em.num_redundant == 0
    ids = torch.randint(0, 8, (5, 2))
    assert torch.equal(em.to_physical(ids), ids.to(torch.int32))
    assert em.local_slots(3) == [3]


def test_redundant_placement_views() -> None:
    rank1 = ExpertMap(4, ep_size=2, ep_rank=1, num_redundant=2)
    assert rank1.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
    assert (rank1.num_local, rank1.local_start) == (3, 3)
    assert rank1.local_physical_to_logical().tolist() == [3, 0, 1]
    assert rank1.local_slots(0) == [1] and rank1.local_slots(2) == []
    assert rank1.replica_counts.tolist() == [2, 2, 1, 1]
    assert rank1.logical_to_physical.tolist() == [[0, 4], [1, 5], [2, -1], [3, -1]]
    assert rank1.rank_of_physical(4) == 1


def test_to_physical_spreads_over_replicas_by_global_token() -> None:
    em = ExpertMap(4, physical_to_logical=[0, 1, 2, 3, 0, 0])
    ids = torch.tensor([[0, 1]] * 6)
    phys = em.to_physical(ids, token_offset=10)
    assert phys[:, 0].tolist() == [[0, 4, 5][(10 + t) % 3] for t in range(6)]
    assert phys[:, 1].tolist() == [1] * 6
    assert torch.equal(em.physical_to_logical[phys.long()], ids)


def test_update_placement_reports_local_moves() -> None:
    em = ExpertMap(4, ep_size=2, ep_rank=0, physical_to_logical=[0, 1, 2, 3])
    moves = em.update_placement([3, 1, 0, 2])
    assert [(m.local_slot, m.old_logical, m.new_logical, m.sources) for m in moves] == [(0, 0, 3, (3,))]
    assert em.local_physical_to_logical().tolist() == [3, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_logical=4, ep_size=2, physical_to_logical=[0, 1, 2]), "split evenly"),
    (dict(num_logical=4, physical_to_logical=[0, 1, 2, 2]), r"logical experts \[3\]"),
    (dict(num_logical=4, physical_to_logical=[0, 1, 2, 4]), "outside"),
    (dict(num_logical=4, ep_size=2, ep_rank=2), "ep_rank=2"),
    (dict(num_logical=4, num_redundant=-1), "num_redundant=-1"),
])
def test_expert_map_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExpertMap(**kwargs)
    with pytest.raises(ValueError, match="5 slots"):
        ExpertMap(4).update_placement([0, 1, 2, 3, 0])


def make_layer(expert_map: ExpertMap | None = None, **kwargs) -> FusedMoE:
    return FusedMoE(E, K, H, INTER, torch.float32, expert_map=expert_map, **kwargs)


@pytest.fixture
def data() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return random_experts(E, H, INTER, seed=1), torch.randn(13, H), torch.randn(13, E) * 2


def test_layer_matches_naive_loop(data) -> None:
    ckpt, x, logits = data
    layer = make_layer()
    assert load_experts(layer, ckpt) == 3 * E
    torch.testing.assert_close(layer(x, logits).double(), naive_moe(x, logits, ckpt, K), rtol=1e-5, atol=1e-6)
    assert int(layer.last_expert_tokens.sum()) == 13 * K


def test_grouped_sigmoid_bias_scaled_layer_matches_naive_loop(data) -> None:
    ckpt, x, logits = data
    layer = make_layer(renormalize=True, scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4,
                       topk_group=2, e_score_correction_bias=True, routed_scaling_factor=2.5)
    load_experts(layer, ckpt)
    bias = torch.randn(E) * 0.2
    layer.e_score_correction_bias.weight_loader(layer.e_score_correction_bias, bias.double())
    assert layer.e_score_correction_bias.dtype == torch.float32
    ref = naive_moe(x, logits, ckpt, K, scoring="sigmoid", bias=bias, groups=4, topk_group=2, scale=2.5)
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-6)


def test_redundant_replicas_give_identical_outputs(data) -> None:
    ckpt, x, logits = data
    logits = logits + 20.0 * (torch.arange(E) == 5)  # every token picks the thrice-replicated expert 5
    plain = make_layer()
    load_experts(plain, ckpt)
    placement = [5, 3, 0, 7, 1, 6, 2, 4, 5, 5, 0, 3]
    redundant = make_layer(ExpertMap(E, physical_to_logical=placement))
    assert redundant.w13_weight.shape[0] == 12
    load_experts(redundant, ckpt)
    assert torch.equal(redundant.w13_weight[9], redundant.w13_weight[0])
    ref = plain(x, logits)
    torch.testing.assert_close(redundant(x, logits), ref, rtol=1e-6, atol=1e-7)
    loads = redundant.last_expert_tokens
    assert [int(loads[i]) for i in (0, 8, 9)] == [5, 4, 4]  # 13 tokens, round-robin over the replicas


def test_rearrange_experts_keeps_outputs(data) -> None:
    ckpt, x, logits = data
    layer = make_layer(num_redundant_experts=2)
    load_experts(layer, ckpt)
    ref = layer(x, logits)
    moves = layer.rearrange_experts([7, 6, 5, 4, 3, 2, 1, 0, 3, 3])
    assert len(moves) == 10 and layer.expert_map.physical_to_logical.tolist()[0] == 7
    assert torch.equal(layer.w2_weight[0], ckpt["experts.7.down_proj.weight"])
    torch.testing.assert_close(layer(x, logits), ref, rtol=1e-6, atol=1e-7)


def test_tp_sliced_loading() -> None:
    ckpt = random_experts(E, H, INTER, seed=2)
    init_tensor_parallel(1, 2)
    try:
        layer = make_layer()
        load_experts(layer, ckpt)
    finally:
        init_tensor_parallel(0, 1)
    half = INTER // 2
    assert layer.w13_weight.shape == (E, INTER, H) and layer.w2_weight.shape == (E, H, half)
    assert torch.equal(layer.w13_weight[3, :half], ckpt["experts.3.gate_proj.weight"][half:])
    assert torch.equal(layer.w13_weight[3, half:], ckpt["experts.3.up_proj.weight"][half:])
    assert torch.equal(layer.w2_weight[3], ckpt["experts.3.down_proj.weight"][:, half:])


def test_shared_experts_added(data) -> None:
    ckpt, x, logits = data
    torch.manual_seed(3)
    shared, gate = nn.Linear(H, H, bias=False), nn.Linear(H, 1, bias=False)
    layer = make_layer(shared_experts=shared, shared_expert_gate=gate)
    routed = make_layer()
    load_experts(layer, ckpt)
    load_experts(routed, ckpt)
    with torch.no_grad():
        expected = routed(x, logits) + torch.sigmoid(gate(x)) * shared(x)
        torch.testing.assert_close(layer(x, logits), expected)


def test_310p_profile_selects_chunked_router(data) -> None:
    ckpt, x, logits = data
    previous = set_current_profile(get_hardware_profile("310p"))
    try:
        layer = make_layer()
    finally:
        set_current_profile(previous)
    assert isinstance(layer.router, ChunkedSoftmaxTopKRouter) and layer.select_comm(10) == MoECommType.LOCAL
    load_experts(layer, ckpt)
    ref = naive_moe(x, logits.half().float(), ckpt, K)
    torch.testing.assert_close(layer(x, logits).double(), ref, rtol=1e-5, atol=1e-6)


def test_weight_loader_and_forward_validation(data) -> None:
    ckpt, x, logits = data
    layer = make_layer()
    w13, w2 = layer.w13_weight, layer.w2_weight
    gate = ckpt["experts.0.gate_proj.weight"]
    with pytest.raises(ValueError, match="shard_id 'w4'"):
        w13.weight_loader(w13, gate, "g", "w4", 0)
    with pytest.raises(ValueError, match="does not belong"):
        w2.weight_loader(w2, gate, "g", "w1", 0)
    with pytest.raises(ValueError, match="expert_id 8"):
        w13.weight_loader(w13, gate, "g", "w1", 8)
    with pytest.raises(ValueError, match=r"g: w1 shape \(12, 15\)"):
        w13.weight_loader(w13, gate[:, :15], "g", "w1", 0)
    with pytest.raises(ValueError, match="hidden_states shape"):
        layer(x[:, :5], logits)
    with pytest.raises(ValueError, match="router_logits shape"):
        layer(x, logits[:, :4])
    with pytest.raises(ValueError, match="activation='relu'"):
        make_layer(activation="relu")
    with pytest.raises(ValueError, match="expert_map"):
        make_layer(ExpertMap(E, ep_size=2))
    with pytest.raises(ValueError, match=r"logical experts \[7\]"):
        layer.rearrange_experts([0, 1, 2, 3, 4, 5, 6, 6])
    assert layer.expert_map.physical_to_logical.tolist() == list(range(E))
