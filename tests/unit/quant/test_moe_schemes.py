"""Quantized MoE schemes inside the real FusedMoE: per-expert checkpoint keys land in the fused w13/w2 tensors,
apply_experts fast == reference, both == a per-expert float64 numpy loop of spec §2, and the routed forward equals a
token-by-token reference over the same routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack

from ascent.layers.fused_moe import FusedMoE, make_expert_params_mapping
from ascent.quantization.base import QuantSpec
from tests.unit.moe.helpers import naive_route
from tests.unit.quant.scheme_utils import SpecConfig, gaussian, np_per_token_int8, quant_sym, rel, t
from tests.unit.quant.test_weight_only_schemes import np_pairs

E, TOP_K, H, I = 4, 2, 128, 64
PROJ = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def np_silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def float_experts(seed: int) -> dict[str, np.ndarray]:
    return {f"experts.{e}.{p}.weight": gaussian(shape, seed + 3 * e + i, 0.05)
            for e in range(E) for i, (p, shape) in enumerate(PROJ.items())}


def quantize_experts(fw: dict[str, np.ndarray], bits: int, group: int | None = None) -> dict[str, np.ndarray]:
    """Per-expert RTN symmetric ints (one per byte) and scales: ``...weight`` int8, ``...weight_scale``."""
    out = {}
    for name, w in fw.items():
        q, s = quant_sym(w, bits, group)
        out[name], out[name + "_scale"] = q, s
    return out


def build(spec: QuantSpec, ck: dict[str, np.ndarray | torch.Tensor], suffixes: tuple[str, ...],
          **moe_kwargs) -> FusedMoE:
    """A quantized FusedMoE loaded through its weight loaders (experts not local to this EP rank are skipped)."""
    layer = FusedMoE(E, TOP_K, H, I, torch.float32, prefix="model.layers.0.mlp.experts",
                     quant_config=SpecConfig(spec), **moe_kwargs)
    params = dict(layer.named_parameters())
    for param_name, fragment, expert, shard in make_expert_params_mapping(E):
        for suffix in suffixes:
            param = params[param_name.removeprefix("experts.").replace("weight", suffix)]
            value = ck[fragment + suffix]
            param.weight_loader(param, value if isinstance(value, torch.Tensor) else t(value), fragment + suffix,
                                shard, expert)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def np_int8_expert(x: np.ndarray, ck: dict[str, np.ndarray], e: int) -> np.ndarray:
    """Spec §2 W8A8/W4A8 dynamic expert: quantized gate/up GEMM, SwiGLU, per-token re-quant, down GEMM."""
    def gemm(v: np.ndarray, proj: str) -> np.ndarray:
        vq, sv = np_per_token_int8(v)
        w, s = ck[f"experts.{e}.{proj}.weight"], ck[f"experts.{e}.{proj}.weight_scale"]
        return (vq @ w.astype(np.int64).T) * sv.astype(np.float64)[:, None] * s.astype(np.float64).T
    a = np_silu(gemm(x, "gate_proj")) * gemm(x, "up_proj")
    return gemm(a.astype(np.float32), "down_proj")


def np_w4a16_expert(x: np.ndarray, ck: dict[str, np.ndarray], e: int, g: int) -> np.ndarray:
    w = {p: ck[f"experts.{e}.{p}.weight"].astype(np.float64)
         * np.repeat(ck[f"experts.{e}.{p}.weight_scale"], g, 1) for p in PROJ}
    x = x.astype(np.float64)
    return (np_silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T


def check_layer(layer: FusedMoE, expert_fn, fp32_tol: float, numpy_tol: float) -> None:
    x = gaussian((24, H), 100)
    counts = torch.tensor([7, 0, 12, 5])
    method = layer.quant_method
    fast = method.apply_experts(layer, t(x), counts, "silu")
    assert rel(fast, method.scheme.apply_experts_reference(layer, t(x), counts, "silu")) < fp32_tol
    bounds = np.cumsum([0] + counts.tolist())
    expected = np.concatenate([expert_fn(x[bounds[e]:bounds[e + 1]], e) for e in range(E)])
    assert rel(fast, expected) < numpy_tol
    xb = t(x).bfloat16()
    assert rel(method.apply_experts(layer, xb, counts, "silu").float(),
               method.scheme.apply_experts_reference(layer, xb, counts, "silu").float()) < 1e-2
    logits = gaussian((10, E), 101)
    ids, weights = naive_route(t(logits), TOP_K)
    routed = layer(t(x[:10]), t(logits)).numpy()
    expected = np.stack([sum(w * expert_fn(x[i:i + 1], e)[0] for e, w in zip(ids[i], weights[i]))
                         for i in range(10)])
    assert rel(routed, expected) < numpy_tol


def test_w8a8_dynamic_moe_loading_and_math():
    ck = quantize_experts(float_experts(0), 8)
    ck.update({k.replace("_scale", "_offset"): np.zeros_like(v) for k, v in ck.items() if k.endswith("_scale")})
    layer = build(QuantSpec("W8A8_DYNAMIC", layer_type="moe"), ck, ("weight", "weight_scale", "weight_offset"))
    assert torch.equal(layer.w13_weight_scale[2, :I], t(ck["experts.2.gate_proj.weight_scale"]))
    assert torch.equal(layer.w13_weight_scale[2, I:], t(ck["experts.2.up_proj.weight_scale"]))
    assert torch.equal(layer.w2_weight[3], t(ck["experts.3.down_proj.weight"]))
    check_layer(layer, lambda x, e: np_int8_expert(x, ck, e), 1e-5, 1e-4)


def test_w8a8_dynamic_moe_rejects_offsets():
    ck = quantize_experts(float_experts(1), 8)
    ck.update({k.replace("_scale", "_offset"): np.ones_like(v) for k, v in ck.items() if k.endswith("_scale")})
    with pytest.raises(ValueError, match="w13_weight_offset"):
        build(QuantSpec("W8A8_DYNAMIC", layer_type="moe"), ck, ("weight", "weight_scale", "weight_offset"))


def modelslim_w4a8_experts(ck: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(ck)
    for e in range(E):
        for p in PROJ:
            q, s = ck[f"experts.{e}.{p}.weight"], ck[f"experts.{e}.{p}.weight_scale"]
            out[f"experts.{e}.{p}.weight"] = np_pairs(q)
            out[f"experts.{e}.{p}.weight_offset"] = np.zeros_like(s)
            chunks = 16 if p == "down_proj" else 1  # down: partial sums over 16 K-chunks
            parts = q.astype(np.float64).reshape(q.shape[0], chunks, -1).sum(-1)
            out[f"experts.{e}.{p}.scale_bias"] = (8.0 * parts * s).astype(np.float32)
    return out


def test_w4a8_dynamic_moe_modelslim_pairs():
    ck = quantize_experts(float_experts(2), 4)
    packed = modelslim_w4a8_experts(ck)
    layer = build(QuantSpec("W4A8_DYNAMIC", layer_type="moe", weight_bits=4), packed,
                  ("weight", "weight_scale", "weight_offset", "scale_bias"))
    assert torch.equal(layer.moe_q13[1, :I], t(ck["experts.1.gate_proj.weight"]))
    assert torch.equal(layer.moe_q2[1], t(ck["experts.1.down_proj.weight"]))
    check_layer(layer, lambda x, e: np_int8_expert(x, ck, e), 1e-5, 1e-4)
    packed["experts.0.down_proj.scale_bias"] = packed["experts.0.down_proj.scale_bias"] * 2
    with pytest.raises(ValueError, match="scale_bias"):
        build(QuantSpec("W4A8_DYNAMIC", layer_type="moe", weight_bits=4), packed,
              ("weight", "weight_scale", "weight_offset", "scale_bias"))


def test_w4a8_dynamic_moe_compressed_tensors():
    ck = quantize_experts(float_experts(3), 4)
    layer = build(QuantSpec("W4A8_DYNAMIC", layer_type="moe", source_format="compressed-tensors", weight_bits=4),
                  ck, ("weight", "weight_scale"))
    check_layer(layer, lambda x, e: np_int8_expert(x, ck, e), 1e-5, 1e-4)


@pytest.mark.parametrize("group", [32, 64])
def test_w4a16_moe_uses_spec_group_size(group):
    ck = quantize_experts(float_experts(4), 4, group)
    packed = {}
    for name, v in ck.items():
        if name.endswith(".weight"):
            packed[name + "_packed"] = ct_pack(t(v), 4, 1)
            packed[name + "_shape"] = torch.tensor(v.shape, dtype=torch.int64)
        else:
            packed[name] = v
    spec = QuantSpec("W4A16", layer_type="moe", source_format="compressed-tensors", weight_bits=4,
                     weight_strategy="group", group_size=group)
    layer = build(spec, packed, ("weight_packed", "weight_scale", "weight_shape"))
    assert layer.w13_weight_scale.shape == (E, 2 * I, H // group)
    assert layer.w13_weight_shape[1].tolist() == [[I, H], [I, H]]
    assert layer.moe_i4 is not None
    check_layer(layer, lambda x, e: np_w4a16_expert(x, ck, e, group), 1e-5, 1e-5)
