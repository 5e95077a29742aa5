"""Quantized kernels against numpy integer / float64 references: exact int32 accumulation, static/dynamic int8
epilogues, per-group int8 products, the int4pack conversion (w = (u - 8) * scale + zero) and the path switches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ascent.layers.cpu_kernels import amx_ops
from ascent.layers.cpu_packing import small_m_kernel, small_m_max
from ascent.layers.linear import ReplicatedLinear
from ascent.quantization import kernels
from ascent.quantization.base import QuantSpec
from ascent.quantization.dense_weights import DenseWeightCache
from tests.unit.quant.scheme_utils import (
    SpecConfig,
    finish,
    gaussian,
    load,
    np_per_token_int8,
    np_static_int8,
    quant_asym,
    quant_sym,
    rel,
    t,
)


@pytest.mark.parametrize("m", [0, 1, 7, 33])
def test_int8_mm_exact(m):
    rng = np.random.default_rng(m)
    a = rng.integers(-128, 128, (m, 96), dtype=np.int8)
    b = rng.integers(-128, 128, (40, 96), dtype=np.int8)
    got = kernels.int8_mm(t(a), t(b).t())
    assert got.dtype == torch.int32
    assert np.array_equal(got.numpy(), a.astype(np.int64) @ b.astype(np.int64).T)


def test_int_mm_shape_rules():
    assert kernels.int_mm_supported(1, 3, 5, torch.device("cpu"))
    cuda = torch.device("cuda")
    assert kernels.int_mm_supported(17, 64, 64, cuda)
    assert not kernels.int_mm_supported(16, 64, 64, cuda)
    assert not kernels.int_mm_supported(32, 60, 64, cuda)
    assert not kernels.int_mm_supported(32, 64, 36, cuda)


def test_int8_linear_static_and_dynamic():
    x, w = gaussian((9, 64), 0), gaussian((24, 64), 1, 0.05)
    q, s_w = quant_sym(w, 8)
    beta = np.arange(24, dtype=np.int32) - 12
    d = (np.float32(0.02) * s_w[:, 0]).astype(np.float32)
    y = kernels.int8_linear_static(t(x), t(q).t(), 0.02, 3.0, t(d), t(beta))
    acc = np_static_int8(x, 0.02, 3.0) @ q.astype(np.int64).T + beta
    assert rel(y.numpy(), acc * d.astype(np.float64)) < 1e-6
    b = gaussian((24,), 2)
    y = kernels.int8_linear_dynamic(t(x).reshape(3, 3, 64), t(q).t(), t(s_w[:, 0]), t(b))
    xq, s_x = np_per_token_int8(x)
    expected = (xq @ q.astype(np.int64).T) * s_x.astype(np.float64)[:, None] * s_w.astype(np.float64).T + b
    assert y.shape == (3, 3, 24)
    assert rel(y.reshape(9, 24).numpy(), expected) < 1e-6


def test_int8_grouped_weight_scales():
    x, w = gaussian((5, 128), 3), gaussian((16, 128), 4, 0.05)
    q, s = quant_sym(w, 4, 32)
    y = kernels.int8_linear_grouped_weight(t(x), t(q), t(s), 32)
    xq, s_x = np_per_token_int8(x)
    expected = sum((xq[:, g * 32:(g + 1) * 32] @ q[:, g * 32:(g + 1) * 32].astype(np.int64).T) * s[:, g].astype(
        np.float64) for g in range(4)) * s_x.astype(np.float64)[:, None]
    assert rel(y.numpy(), expected) < 1e-6


def test_int4pack_conversion_asymmetric():
    w, x = gaussian((32, 256), 5, 0.05), gaussian((3, 256), 6)
    q, s, zp = quant_asym(w, 4, 64)
    group = kernels.int4pack_group_size(32, 256, 64)
    packed, scale_zeros = kernels.prepare_int4pack(t(q), t(s), t(zp).float(), group)
    y = kernels.weight_int4_linear(t(x), packed, group, scale_zeros)
    w_deq = (q.astype(np.float64) - np.repeat(zp, 64, 1)) * np.repeat(s, 64, 1)
    assert rel(y.numpy(), x.astype(np.float64) @ w_deq.T) < 1e-5


def test_int4pack_group_rules_and_path_switch():
    assert kernels.int4pack_group_size(64, 576, 576) == 64  # channel scales split into supported groups
    assert kernels.int4pack_group_size(64, 512, 128) == 128
    assert kernels.int4pack_group_size(36, 512, 128) is None  # N % 16
    assert kernels.int4pack_group_size(64, 512, 16) is None
    limit = kernels.WEIGHT_ONLY_PACKED_MAX_M
    assert kernels.weight_only_path(1) == "packed" and kernels.weight_only_path(limit) == "packed"
    assert kernels.weight_only_path(limit + 1) == "dense"


def test_dense_cache_builds_each_layout_once_and_follows_the_unquantized_choice():
    w, x, bias = gaussian((48, 64), 7), gaussian((4, 64), 8), gaussian((48,), 11)
    calls = []

    def build() -> torch.Tensor:
        calls.append(1)
        return t(w)

    cache = DenseWeightCache(build)
    xb, wb, bb = t(x).bfloat16(), t(w).bfloat16(), t(bias).bfloat16()
    for _ in range(2):
        y = cache.linear(xb, t(bias))
    assert len(calls) == 1
    expected = F.linear(xb, wb, bb).float().numpy()
    assert rel(y.float().numpy(), expected) < 1e-2
    ops = small_m_kernel(wb)
    plain = ops is not None and amx_ops() is None  # rows the unquantized linear gives its small-M kernel
    if plain:
        assert torch.equal(y, ops.linear_small_m(xb, wb, bb))
    # above the small-M range: the GEMM layout, built once more where the plain copy served the small calls
    big = t(gaussian((small_m_max(torch.bfloat16) + 1, 64), 9)).bfloat16()
    for _ in range(2):
        y_big = cache.linear(big)
    assert len(calls) == (2 if plain else 1)
    assert rel(y_big.float().numpy(), F.linear(big, wb).float().numpy()) < 1e-2
    assert rel(cache.linear(t(x)).numpy(), x.astype(np.float64) @ w.T.astype(np.float64)) < 1e-6
    assert len(calls) == (3 if plain else 2)
    cache.clear()
    cache.linear(xb)
    assert len(calls) == (4 if plain else 3)


def test_reference_env_switch(monkeypatch):
    q, s = quant_sym(gaussian((32, 64), 9, 0.05), 8)
    layer = ReplicatedLinear(64, 32, bias=False, params_dtype=torch.float32,
                             quant_config=SpecConfig(QuantSpec("W8A16")))
    load(layer, {"weight": t(q), "weight_scale": t(s), "weight_offset": torch.zeros(32, 1)})
    finish(layer)
    # above the integer kernels' ranges (small-M and AMX-INT8, whose exact sums match the reference): the dense path
    x = t(gaussian((kernels.W8A16_AMX_MAX_M + 1, 64), 10)).bfloat16()
    reference = layer.quant_method.apply_reference(layer, x)
    assert not torch.equal(layer(x), reference)  # the dense bf16 path rounds the dequantized weight first
    monkeypatch.setenv(kernels.REFERENCE_ENV, "1")
    assert torch.equal(layer(x), reference)
