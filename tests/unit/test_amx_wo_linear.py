"""Weight-only int4 / int8 linears on AMX-BF16 tiles (``cpu_kernels/amx_wo_linear.h``, ``quantization/wo_amx.py``).

The kernel dequantizes each integer tile to the dense bf16 weight ``bf16((q - zero) * scale)`` and multiplies it as
``amx_linear`` multiplies a bf16 weight, so its output must equal ``amx_linear`` on that dense weight bit for bit
(the dense weight built here with torch, from the format's formula), and the W4A16 / W8A16 layers' outputs must
match their reference path (dequantize -> matmul) for every M the tiles take.
"""

from __future__ import annotations

import pytest
import torch

from ascent.layers.linear import ReplicatedLinear
from ascent.quantization import kernels
from ascent.quantization.base import QuantSpec
from ascent.quantization.wo_amx import WO_AMX_MAX_M, WO_AMX_MIN_M, prepare_wo_amx
from tests.unit.quant.scheme_utils import SpecConfig, finish, load
from tests.unit.test_cpu_amx import amx, pytestmark  # noqa: F401 (the AMX module fixture; skip without AMX-BF16)
from tests.unit.test_quant_gemv_kernels import assert_close
from tests.unit.test_quant_wo_nv_kernel import K_IN, N_OUT, w4a16_layer


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int_operands(n: int, k: int, groups: int, zero_points: bool, seed: int, bits: int = 4):
    g = gen(seed)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=g) * 0.02 / (1 << (bits - 4)) + 1e-4
    zero = None
    if zero_points:  # int8 zero points need not be integers (their subtraction rounds as the reference's does)
        zero = torch.randint(-4, 5, (n, groups), generator=g).float()
        zero = zero if bits == 4 else zero + torch.rand(n, groups, generator=g)
    return q, scale, zero


def pack(amx, bits: int, q, scale, zero):
    return (amx.amx_w4_pack if bits == 4 else amx.amx_w8_pack)(q, scale, zero)


def dense_bf16(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``W = (q - zero) * scale`` per group in fp32, rounded to bf16 (the dequantize-once weight)."""
    size = q.shape[1] // scale.shape[1]
    w = q.float()
    if zero is not None:
        w = w - zero.repeat_interleave(size, dim=1)
    return (w * scale.repeat_interleave(size, dim=1)).to(torch.bfloat16)


def test_pack_layout(amx):
    q, scale, zero = int_operands(32, 128, 2, True, seed=1)
    nib, coef = amx.amx_w4_pack(q, scale, zero)
    assert nib.shape == (2, 4, 16, 16) and nib.dtype == torch.uint8
    assert coef.shape == (2, 2, 2, 16) and coef.dtype == torch.float32
    for nb, kb, r, j in [(0, 0, 0, 0), (1, 3, 15, 15), (0, 2, 7, 9), (1, 1, 4, 3)]:
        for half, p in ((0, j), (1, 16 + j)):  # position p = 2 c + t <-> W[16 nb + c][32 kb + 2 r + t]
            c, t = p // 2, p % 2
            u = (int(nib[nb, kb, r, j]) >> (4 * half)) & 15
            assert u == int(q[16 * nb + c, 32 * kb + 2 * r + t]) + 8
    assert torch.equal(coef[1, 0, 0], scale[16:32, 0]) and torch.equal(coef[0, 1, 1], 8 + zero[0:16, 1])
    q8, scale8, zero8 = int_operands(32, 128, 2, True, seed=1, bits=8)
    tiles, coef8 = amx.amx_w8_pack(q8, scale8, zero8)
    assert tiles.shape == (2, 4, 16, 32) and tiles.dtype == torch.int8
    for nb, kb, r, p in [(0, 0, 0, 0), (1, 3, 15, 31), (0, 2, 7, 9), (1, 1, 4, 18)]:
        assert tiles[nb, kb, r, p] == q8[16 * nb + p // 2, 32 * kb + 2 * r + p % 2]
    assert torch.equal(coef8[0, 1, 0], scale8[0:16, 1]) and torch.equal(coef8[1, 0, 1], zero8[16:32, 0])


@pytest.mark.parametrize("n,k,groups,zero_points", [(16, 32, 1, False), (48, 128, 2, True), (96, 576, 9, False),
                                                    (64, 1536, 24, True), (32, 256, 1, True)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 48, 49, 64, 70])
@pytest.mark.parametrize("bits", [4, 8])
def test_equals_amx_linear_on_the_dense_weight(amx, bits, m, n, k, groups, zero_points):
    q, scale, zero = int_operands(n, k, groups, zero_points, seed=m * 100 + n + k, bits=bits)
    tiles, coef = pack(amx, bits, q, scale, zero)
    wp = amx.amx_pack(dense_bf16(q, scale, zero))
    x = torch.randn(m, k, generator=gen(m)).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen(n)).to(torch.bfloat16)
    assert torch.equal(amx.amx_wo_linear(x, tiles, coef, None), amx.amx_linear(x, wp, None))
    assert torch.equal(amx.amx_wo_linear(x, tiles, coef, bias), amx.amx_linear(x, wp, bias))
    x3 = x.view(1, m, k)  # leading dims are kept
    assert amx.amx_wo_linear(x3, tiles, coef, bias).shape == (1, m, n)


def test_pack_rejects_what_the_layout_cannot_hold(amx):
    q, scale, _ = int_operands(32, 128, 2, False, seed=2)
    with pytest.raises(RuntimeError, match="N % 16"):
        amx.amx_w4_pack(q[:24], scale[:24], None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        amx.amx_w4_pack(q[:, :96], scale[:, :2], None)  # groups of 48 columns
    with pytest.raises(RuntimeError, match=r"\[-8, 7\]"):
        amx.amx_w4_pack(q * 2, scale, None)
    with pytest.raises(RuntimeError, match="integers"):
        amx.amx_w4_pack(q, scale, torch.full_like(scale, 0.5))
    with pytest.raises(RuntimeError, match="N % 16"):
        amx.amx_w8_pack(q[:24], scale[:24], None)
    nib, coef = amx.amx_w4_pack(q, scale, None)
    with pytest.raises(RuntimeError, match="K = 128"):
        amx.amx_wo_linear(torch.randn(4, 64).to(torch.bfloat16), nib, coef, None)
    with pytest.raises(RuntimeError, match="bf16"):
        amx.amx_wo_linear(torch.randn(4, 128), nib, coef, None)
    with pytest.raises(RuntimeError, match="amx_w4_pack or amx_w8_pack"):
        amx.amx_wo_linear(torch.randn(4, 128).to(torch.bfloat16), nib.view(torch.int8), coef, None)


def test_prepare_declines_what_the_kernel_does_not_take():
    q, scale, zero = int_operands(32, 128, 2, True, seed=3)
    assert prepare_wo_amx(q, 4, scale, zero, torch.bfloat16) is not None
    assert prepare_wo_amx(q, 4, scale, zero, torch.float16) is None  # AMX-BF16 multiplies bf16 only
    assert prepare_wo_amx(q, 4, scale, zero + 0.25, torch.bfloat16) is None  # non-integer int4 zero points
    assert prepare_wo_amx(q, 8, scale, zero + 0.25, torch.bfloat16) is not None  # fine for int8
    assert prepare_wo_amx(q[:, :96], 4, scale[:, :2], None, torch.bfloat16) is None  # 48-column groups
    with pytest.raises(ValueError, match="bits=2"):
        prepare_wo_amx(q, 2, scale, zero, torch.bfloat16)


def test_prepare_honours_the_amx_switch(monkeypatch):
    q, scale, _ = int_operands(32, 128, 1, False, seed=4)
    monkeypatch.setenv("ASCENT_CPU_AMX", "0")
    assert prepare_wo_amx(q, 4, scale, None, torch.bfloat16) is None


@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_layer_runs_mid_sized_m_on_the_tiles(symmetric, monkeypatch):
    layer = w4a16_layer(torch.bfloat16, symmetric)
    assert layer.wo_amx_bf16 is not None
    calls = []
    original = type(layer.wo_amx_bf16).linear
    monkeypatch.setattr(type(layer.wo_amx_bf16), "linear", lambda self, x, b: calls.append(x.shape[0]) or original(
        self, x, b))
    for m in [1, WO_AMX_MIN_M, WO_AMX_MIN_M + 1, 32, 100, WO_AMX_MAX_M, WO_AMX_MAX_M + 1]:
        x = torch.randn(m, K_IN, generator=gen(m)).to(torch.bfloat16)
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    assert calls == [WO_AMX_MIN_M + 1, 32, 100, WO_AMX_MAX_M]


def test_fp16_w4a16_layer_keeps_no_tiles():
    assert w4a16_layer(torch.float16).wo_amx_bf16 is None


def test_tiles_count_as_a_dual_layout():
    from ascent.layers.cpu_packing import limit_dual_layouts

    model = torch.nn.Sequential(w4a16_layer(torch.bfloat16))
    layer = model[0]
    assert limit_dual_layouts(model, budget_bytes=1 << 40) >= layer.wo_amx_bf16.nbytes
    assert limit_dual_layouts(model, budget_bytes=0) == 0 and layer.wo_amx_bf16 is None
    x = torch.randn(32, K_IN, generator=gen(5)).to(torch.bfloat16)
    assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))


def test_decode_stack_call_wraps_the_small_m_kernel():
    layer = w4a16_layer(torch.bfloat16, symmetric=False)
    kind, tensors, ints = layer.quant_method.scheme.decode_stack_call(layer)
    inner = layer.wo_gemv.stack_spec(layer.bias)
    if layer.wo_gemv.max_m < WO_AMX_MIN_M:  # no row-interleaved layout: the tiles stay out of the stack
        assert (kind, ints) == (inner[0], inner[2])
        return
    assert kind == kernels.STACK_KIND_WO_AMX and ints == [WO_AMX_MIN_M, inner[0], *inner[2]]
    assert tensors[0] is layer.wo_amx_bf16.tiles and tensors[1] is layer.wo_amx_bf16.coef and tensors[2] is layer.bias
    assert len(tensors) == 3 + len(inner[1])


def w8a16_layer(per_channel: bool) -> torch.nn.Module:
    """ModelSlim W8A16: per channel without offsets (the AMX-INT8 kernel's), or groups of 64 with offsets."""
    g = gen(21)
    groups = 1 if per_channel else K_IN // 64
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, groups, generator=g) * 0.001}
    if per_channel:
        spec = QuantSpec("W8A16")
    else:
        spec = QuantSpec("W8A16", weight_strategy="group", group_size=64)
        ck["weight_offset"] = torch.randint(-3, 4, (N_OUT, groups), generator=g).float()
    layer = ReplicatedLinear(K_IN, N_OUT, bias=True, params_dtype=torch.bfloat16, quant_config=SpecConfig(spec))
    load(layer, ck)
    layer.bias.data.copy_(torch.randn(N_OUT, generator=gen(22)))
    return finish(layer)


def test_grouped_w8a16_layer_runs_mid_sized_m_on_the_tiles():
    layer = w8a16_layer(per_channel=False)
    assert layer.wo_amx is None and layer.wo_amx_bf16 is not None
    assert layer.wo_amx_bf16.tiles.dtype == torch.int8
    for m in [1, WO_AMX_MIN_M + 1, 32, 64, WO_AMX_MAX_M, WO_AMX_MAX_M + 1]:
        x = torch.randn(m, K_IN, generator=gen(m)).to(torch.bfloat16)
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    x = torch.randn(40, K_IN, generator=gen(40)).to(torch.bfloat16)
    tiles = layer.wo_amx_bf16
    assert torch.equal(layer(x), tiles.ops.amx_linear(x, tiles.ops.amx_pack(
        layer.quant_method.scheme.dequantized_weight(layer).to(torch.bfloat16)), layer.bias))


def test_per_channel_w8a16_keeps_its_amx_int8_kernel():
    from ascent.layers.cpu_kernels import quant_ops

    layer = w8a16_layer(per_channel=True)
    if quant_ops().amx_int8_available():
        assert layer.wo_amx is not None and layer.wo_amx_bf16 is None
    else:  # (no AMX-INT8 copy: the per-channel layer takes the AMX-BF16 tiles like a grouped one)
        assert layer.wo_amx is None and layer.wo_amx_bf16 is not None
