"""EPLB expert rearrangement of quantized FusedMoE experts: every per-expert tensor the scheme registered (int8 /
packed int4 weights, per-channel / per-group scales, offsets, scale biases, shape records) moves with its expert, the
scheme's derived operands (int8 copies, int4pack kernel operands, the dequantized-weight cache) follow, and the
layer output is unchanged. Single process (redundant slots, local copies) and two EP ranks over gloo (P2P moves of
all the tensors through ``exchange_layer``)."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack

from ascent.distributed import parallel_state as ps
from ascent.eplb.transfer import exchange_layer
from ascent.layers.fused_moe import FusedMoE
from ascent.quantization.base import QuantSpec
from tests.fixtures.spawn import run_spawned
from tests.unit.quant.scheme_utils import gaussian, t
from tests.unit.quant.test_moe_schemes import build as build_quantized_moe
from tests.unit.quant.test_moe_schemes import E, H, float_experts, modelslim_w4a8_experts, quantize_experts

WORLD, TIMEOUT_S = 2, 120.0
CASES = ("w8a8_dynamic", "w4a8_modelslim", "w4a8_ct", "w4a16_g32")
PLACEMENTS = ([3, 2, 1, 0, 3, 3], [2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1])  # 4 experts + 2 redundant slots


def checkpoint(name: str) -> tuple[QuantSpec, dict[str, np.ndarray | torch.Tensor], tuple[str, ...]]:
    """(spec, per-expert checkpoint tensors, tensor suffixes per projection) of one quantized expert format."""
    if name == "w8a8_dynamic":
        ck = quantize_experts(float_experts(10), 8)
        ck.update({k.replace("_scale", "_offset"): np.zeros_like(v) for k, v in ck.items() if k.endswith("_scale")})
        return QuantSpec("W8A8_DYNAMIC", layer_type="moe"), ck, ("weight", "weight_scale", "weight_offset")
    if name == "w4a8_modelslim":
        ck = modelslim_w4a8_experts(quantize_experts(float_experts(11), 4))
        return (QuantSpec("W4A8_DYNAMIC", layer_type="moe", weight_bits=4), ck,
                ("weight", "weight_scale", "weight_offset", "scale_bias"))
    if name == "w4a8_ct":
        ck = quantize_experts(float_experts(12), 4)
        return (QuantSpec("W4A8_DYNAMIC", layer_type="moe", source_format="compressed-tensors", weight_bits=4), ck,
                ("weight", "weight_scale"))
    assert name == "w4a16_g32"
    packed: dict[str, np.ndarray | torch.Tensor] = {}
    for key, value in quantize_experts(float_experts(13), 4, 32).items():
        if key.endswith(".weight"):
            packed[key + "_packed"] = ct_pack(t(value), 4, 1)
            packed[key + "_shape"] = torch.tensor(value.shape, dtype=torch.int64)
        else:
            packed[key] = value
    spec = QuantSpec("W4A16", layer_type="moe", source_format="compressed-tensors", weight_bits=4,
                     weight_strategy="group", group_size=32)
    return spec, packed, ("weight_packed", "weight_scale", "weight_shape")


def build(name: str, **moe_kwargs) -> FusedMoE:
    """The quantized FusedMoE of format ``name`` (see ``checkpoint``)."""
    return build_quantized_moe(*checkpoint(name), **moe_kwargs)


def inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return t(gaussian((num_tokens, H), seed)), t(gaussian((num_tokens, E), seed + 1)) * 2


def derived(layer: FusedMoE, slot: int) -> list[torch.Tensor]:
    """The scheme's derived per-slot operands (int8 copies / int4pack operands) of one local slot."""
    if hasattr(layer, "moe_q13"):
        return [layer.moe_q13[slot], layer.moe_q2[slot], layer.moe_s13[slot], layer.moe_s2[slot]]
    if getattr(layer, "moe_i4", None) is not None:
        (p13, sz13), _, (p2, sz2), _ = layer.moe_i4[slot]
        return [p13, sz13, p2, sz2]
    return []


def check_slots_hold_experts(layer: FusedMoE, reference: FusedMoE) -> None:
    """Every local slot holds exactly the tensors (and derived operands) of its logical expert in ``reference``."""
    names = layer.expert_tensor_names()
    assert names == reference.expert_tensor_names()
    for slot, e in enumerate(layer.expert_map.local_physical_to_logical().tolist()):
        for name, got, want in zip(names, layer.expert_weights(slot), reference.expert_weights(e)):
            assert torch.equal(got, want), f"slot {slot}: {name} is not expert {e}'s"
        for got, want in zip(derived(layer, slot), derived(reference, e), strict=True):
            assert torch.equal(got, want), f"slot {slot}: a derived operand is not expert {e}'s"


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_expert_tensor_names_cover_every_expert_parameter() -> None:
    layer = build("w4a8_modelslim")
    names = layer.expert_tensor_names()
    assert set(names) == {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_offset",
                          "w2_weight_offset", "w13_scale_bias", "w2_scale_bias"}
    per_slot = [n for n, p in layer.named_parameters() if p.dim() and p.shape[0] == layer.expert_map.num_local]
    assert sorted(per_slot) == sorted(names)
    assert build("w4a16_g32").expert_tensor_names() == (
        "w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale", "w13_weight_shape",
        "w2_weight_shape")


@pytest.mark.parametrize("name", CASES)
def test_rearrangement_moves_all_quantized_tensors_and_keeps_outputs(name: str) -> None:
    reference = build(name)
    layer = build(name, num_redundant_experts=2)
    assert layer.expert_map.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
    x, logits = inputs(11, 20)
    before = layer(x, logits)
    close(before, reference(x, logits))
    check_slots_hold_experts(layer, reference)
    for placement in PLACEMENTS:
        moves = layer.rearrange_experts(placement)
        assert layer.expert_map.physical_to_logical.tolist() == placement and moves
        check_slots_hold_experts(layer, reference)
        close(layer(x, logits), before)


def test_w4a16_dense_cache_is_rebuilt_after_rearrangement() -> None:
    """The dequantized-weight cache (the path when the int4pack kernel cannot take the shapes) is per slot: a stale
    cache would send tokens through the slot's previous expert."""
    reference = build("w4a16_g32")
    layer = build("w4a16_g32", num_redundant_experts=2)
    layer.moe_i4 = None  # force the dense path
    reference.moe_i4 = None
    x, logits = inputs(9, 30)
    before = layer(x, logits)
    close(before, reference(x, logits))
    assert torch.float32 in layer.moe_dense
    layer.rearrange_experts(PLACEMENTS[0])
    assert layer.moe_dense == {}
    close(layer(x, logits), before)
    dense, ref_dense = layer.moe_dense[torch.float32], reference.moe_dense[torch.float32]
    for slot, e in enumerate(PLACEMENTS[0]):
        assert torch.equal(dense[0][slot], ref_dense[0][e]) and torch.equal(dense[1][slot], ref_dense[1][e])


def test_rejected_rearrangement_changes_nothing() -> None:
    layer = build("w8a8_dynamic", num_redundant_experts=2)
    x, logits = inputs(5, 40)
    before = layer(x, logits)
    with pytest.raises(ValueError, match=r"logical experts \[3\]"):
        layer.rearrange_experts([0, 1, 2, 2, 0, 1])
    assert layer.expert_map.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
    close(layer(x, logits), before)


def _child(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    try:
        references = {name: build(name) for name in ("w8a8_dynamic", "w4a16_g32")}  # before the groups: EP = 1
        ps.init_distributed_environment(rank, WORLD, port, "gloo", timeout_s=TIMEOUT_S)
        ps.initialize_model_parallel(WORLD, 1, enable_expert_parallel=True, timeout_s=TIMEOUT_S)
        group = ps.get_ep_group()
        for name, reference in references.items():
            layer = build(name, num_redundant_experts=2)  # [0, 1, 2 | 3, 0, 1]: 3 slots per rank
            assert layer.use_ep and layer.expert_map.num_local == 3
            check_slots_hold_experts(layer, reference)
            x, logits = inputs(9, 50)
            before = layer(x, logits)
            close(before, reference(x, logits))
            expert_bytes = sum(w.numel() * w.element_size() for w in layer.expert_weights(0))
            for placement in ([3, 2, 0, 1, 0, 2], [1, 1, 3, 0, 2, 3], [0, 1, 2, 3, 0, 1]):
                result = exchange_layer(layer, torch.tensor(placement), group)
                assert layer.expert_map.physical_to_logical.tolist() == placement
                assert result.bytes_received == sum(t.dst_rank == rank for t in result.transfers) * expert_bytes
                check_slots_hold_experts(layer, reference)
                close(layer(x, logits), before)
            if rank == 0:  # a fetch that delivers only the weights (no scales) is refused before anything changes
                def partial(move):
                    return reference.expert_weights(move.new_logical)[:1]
                try:
                    layer.rearrange_experts([3, 2, 0, 1, 0, 2], partial)
                except ValueError as err:
                    assert "tensors" in str(err), err
                else:
                    raise AssertionError("a partial expert was accepted")
                assert layer.expert_map.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
                check_slots_hold_experts(layer, reference)
        ps.destroy_distributed_environment()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_two_rank_p2p_moves_of_quantized_experts_keep_weights_and_outputs() -> None:
    run_spawned(_child, WORLD, TIMEOUT_S)
