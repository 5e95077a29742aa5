"""AMX-INT8 quantized linears (``ascent/layers/cpu_kernels/quant_amx_int8.h``): W8A8 dynamic / static bit-identical
to the VNNI kernels and to the torch reference paths, W8A16 per channel (16-bit x as fixed point) within one
rounding of the reference, the packed layout, the decode-stack calls and the dual-layout budget; the W8A8 schemes'
kernel choice (AMX-INT8 at every row count where the CPU has it, bit-identical to the torch paths either way).
Machines without AMX-INT8 run W8A8 / W8A16 on the VNNI kernels (``test_quant_gemv_kernels.py``) and skip the rest."""

from __future__ import annotations

import pytest
import torch

from ascent.layers.cpu_kernels import quant_ops
from ascent.quantization import kernels
from ascent.quantization.base import QuantSpec
from tests.unit.test_quant_gemv_kernels import (  # noqa: F401  (ops is a fixture)
    DTYPES, K_IN, N_OUT, assert_close, build, gen, operands, ops, ref_weight_only, run_stack_spec, static_w8a8_layer,
)

needs_amx_int8 = pytest.mark.skipif(not (quant_ops() and quant_ops().amx_int8_available()),
                                    reason="the CPU has no AMX-INT8 (the VNNI kernel serves W8A8 then)")


@needs_amx_int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (17, 576, 960), (33, 1536, 48), (48, 576, 96), (49, 128, 48),
                                   (64, 192, 80), (100, 128, 32)])
def test_w8a8_amx_kernel_bit_identical(ops, dtype, m, k, n):
    g = gen(m * 7 + k + n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0] = 0.0  # an all-zero row: s_x = 0
    bias = torch.randn(n, generator=g).to(dtype)
    packed = ops.w8a8_amx_pack(w)
    for b in (None, bias):
        y = ops.w8a8_dynamic_linear_amx(x, packed, scale, b)
        assert torch.equal(y, kernels.int8_linear_dynamic(x, w.t(), scale, b))
        assert torch.equal(y, ops.w8a8_dynamic_linear(x, w, w.sum(1, dtype=torch.int32), scale, b))


@needs_amx_int8
@pytest.mark.parametrize("k,n", [(64, 16), (576, 144), (1536, 368), (576, 3200)])
def test_w8a8_amx_one_row_streams_bit_identical(ops, k, n):
    """One row of x takes VNNI dot products on the tiles' layout, its column blocks read as four side-by-side streams
    per thread plus the blocks left over: every block's int32 sum is exact (x taken as x + 128 and 128 * sum(w) taken
    back), so dynamic and static outputs equal the torch references bit for bit, at 1, 2 and 3 threads, with
    weights at -128 / 127 and activations quantized to both ends (static: -128 through its offset)."""
    g = gen(k * 3 + n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w[0, :] = -128
    w[-1, :] = 127
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    x[0, :3] = torch.tensor([8.0, -8.0, 0.0])
    deq = torch.rand(n, generator=g) * 0.01 + 1e-4
    qb = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = ops.w8a8_amx_pack(w)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            y = ops.w8a8_dynamic_linear_amx(x, packed, scale, bias)
            assert torch.equal(y, kernels.int8_linear_dynamic(x, w.t(), scale, bias))
            y = ops.w8a8_static_linear_amx(x, packed, 0.02, 20.0, deq, qb, bias)  # x = -8 -> -400 + 20: -128
            assert torch.equal(y, kernels.int8_linear_static(x, w.t(), 0.02, 20.0, deq, qb, bias))
    finally:
        torch.set_num_threads(threads)


@needs_amx_int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (20, 576, 96), (40, 576, 96), (64, 128, 48), (70, 128, 48)])
def test_w8a8_static_amx_kernel_bit_identical(ops, dtype, m, k, n):
    g = gen(m + k + n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    deq = torch.rand(n, generator=g) * 0.01 + 1e-4
    qb = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32)
    bias = torch.randn(n, generator=g).to(dtype)
    packed = ops.w8a8_amx_pack(w)
    for q, b in ((None, None), (qb, None), (qb, bias)):
        y = ops.w8a8_static_linear_amx(x, packed, 0.021, 3.0, deq, q, b)
        assert torch.equal(y, kernels.int8_linear_static(x, w.t(), 0.021, 3.0, deq, q, b))
        assert torch.equal(y, ops.w8a8_static_linear(x, w, w.sum(1, dtype=torch.int32), 0.021, 3.0, deq, q, b))


@needs_amx_int8
def test_w8a8_amx_pack_layout_and_shape_checks(ops):
    w = torch.randint(-128, 128, (32, 128), generator=gen(2), dtype=torch.int8)
    packed = ops.w8a8_amx_pack(w)
    assert packed.shape == (2, 2, 16, 64)
    for nb, kb, r, c, t in ((0, 0, 0, 0, 0), (1, 1, 15, 15, 3), (1, 0, 3, 7, 2), (0, 1, 9, 12, 1)):
        assert packed[nb, kb, r, 4 * c + t] == w[16 * nb + c, 64 * kb + 4 * r + t]
    with pytest.raises(RuntimeError, match="N % 16"):
        ops.w8a8_amx_pack(w[:24])
    with pytest.raises(RuntimeError, match="K % 64"):
        ops.w8a8_amx_pack(w[:, :96].contiguous())
    with pytest.raises(RuntimeError, match="w8a8_amx_pack"):
        ops.w8a8_dynamic_linear_amx(torch.randn(2, 128), w, torch.ones(32), None)


@needs_amx_int8
def test_w8a8_amx_copy_counts_in_the_dual_layout_budget(ops):
    """The AMX-INT8 tiles are a second copy of the weight: over the budget they are released and the layer falls
    back to the VNNI kernel with the same outputs."""
    from torch import nn

    from ascent.layers.cpu_packing import limit_dual_layouts

    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=gen(4), dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=gen(5)) * 0.01}
    layer = build(QuantSpec("W8A8_DYNAMIC"), ck, bias=True)
    model = nn.Sequential(layer)
    x = torch.randn(8, K_IN, generator=gen(6)).bfloat16()
    before = layer(x)
    assert limit_dual_layouts(model, budget_bytes=N_OUT * K_IN) == N_OUT * K_IN
    assert layer.w8a8_amx is not None
    assert limit_dual_layouts(model, budget_bytes=N_OUT * K_IN - 1) == 0
    assert layer.w8a8_amx is None
    assert torch.equal(layer(x), before)


@needs_amx_int8
@pytest.mark.parametrize("modelslim", [True, False])
def test_decode_stack_call_w8a8_static(ops, modelslim):
    """Static W8A8 joins the decode stack through the AMX-INT8 kernel with the module path's values."""
    layer = static_w8a8_layer(modelslim, 12)
    call = layer.quant_method.scheme.decode_stack_call(layer)
    assert call[0] == kernels.STACK_KIND_W8A8_STATIC_AMX
    x = torch.randn(3, K_IN, generator=gen(13)).bfloat16()
    assert torch.equal(run_stack_spec(ops, call, x), layer(x))


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (5, 576, 96), (17, 1536, 48), (24, 576, 96), (32, 256, 64),
                                   (40, 128, 80)])
def test_w8a16_amx_kernel(ops, dtype, m, k, n):
    """W8A16 on AMX-INT8 tiles (x as 16-bit fixed point, exact integer sums): within one rounding of the output;
    a row's result does not depend on the batch; x with a NaN gives None (the caller falls back)."""
    x, q, scale, _, bias = operands(m, k, n, 1, 8, m + k + n, dtype)
    x[0, 3] = 200.0  # an outlier sets the row's step
    packed = ops.w8a8_amx_pack(q)
    for b in (None, bias):
        y = ops.w8a16_linear_amx(x, packed, scale.view(-1), b)
        assert_close(y, ref_weight_only(x, q, scale, None, b))
        row = ops.w8a16_linear_amx(x[m - 1 :], packed, scale.view(-1), b)
        assert torch.equal(row, y[m - 1 :])
    x[m - 1, 0] = float("nan")
    assert ops.w8a16_linear_amx(x, packed, scale.view(-1), None) is None


@needs_amx_int8
def test_w8a16_scheme_takes_amx_above_the_small_m_range(ops):
    """Per-channel W8A16 without zero points: the small-M kernel up to its limit, the AMX kernel above, the dense
    path past W8A16_AMX_MAX_M; all within one rounding of the reference."""
    g = gen(21)
    q = torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8)
    ck = {"weight": q, "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01,
          "weight_offset": torch.zeros(N_OUT, 1)}
    layer = build(QuantSpec("W8A16"), ck, bias=True, params_dtype=torch.bfloat16)
    assert layer.wo_amx is not None
    assert build(QuantSpec("W8A16"), ck).wo_amx is None  # an fp32 model: no AMX copy (it takes 16-bit x only)
    for m in (1, kernels.WEIGHT_ONLY_GEMV_MAX_M[8] + 1, 40, kernels.W8A16_AMX_MAX_M + 1):
        x = torch.randn(m, K_IN, generator=gen(m)).bfloat16()
        y = layer(x)
        assert_close(y, layer.quant_method.apply_reference(layer, x, layer.bias))
        if 4 < m <= kernels.W8A16_AMX_MAX_M:
            assert torch.equal(y, ops.w8a16_linear_amx(x, layer.wo_amx.packed, layer.wo_scale_vec, layer.bias))


@needs_amx_int8
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float32])
def test_decode_stack_call_w8a16_amx(ops, params_dtype):
    """A 16-bit model's per-channel W8A16 joins the stack with the AMX kernel above the small-M range (the module
    path's choice); an fp32 model has no AMX copy and keeps the plain W8A16 call (AMX takes 16-bit x only)."""
    g = gen(31)
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01, "weight_offset": torch.zeros(N_OUT, 1)}
    layer = build(QuantSpec("W8A16"), ck, bias=True, params_dtype=params_dtype)
    call = layer.quant_method.scheme.decode_stack_call(layer)
    if params_dtype is torch.float32:
        assert call[0] == kernels.STACK_KIND_W8A16
        return
    assert call[0] == kernels.STACK_KIND_W8A16_AMX
    for m in (2, 8, 40):
        x = torch.randn(m, K_IN, generator=gen(m)).bfloat16()
        assert torch.equal(run_stack_spec(ops, call, x), layer(x))


# A prefill-sized row count (past the small-M kernels' ranges).
PREFILL_M = 600


class CountingAmx:
    """A layer's ``kernels.Int8Amx`` that records the row count of every W8A8 call it serves."""

    def __init__(self, amx: kernels.Int8Amx) -> None:
        self.amx, self.rows = amx, []

    @classmethod
    def around(cls, amx: kernels.Int8Amx | None) -> CountingAmx | None:
        return None if amx is None else cls(amx)

    def linear(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.amx.linear(x, *args)

    def linear_static(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.amx.linear_static(x, *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_dynamic_scheme_kernel_path(ops, dtype):
    g = gen(6)
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01}
    layer = build(QuantSpec("W8A8_DYNAMIC"), ck, bias=True)
    assert layer.w8a8_gemv is not None
    assert (layer.w8a8_amx is not None) == ops.amx_int8_available()
    amx = layer.w8a8_amx = CountingAmx.around(layer.w8a8_amx)
    sizes = (1, 3, kernels.INT8_GEMV_MAX_M, 40, PREFILL_M)
    for m in sizes:
        x = torch.randn(m, K_IN, generator=gen(m)).to(dtype)
        fast = kernels.int8_linear_dynamic(x, layer.w8a8_w_t, layer.w8a8_ws, layer.bias)
        assert torch.equal(layer(x), fast)
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    if amx is not None:  # AMX-INT8 takes every size, prefill-sized ones too
        assert sorted(set(amx.rows)) == sorted(sizes)


@pytest.mark.parametrize("modelslim", [True, False])
def test_w8a8_static_scheme_kernel_path(ops, modelslim):
    layer = static_w8a8_layer(modelslim, 7)
    assert layer.w8a8_gemv is not None
    assert (layer.w8a8_amx is not None) == ops.amx_int8_available()
    amx = layer.w8a8_amx = CountingAmx.around(layer.w8a8_amx)
    sizes = (1, 5, 40, PREFILL_M)
    for m in sizes:
        x = torch.randn(m, K_IN, generator=gen(m)).bfloat16()
        fast = kernels.int8_linear_static(x, layer.w8a8_w_t, layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq,
                                          layer.w8a8_beta, None if modelslim else layer.bias)
        assert torch.equal(layer(x), fast)
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    if amx is not None:
        assert sorted(set(amx.rows)) == sorted(sizes)
