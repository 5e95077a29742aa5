"""310P scheme registry (spec §6): W8A8 static with int64 deq_scale, W8A8S on a sparse dense weight, W8A8_DYNAMIC
symmetric only, W8A8SC rejected; outputs against the numpy formulas of spec §2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.layers.fused_moe import FusedMoE
from ascent.layers.linear import ReplicatedLinear
from ascent.quantization.base import QuantSpec
from ascent.quantization.registry import DEFAULT_REGISTRY, REGISTRY_310P
from tests.unit.quant.scheme_utils import SpecConfig, finish, gaussian, load, np_static_int8, quant_sym, rel, t
from tests.unit.quant.test_linear_schemes import modelslim_w8a8

K, N = 256, 128


def build(quant_type: str, ck: dict[str, np.ndarray], dtype: torch.dtype = torch.float16) -> ReplicatedLinear:
    layer = ReplicatedLinear(K, N, bias=False, params_dtype=dtype,
                             quant_config=SpecConfig(QuantSpec(quant_type), REGISTRY_310P))
    load(layer, {k: t(v) for k, v in ck.items()})
    return finish(layer)


def test_310p_registry_contents():
    assert REGISTRY_310P.keys() == [("W8A8", "linear"), ("W8A8S", "linear"), ("W8A8SC", "linear"),
                                    ("W8A8_DYNAMIC", "linear"), ("W8A8_DYNAMIC", "moe")]
    with pytest.raises(NotImplementedError, match=r"\[310P\].*W4A16"):
        REGISTRY_310P.get("W4A16", "linear")
    assert issubclass(REGISTRY_310P.get("W8A8", "linear"), DEFAULT_REGISTRY.get("W8A8", "linear"))


@pytest.mark.parametrize("quant_type", ["W8A8", "W8A8S"])
def test_310p_w8a8_static_int64_deq_scale(quant_type):
    w = gaussian((N, K), 0, 0.02)
    if quant_type == "W8A8S":
        w[np.abs(w) < 0.02] = 0.0  # sparse-quant output: a dense int8 weight with many zeros
    x = gaussian((16, K), 1)
    ck = modelslim_w8a8(w, np.zeros(N, np.float32), x, deq_int64=True)
    assert ck["deq_scale"].dtype == np.int64
    layer = build(quant_type, ck)
    d = (np.float32(ck["input_scale"][0]) * ck["weight_scale"][:, 0]).astype(np.float32)
    acc = np_static_int8(x, ck["input_scale"][0], ck["input_offset"][0]) @ ck["weight"].astype(np.int64).T
    expected = d.astype(np.float64) * (acc + ck["quant_bias"])
    y = layer(t(x).half())
    assert y.dtype == torch.float16
    assert rel(y.float(), expected) < 2e-3  # fp16 output rounding
    assert rel(layer(t(x)), expected) < 1e-6


def test_310p_w8a8_dynamic_symmetric_only():
    q, s = quant_sym(gaussian((N, K), 2, 0.02), 8)
    offset = np.zeros_like(s)
    layer = build("W8A8_DYNAMIC", {"weight": q, "weight_scale": s, "weight_offset": offset})
    x = gaussian((4, K), 3)
    assert rel(layer(t(x)), layer.quant_method.apply_reference(layer, t(x))) < 1e-5
    offset[0] = 2.0
    with pytest.raises(ValueError, match="symmetric"):
        build("W8A8_DYNAMIC", {"weight": q, "weight_scale": s, "weight_offset": offset})


def test_310p_w8a8sc_rejected():
    with pytest.raises(ValueError, match="W8A8SC is a 310P-only compressed format; re-export as W8A8S/W8A8"):
        REGISTRY_310P.create(QuantSpec("W8A8SC"))


def test_310p_w8a8_dynamic_moe():
    layer = FusedMoE(2, 1, 32, 16, torch.float16, quant_config=SpecConfig(QuantSpec("W8A8_DYNAMIC", layer_type="moe"),
                                                                            REGISTRY_310P))
    assert type(layer.quant_method.scheme).__name__ == "W8A8DynamicMoE310P"
    assert layer.w13_weight.dtype == torch.int8 and layer.w13_weight_scale.dtype == torch.float32
