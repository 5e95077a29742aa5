"""The row-interleaved weight-only kernels (``cpu_kernels/quant_wo_nv.h``, ``quantization/wo_nv.py``) against the
dequantize -> matmul reference, and W4A16's use of them.

Tolerances as ``test_quant_gemv_kernels.py``: 16-bit outputs within 2 ulp of the output's max (x in 16-bit fixed
point, integer dot products, fp32 scaling, one output rounding), fp32 x (the exact scalar rows) within 2e-5.
"""

from __future__ import annotations

import pytest
import torch

from ascent.layers.cpu_kernels import quant_ops
from ascent.layers.linear import ReplicatedLinear
from ascent.quantization import kernels
from ascent.quantization.base import QuantSpec
from ascent.quantization.packing import pack_to_int32
from ascent.quantization.wo_nv import NV_ENV, nv_rows
from ascent.quantization.wo_amx import WO_AMX_MIN_M
from tests.unit.quant.scheme_utils import SpecConfig, finish, load
from tests.unit.test_quant_gemv_kernels import ULP, assert_close, gen, isa_ops, operands, ref_weight_only


@pytest.fixture(scope="module")
def ops():
    module = quant_ops()
    assert module is not None, "the CPU profile must build the quant kernels (a C++ compiler is a test requirement)"
    return module


def has_vnni(ops) -> bool:
    return "vnni" in ops.isa()


def nv_linear(ops, bits, x, q, scale, zero, bias):
    n, k = q.shape
    zs = None if zero is None else nv_rows(zero * scale, n)
    return ops.wo_nv_linear(x, ops.wo_nv_pack(q, bits), bits, n, k, scale, zero, nv_rows(scale, n), zs, bias)


def python_pack(q: torch.Tensor, bits: int, offset: int | None = None) -> torch.Tensor:
    """The layout as the header states it, element by element (an independent construction)."""
    n, k = q.shape
    step_cols = 8 if bits == 4 else 4
    offset = (8 if bits == 4 else 128) if offset is None else offset
    npad, steps = -(-n // 64) * 64, -(-k // step_cols)
    out = torch.zeros(npad // 64, steps, 4, 64, dtype=torch.int32)
    for r in range(n):
        for c in range(k):
            s, within = divmod(c, step_cols)
            lane = r % 64
            shift = 4 if bits == 4 and within >= 4 else 0
            out[r // 64, s, lane // 16, (lane % 16) * 4 + within % 4] += ((int(q[r, c]) + offset) & 255) << shift
    return out.to(torch.uint8)


@pytest.mark.parametrize("bits,n,k", [(4, 70, 24), (4, 64, 13), (8, 130, 10), (8, 5, 4)])
def test_pack_layout(ops, bits, n, k):
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (n, k), generator=gen(n + k), dtype=torch.int8)
    assert torch.equal(ops.wo_nv_pack(q, bits), python_pack(q, bits))


@pytest.mark.parametrize("k", [33, 64])
def test_packed_nibbles_give_the_layout_of_their_values(ops, k):
    """W4A16 kernel operands prepared from nibble bytes (``w4a16_pack``, compressed-tensors' bytes) or from int8
    values agree: the same row-interleaved layout."""
    if not has_vnni(ops):
        pytest.skip("no row-interleaved layout on this CPU")
    q = torch.randint(-8, 8, (9, k), generator=gen(2), dtype=torch.int8)
    scale = torch.rand(9, 1, generator=gen(3))
    from_bytes = kernels.prepare_wo_gemv(ops.w4a16_pack(q), 4, k, scale, None, torch.bfloat16).nv
    from_values = kernels.prepare_wo_gemv(q, 4, k, scale, None, torch.bfloat16).nv
    assert torch.equal(from_bytes.packed, from_values.packed) and torch.equal(from_bytes.packed, python_pack(q, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("bits,k,groups", [
    (4, 576, 9), (4, 576, 1), (4, 2304, 1), (4, 100, 1), (4, 1536, 24), (4, 256, 8),
    (8, 576, 1), (8, 600, 1), (8, 1000, 1), (8, 7, 1), (8, 200, 5), (8, 512, 16)])
def test_kernel_matches_reference(ops, dtype, m, bits, k, groups):
    """Per-group and per-channel scales (per-channel K above a flush span: int8 256, int4 2048 columns), K not a
    multiple of a step, N not a multiple of 64, zero points and bias."""
    x, q, scale, zero, bias = operands(m, k, 70, groups, bits, m * 100 + k + bits, dtype)
    for z, b in ((None, None), (zero, bias), (None, bias)):
        assert_close(nv_linear(ops, bits, x, q, scale, z, b), ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("bits,groups", [(4, 9), (4, 1), (8, 1), (8, 9)])
def test_bf16_scales_equal_fp32_scales(ops, bits, groups):
    """bf16-valued scales stored as bf16 (half the bytes) give bit-identical outputs to the same values in fp32."""
    x, q, scale, zero, bias = operands(3, 576, 70, groups, bits, 31 + bits + groups, torch.bfloat16)
    scale = scale.bfloat16().float()
    packed, snv = ops.wo_nv_pack(q, bits), nv_rows(scale, 70)
    for z in (None, zero):
        zs = None if z is None else nv_rows(z * scale, 70)
        fp32 = ops.wo_nv_linear(x, packed, bits, 70, 576, scale, z, snv, zs, bias)
        half = ops.wo_nv_linear(x, packed, bits, 70, 576, scale, z, snv.bfloat16(), zs, bias)
        assert torch.equal(fp32, half)
        assert_close(half, ref_weight_only(x, q, scale, z, bias))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outlier_activations(ops, bits, dtype):
    """A few activations 300x the rest set the fixed point's step: still within one rounding of the output."""
    x, q, scale, _, bias = operands(4, 576, 64, 9, bits, 77 + bits, dtype)
    x[:, 5] = 300.0
    x[1, 288] = -450.0
    assert_close(nv_linear(ops, bits, x, q, scale, None, bias), ref_weight_only(x, q, scale, None, bias))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [64, 200, 330, 576])
def test_rows_do_not_depend_on_how_threads_split_them(ops, bits, n):
    """Threads take contiguous runs of half super-blocks (32 rows), an odd count of super-blocks split in the middle
    (576 rows: 9), padding halves skipped (200 rows: the last super-block holds 8): every thread count gives the same
    bits, within the reference's tolerance."""
    x, q, scale, zero, bias = operands(3, 576, n, 9, bits, 5 + n, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            outs.append(nv_linear(ops, bits, x, q, scale, zero, bias))
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_close(outs[0], ref_weight_only(x, q, scale, zero, bias))


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_do_not_depend_on_the_batch(ops, bits):
    x, q, scale, zero, bias = operands(5, 576, 100, 9, bits, 3, torch.bfloat16)
    x[2] *= 1000.0
    batch = nv_linear(ops, bits, x, q, scale, zero, bias)
    for i in range(5):
        assert torch.equal(nv_linear(ops, bits, x[i : i + 1], q, scale, zero, bias), batch[i : i + 1])


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_and_non_finite_rows(ops, bits):
    """An all-zero row gives exactly the bias; NaN / inf rows take the exact scalar path (IEEE propagation, as the
    reference) and leave the other rows as they are."""
    x, q, scale, _, bias = operands(4, 256, 12, 4, bits, 9, torch.bfloat16)
    x[0] = 0.0
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    y = nv_linear(ops, bits, x, q, scale, None, bias)
    assert torch.equal(y[0], bias)
    assert torch.isnan(y[1]).all()
    ref = ref_weight_only(x, q, scale, None, bias)
    assert torch.equal(torch.isnan(y[2]), torch.isnan(ref[2])) and not torch.isfinite(y[2]).all()
    assert torch.equal(y[3:], nv_linear(ops, bits, x[3:], q, scale, None, bias))


@pytest.mark.parametrize("bits", [4, 8])
def test_portable_path(ops, bits):
    """Without AVX512-VNNI (forced) every row takes the exact scalar path: same results within the tolerance."""
    x, q, scale, zero, bias = operands(3, 200, 40, 5 if bits == 8 else 1, bits, 5, torch.bfloat16)
    old = ops.set_force_generic(1)
    try:
        y = nv_linear(ops, bits, x, q, scale, zero, bias)
    finally:
        ops.set_force_generic(old)
    assert_close(y, ref_weight_only(x, q, scale, zero, bias))


def test_bad_inputs(ops):
    x, q, scale, zero, _ = operands(1, 64, 8, 2, 8, 1, torch.bfloat16)
    packed = ops.wo_nv_pack(q, 8)
    snv = nv_rows(scale, 8)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        ops.wo_nv_pack(q, 3)
    with pytest.raises(RuntimeError, match="outside"):
        ops.wo_nv_pack(q * 0 + 9, 4)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.wo_nv_linear(x, packed, 4, 8, 64, scale, None, snv, None, None)
    with pytest.raises(RuntimeError, match="go together"):
        ops.wo_nv_linear(x, packed, 8, 8, 64, scale, zero, snv, None, None)
    with pytest.raises(RuntimeError, match="not a multiple"):
        s6 = torch.rand(8, 32)
        ops.wo_nv_linear(x, packed, 8, 8, 64, s6, None, nv_rows(s6, 8), None, None)
    with pytest.raises(RuntimeError, match="x must be"):
        ops.wo_nv_linear(x[:, :32], packed, 8, 8, 64, scale, None, snv, None, None)


# ---- W4A16 on the layout -----------------------------------------------------------------------------------------

N_OUT, K_IN = 96, 256


def w4a16_layer(params_dtype: torch.dtype, symmetric: bool = True) -> torch.nn.Module:
    g = gen(11)
    q4 = torch.randint(-8, 8, (N_OUT, K_IN), generator=g, dtype=torch.int8)
    ck = {"weight_packed": pack_to_int32(q4, 4, dim=1), "weight_scale": torch.rand(N_OUT, 4, generator=g) * 0.01,
          "weight_shape": torch.tensor([[N_OUT, K_IN]])}
    if not symmetric:
        ck["weight_zero_point"] = pack_to_int32(torch.randint(-8, 8, (N_OUT, 4), generator=g, dtype=torch.int8), 4,
                                                dim=0)
    spec = QuantSpec("W4A16", weight_bits=4, weight_strategy="group", group_size=64, weight_symmetric=symmetric,
                     source_format="compressed-tensors", extra={"format": "pack-quantized"})
    layer = ReplicatedLinear(K_IN, N_OUT, bias=True, params_dtype=params_dtype, quant_config=SpecConfig(spec))
    load(layer, ck)
    layer.bias.data.copy_(torch.randn(N_OUT, generator=gen(12)))
    return finish(layer)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_takes_the_layout(ops, monkeypatch, symmetric, dtype):
    layer = w4a16_layer(dtype, symmetric)
    nv = layer.wo_gemv.nv
    assert (nv is not None) == has_vnni(ops)
    if nv is not None:
        assert nv.scale.dtype == torch.float32  # the test's fp32 scales are no bf16 values: kept exact
        assert layer.wo_packed is None  # the int4pack copy is dropped: the kernels take its M range
        kind, tensors, ints = layer.quant_method.scheme.decode_stack_call(layer)
        if layer.wo_amx_bf16 is not None:  # bf16 on an AMX CPU: the tiles above WO_AMX_MIN_M rows, this layout below
            assert kind == kernels.STACK_KIND_WO_AMX and ints[:2] == [WO_AMX_MIN_M, kernels.STACK_KIND_WO_NV]
            kind, tensors, ints = ints[1], tensors[3:], ints[2:]
        assert kind == kernels.STACK_KIND_WO_NV and ints == [4, N_OUT, K_IN] and len(tensors) == 6
    for m in range(1, layer.wo_gemv.max_m + 1):
        x = torch.randn(m, K_IN, generator=gen(m)).to(dtype)
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    monkeypatch.setenv(NV_ENV, "0")
    row_layout = w4a16_layer(dtype, symmetric)
    assert row_layout.wo_gemv.nv is None and row_layout.wo_packed is not None
    x = torch.randn(2, K_IN, generator=gen(7)).to(dtype)
    assert (layer(x).float() - row_layout(x).float()).abs().max() <= 4 * ULP[dtype] * row_layout(x).float().abs().max()


def test_bf16_checkpoint_scales_stream_as_bf16(ops):
    from ascent.quantization.wo_nv import prepare_nv

    if not has_vnni(ops):
        pytest.skip("no row-interleaved layout on this CPU")
    q = torch.randint(-8, 8, (70, 128), generator=gen(1), dtype=torch.int8)
    scale = (torch.rand(70, 2, generator=gen(2)) * 0.01).bfloat16().float()
    assert prepare_nv(ops, q, 4, scale, None).scale.dtype == torch.bfloat16
    assert prepare_nv(ops, q, 4, scale + 1e-7, None).scale.dtype == torch.float32


def w8a16_layer(params_dtype: torch.dtype, grouped: bool) -> torch.nn.Module:
    q8 = torch.randint(-128, 128, (N_OUT, K_IN), generator=gen(3), dtype=torch.int8)
    groups = 4 if grouped else 1
    ck = {"weight": q8, "weight_scale": torch.rand(N_OUT, groups, generator=gen(4)) * 0.01}
    spec = QuantSpec("W8A16", weight_strategy="group", group_size=K_IN // groups) if grouped else QuantSpec("W8A16")
    if grouped:
        ck["weight_offset"] = torch.randint(-3, 4, (N_OUT, groups), generator=gen(5)).float()
    layer = ReplicatedLinear(K_IN, N_OUT, bias=True, params_dtype=params_dtype, quant_config=SpecConfig(spec))
    load(layer, ck)
    layer.bias.data.copy_(torch.randn(N_OUT, generator=gen(6)))
    return finish(layer)


def test_fp32_models_keep_the_row_layout(ops):
    assert w4a16_layer(torch.float32).wo_gemv.nv is None
    assert w8a16_layer(torch.float32, grouped=False).wo_gemv.nv is None


@pytest.mark.parametrize("grouped", [False, True])
def test_w8a16_adds_the_layout_as_a_second_copy(ops, grouped, monkeypatch):
    """W8A16 on a 16-bit model: a row-interleaved copy beside the checkpoint's rows serves M = 1..WO_NV_MAX_M (on
    VNNI CPUs without AMX tiles for the layer: ``ASCENT_CPU_AMX=0`` here), in the module path and the decode-stack
    call alike; the dual-layout budget releases the copy (the rows then serve up to their own limit)."""
    from ascent.layers.cpu_packing import limit_dual_layouts

    monkeypatch.setenv("ASCENT_CPU_AMX", "0")
    layer = w8a16_layer(torch.bfloat16, grouped)
    assert layer.wo_amx is None and layer.wo_amx_bf16 is None
    gemv = layer.wo_gemv
    assert (gemv.nv is not None) == (has_vnni(ops) and layer.wo_amx is None)
    if gemv.nv is None:
        pytest.skip("no row-interleaved copy on this CPU (no VNNI, or AMX-INT8 tiles serve the layer)")
    assert gemv.max_m == kernels.WO_NV_MAX_M
    kind, tensors, ints = layer.quant_method.scheme.decode_stack_call(layer)
    assert kind == kernels.STACK_KIND_WO_NV and ints == [8, N_OUT, K_IN] and tensors[0] is gemv.nv.packed
    for m in (1, 2, 7, kernels.WO_NV_MAX_M):
        x = torch.randn(m, K_IN, generator=gen(m)).bfloat16()
        nv = ops.wo_nv_linear(x, gemv.nv.packed, 8, N_OUT, K_IN, gemv.scale, gemv.zero, gemv.nv.scale,
                              gemv.nv.zero_scale, layer.bias)
        assert torch.equal(layer(x), nv), m
        assert_close(layer(x), layer.quant_method.apply_reference(layer, x, layer.bias))
    holder = torch.nn.Sequential(layer)
    assert limit_dual_layouts(holder, budget_bytes=gemv.nv.packed.numel()) == gemv.nv.packed.numel()
    assert limit_dual_layouts(holder, budget_bytes=gemv.nv.packed.numel() - 1) == 0
    assert layer.wo_gemv.nv is None and layer.wo_gemv.max_m == kernels.WEIGHT_ONLY_GEMV_MAX_M[8]
    assert layer.quant_method.scheme.decode_stack_call(layer)[0] == kernels.STACK_KIND_W8A16


# ---- W8A8 dynamic on the layout (signed weight bytes) --------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(70, 24), (5, 13)])
def test_signed_pack_layout(ops, n, k):
    """offset 0 (W8A8): each weight byte is q's two's complement; padding stays 0."""
    q = torch.randint(-128, 128, (n, k), generator=gen(n * k), dtype=torch.int8)
    assert torch.equal(ops.wo_nv_pack(q, 8, 0), python_pack(q, 8, offset=0))
    with pytest.raises(RuntimeError, match="offset"):
        ops.wo_nv_pack(q.clamp(-8, 7), 4, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 48])
@pytest.mark.parametrize("k", [576, 1000, 7])
def test_w8a8_nv_bit_identical(ops, dtype, m, k):
    """The same quantization and epilogue as the row kernels (themselves bit-identical to ``int8_linear_dynamic`` /
    ``int8_linear_static``)."""
    if not has_vnni(ops):
        pytest.skip("the W8A8 row-interleaved kernel needs AVX512-VNNI")
    g = gen(m * k)
    x = torch.randn(m, k, generator=g).to(dtype)
    q = torch.randint(-128, 128, (70, k), generator=g, dtype=torch.int8)
    row_sum, w_scale = q.sum(1, dtype=torch.int32), torch.rand(70, generator=g) * 0.01
    bias = torch.randn(70, generator=g).to(dtype)
    packed = ops.wo_nv_pack(q, 8, 0)
    deq, quant_bias = torch.rand(70, generator=g) * 1e-4, torch.randint(-5000, 5000, (70,), generator=g).int()
    for b in (None, bias):
        expected = kernels.int8_linear_dynamic(x, q.t(), w_scale, b)
        assert torch.equal(ops.w8a8_dynamic_linear_nv(x, packed, row_sum, w_scale, b), expected)
        for qb in (None, quant_bias):  # static: per-tensor scale and offset, int32 quant_bias, fp32 deq
            expected = kernels.int8_linear_static(x, q.t(), 0.02, 3.0, deq, qb, b)
            assert torch.equal(ops.w8a8_static_linear_nv(x, packed, row_sum, 0.02, 3.0, deq, qb, b), expected)


@pytest.mark.parametrize("n", [64, 200, 576])
def test_w8a8_nv_any_thread_split_is_bit_identical(ops, n):
    """Threads take runs of half super-blocks (an odd count of super-blocks split in the middle, padding halves
    skipped, a half's rows stored one by one): every thread count equals ``int8_linear_dynamic`` / ``_static``."""
    if not has_vnni(ops):
        pytest.skip("the W8A8 row-interleaved kernel needs AVX512-VNNI")
    g = gen(n)
    q = torch.randint(-128, 128, (n, 576), generator=g, dtype=torch.int8)
    row_sum, w_scale, bias = q.sum(1, dtype=torch.int32), torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
    deq, packed = torch.rand(n, generator=g) * 1e-4, ops.wo_nv_pack(q, 8, 0)
    threads = torch.get_num_threads()
    try:
        for m in (1, 5):
            x = torch.randn(m, 576, generator=g).bfloat16()
            dynamic = kernels.int8_linear_dynamic(x, q.t(), w_scale, bias.bfloat16())
            static = kernels.int8_linear_static(x, q.t(), 0.02, 3.0, deq, None, bias.bfloat16())
            for count in (1, 2, 3, 4):
                torch.set_num_threads(count)
                assert torch.equal(ops.w8a8_dynamic_linear_nv(x, packed, row_sum, w_scale, bias.bfloat16()), dynamic)
                assert torch.equal(ops.w8a8_static_linear_nv(x, packed, row_sum, 0.02, 3.0, deq, None,
                                                             bias.bfloat16()), static)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_dynamic_rows_with_nan_or_inf_give_nan_rows(isa_ops, dtype):
    """A NaN or inf in an activation row makes that row's outputs NaN in the row and row-interleaved kernels alike,
    as dequantize -> matmul does (its per-token scale is then NaN / inf); the other rows keep their exact values."""
    g = gen(31)
    x = torch.randn(4, 576, generator=g).to(dtype)
    x[1, 5], x[2, 7], x[3, 575] = float("nan"), float("inf"), float("-inf")
    q = torch.randint(-128, 128, (130, 576), generator=g, dtype=torch.int8)
    row_sum, w_scale = q.sum(1, dtype=torch.int32), torch.rand(130, generator=g) * 0.01
    expected = kernels.int8_linear_dynamic(x, q.t(), w_scale, None)
    assert torch.isnan(expected[1:]).all() and not torch.isnan(expected[0]).any()
    outputs = [isa_ops.w8a8_dynamic_linear(x, q, row_sum, w_scale, None)]
    if "vnni" in isa_ops.isa():  # the row-interleaved kernel needs AVX512-VNNI
        outputs.append(isa_ops.w8a8_dynamic_linear_nv(x, isa_ops.wo_nv_pack(q, 8, 0), row_sum, w_scale, None))
    for y in outputs:
        assert torch.isnan(y[1:]).all() and torch.equal(y[0], expected[0])


def w8a8_layer(params_dtype: torch.dtype) -> torch.nn.Module:
    g = gen(21)
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01}
    layer = ReplicatedLinear(K_IN, N_OUT, bias=True, params_dtype=params_dtype,
                             quant_config=SpecConfig(QuantSpec("W8A8_DYNAMIC")))
    load(layer, ck)
    layer.bias.data.copy_(torch.randn(N_OUT, generator=gen(22)))
    return finish(layer)


def test_w8a8_dynamic_takes_the_layout(ops, monkeypatch):
    layer = w8a8_layer(torch.bfloat16)
    gemv = layer.w8a8_gemv
    assert (gemv.nv is not None) == (has_vnni(ops) and layer.w8a8_amx is None)
    if gemv.nv is None:
        pytest.skip("no row-interleaved copy on this CPU")
    assert gemv.max_m == kernels.INT8_NV_MAX_M
    kind, tensors, _ = layer.quant_method.scheme.decode_stack_call(layer)
    assert kind == kernels.STACK_KIND_W8A8_DYNAMIC_NV and tensors[0] is gemv.nv
    for m in (1, 7, kernels.INT8_NV_MAX_M):
        x = torch.randn(m, K_IN, generator=gen(m)).bfloat16()
        assert torch.equal(layer(x), kernels.int8_linear_dynamic(x, layer.w8a8_w_t, layer.w8a8_ws, layer.bias))
    monkeypatch.setenv(NV_ENV, "0")
    assert w8a8_layer(torch.bfloat16).w8a8_gemv.nv is None


def test_dual_layout_budget_releases_the_w8a8_copy(ops):
    from ascent.layers.cpu_packing import limit_dual_layouts

    layer = w8a8_layer(torch.bfloat16)
    if layer.w8a8_gemv.nv is None:
        pytest.skip("no row-interleaved copy on this CPU")
    model = torch.nn.Sequential(layer)
    assert limit_dual_layouts(model, budget_bytes=1 << 30) >= layer.w8a8_gemv.nv.numel()
    x = torch.randn(3, K_IN, generator=gen(5)).bfloat16()
    before = layer(x)
    assert limit_dual_layouts(model, budget_bytes=0) == 0
    assert layer.w8a8_gemv.nv is None and layer.w8a8_gemv.max_m == kernels.INT8_GEMV_MAX_M
    assert torch.equal(layer(x), before)
