"""Small-M integer-weight CPU kernels (``ascent/layers/cpu_kernels/quant_gemv_cpu.cpp``) against the reference
dequantize -> matmul math, on both the wide-ISA (AVX512 / VNNI) and the portable path, and the schemes wired to them.

Tolerances: the weight-only kernels accumulate in fp32 in another order than the fp32 reference matmul, so fp32
outputs agree to ~1e-6 relative (asserted < 2e-5 of the output's max); bf16/fp16 outputs to one rounding of the
output dtype (asserted < 2 ulp of the output's max). The W8A8 kernels are exact in the integer product and use the
same epilogue operations as ``kernels.int8_linear_dynamic`` / ``int8_linear_static``: bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from ascent.layers.cpu_kernels import quant_ops
from ascent.layers.linear import ReplicatedLinear
from ascent.quantization import kernels
from ascent.quantization.base import QuantSpec
from ascent.quantization.packing import pack_to_int32
from tests.unit.quant.scheme_utils import SpecConfig, finish, load

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MS = (1, 2, 3, 5, 8, 17)
ULP = {torch.float32: 2e-5, torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11}


@pytest.fixture(scope="module")
def ops():
    module = quant_ops()
    assert module is not None, "the CPU profile must build the quant kernels (a C++ compiler is a test requirement)"
    return module


@pytest.fixture(params=["best", "avx2", "generic"])
def isa_ops(request, ops):
    """The module with the best ISA, capped at AVX2 (the weight-only AVX2 kernels), or the forced portable path."""
    capability = torch.backends.cpu.get_cpu_capability()
    if request.param == "avx2" and capability not in ("AVX2", "AVX512"):
        pytest.skip(f"CPU capability {capability} has no AVX2")
    old = ops.set_force_generic({"best": 0, "generic": 1, "avx2": 2}[request.param])
    if request.param == "best":
        assert ops.isa() != "generic" or not capability.startswith(("AVX512", "AVX2"))
    elif request.param == "avx2":
        assert ops.isa() == "avx2"
    yield ops
    ops.set_force_generic(old)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_weight_only(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ ((q - zero) * scale)^T + bias`` in fp32 (scale / zero [N, G]) -> x's dtype."""
    g = q.shape[1] // scale.shape[1]
    w = q.float()
    if zero is not None:
        w = w - zero.repeat_interleave(g, 1)
    w = w * scale.repeat_interleave(g, 1)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= ULP[y.dtype] * max(ref.float().abs().max().item(), 1e-6), err


def operands(m: int, k: int, n: int, groups: int, bits: int, seed: int, dtype: torch.dtype):
    g = gen(seed)
    lo = -(1 << (bits - 1))
    x = torch.randn(m, k, generator=g).to(dtype)
    q = torch.randint(lo, -lo, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zero = torch.randint(lo, -lo, (n, groups), generator=g).float()
    bias = torch.randn(n, generator=g).to(dtype)
    return x, q, scale, zero, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,groups", [(576, 1), (100, 1), (7, 1), (256, 2), (512, 16), (96, 3), (200, 5)])
def test_w8a16_kernel(isa_ops, dtype, m, k, groups):
    x, q, scale, zero, bias = operands(m, k, 37, groups, 8, m * 1000 + k, dtype)
    for z, b in ((None, None), (zero, bias), (None, bias)):
        assert_close(isa_ops.w8a16_linear(x, q, scale, z, b), ref_weight_only(x, q, scale, z, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,groups", [(576, 1), (40, 1), (7, 1), (256, 8), (512, 8), (384, 3), (1536, 12)])
def test_w4a16_kernel(isa_ops, dtype, m, k, groups):
    x, q, scale, zero, bias = operands(m, k, 37, groups, 4, m * 1000 + k, dtype)
    packed = isa_ops.w4a16_pack(q)
    for z, b in ((None, None), (zero, bias), (None, bias)):
        assert_close(isa_ops.w4a16_linear(x, packed, k, scale, z, b), ref_weight_only(x, q, scale, z, b))


def test_w4a16_pack_is_compressed_tensors_layout(ops):
    q = torch.randint(-8, 8, (24, 96), generator=gen(1), dtype=torch.int8)
    assert torch.equal(ops.w4a16_pack(q), pack_to_int32(q, 4, dim=1).view(torch.uint8))
    odd = torch.randint(-8, 8, (3, 5), generator=gen(2), dtype=torch.int8)
    assert ops.w4a16_pack(odd).shape == (3, 3)
    with pytest.raises(RuntimeError, match="outside"):
        ops.w4a16_pack(torch.full((2, 4), 9, dtype=torch.int8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", [576, 100, 64, 7, 1536])
def test_w8a8_dynamic_kernel_bit_identical(isa_ops, dtype, m, k):
    x, q, _, _, bias = operands(m, k, 37, 1, 8, m * 7 + k, dtype)
    x[0, :3] *= 40.0  # an outlier row
    if m > 2:
        x[2].zero_()  # all-zero row: s = 0
    w_scale = torch.rand(37, generator=gen(k)) * 0.01
    row_sum = q.sum(1, dtype=torch.int32)
    for b in (None, bias):
        y = isa_ops.w8a8_dynamic_linear(x, q, row_sum, w_scale, b)
        assert torch.equal(y, kernels.int8_linear_dynamic(x, q.t(), w_scale, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("k", [576, 100])
def test_w8a8_static_kernel_bit_identical(isa_ops, dtype, m, k):
    x, q, _, _, bias = operands(m, k, 40, 1, 8, m * 11 + k, dtype)
    deq = torch.rand(40, generator=gen(3)) * 1e-3
    quant_bias = torch.randint(-5000, 5000, (40,), generator=gen(4), dtype=torch.int32)
    row_sum = q.sum(1, dtype=torch.int32)
    for sx, zx, qb, b in ((0.0213, 3.0, quant_bias, None), (0.017, 0.0, None, bias)):
        y = isa_ops.w8a8_static_linear(x, q, row_sum, sx, zx, deq, qb, b)
        assert torch.equal(y, kernels.int8_linear_static(x, q.t(), sx, zx, deq, qb, b))


def test_kernels_reject_bad_inputs(ops):
    x = torch.randn(2, 64)
    q = torch.zeros(8, 64, dtype=torch.int8)
    scale, rs, ws = torch.ones(8, 1), torch.zeros(8, dtype=torch.int32), torch.ones(8)
    bad = [
        lambda: ops.w8a16_linear(torch.randn(2, 63), q, scale, None, None),          # K mismatch
        lambda: ops.w8a16_linear(x, q.float(), scale, None, None),                    # weight dtype
        lambda: ops.w8a16_linear(x, q, torch.ones(8, 3), None, None),                 # G does not divide K
        lambda: ops.w8a16_linear(x, q, torch.ones(7, 1), None, None),                 # scale rows
        lambda: ops.w8a16_linear(x, q, scale, torch.ones(8, 2), None),                # zero shape
        lambda: ops.w8a16_linear(x, q, scale, None, torch.ones(9)),                   # bias size
        lambda: ops.w8a16_linear(x.to(torch.float64), q, scale, None, None),          # x dtype
        lambda: ops.w8a16_linear(x[..., :32], q, scale, None, None),                  # K mismatch (view)
        lambda: ops.w4a16_linear(x, torch.zeros(8, 31, dtype=torch.uint8), 64, scale, None, None),
        lambda: ops.w4a16_linear(x, torch.zeros(8, 32, dtype=torch.uint8), 64, torch.ones(8, 4), None, None),
        lambda: ops.w8a8_dynamic_linear(x, q, rs[:7], ws, None),                      # row_sum size
        lambda: ops.w8a8_dynamic_linear(x, q, rs.long(), ws, None),                   # row_sum dtype
        lambda: ops.w8a8_dynamic_linear(x, q, rs, ws.double(), None),                 # scale dtype
        lambda: ops.w8a8_dynamic_linear(x, q[:, ::2], rs, ws, None),                  # non-contiguous weight
        lambda: ops.w8a8_static_linear(x, q, rs, 0.1, 0.0, ws, rs[:4], None),         # quant_bias size
        lambda: ops.set_force_generic(3),                                             # no such ISA cap
    ]
    for i, call in enumerate(bad):
        with pytest.raises(RuntimeError):
            call()
            pytest.fail(f"case {i} did not raise")


def test_empty_batch(ops):
    q = torch.zeros(8, 64, dtype=torch.int8)
    y = ops.w8a8_dynamic_linear(torch.randn(0, 64), q, torch.zeros(8, dtype=torch.int32), torch.ones(8), None)
    assert y.shape == (0, 8)


# ---- scheme level: the kernel path (small M) against the scheme's reference path --------------------------------

N_OUT, K_IN = 48, 256


def build(spec: QuantSpec, ck: dict[str, torch.Tensor], bias: bool = False,
          params_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    layer = ReplicatedLinear(K_IN, N_OUT, bias=bias, params_dtype=params_dtype, quant_config=SpecConfig(spec))
    load(layer, ck)
    if bias:
        layer.bias.data.copy_(torch.randn(N_OUT, generator=gen(9)))
    return finish(layer)


def weight_only_layers() -> list[tuple[str, QuantSpec, dict[str, torch.Tensor]]]:
    g = gen(5)
    q8 = torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8)
    q4 = torch.randint(-8, 8, (N_OUT, K_IN), generator=g, dtype=torch.int8)
    s1, s64 = torch.rand(N_OUT, 1, generator=g) * 0.01, torch.rand(N_OUT, 4, generator=g) * 0.01
    off64 = torch.randint(-8, 8, (N_OUT, 4), generator=g).float()
    zp = torch.randint(-8, 8, (N_OUT, 4), generator=g, dtype=torch.int8)
    ct = dict(source_format="compressed-tensors", extra={"format": "pack-quantized"})
    group = dict(weight_strategy="group", group_size=64)
    return [
        ("w8a16_channel", QuantSpec("W8A16"), {"weight": q8, "weight_scale": s1}),
        ("w8a16_group_offset", QuantSpec("W8A16", **group),
         {"weight": q8, "weight_scale": s64, "weight_offset": off64}),
        ("w4a16_modelslim", QuantSpec("W4A16", weight_bits=4, **group),
         {"weight": q4, "weight_scale": s64, "weight_offset": off64}),
        ("w4a16_ct_sym", QuantSpec("W4A16", weight_bits=4, **group, **ct),
         {"weight_packed": pack_to_int32(q4, 4, dim=1), "weight_scale": s64,
          "weight_shape": torch.tensor([[N_OUT, K_IN]])}),
        ("w4a16_ct_asym", QuantSpec("W4A16", weight_bits=4, weight_symmetric=False, **group, **ct),
         {"weight_packed": pack_to_int32(q4, 4, dim=1), "weight_scale": s64,
          "weight_zero_point": pack_to_int32(zp, 4, dim=0), "weight_shape": torch.tensor([[N_OUT, K_IN]])}),
    ]


@pytest.mark.parametrize("name,spec,ck", weight_only_layers(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_only_scheme_kernel_path(ops, name, spec, ck, dtype):
    layer = build(spec, ck, bias=True)
    assert layer.wo_gemv is not None, name
    for m in range(1, layer.wo_gemv.max_m + 1):
        x = torch.randn(1, m, K_IN, generator=gen(m)).to(dtype)
        y = layer(x)
        assert y.shape == (1, m, N_OUT)
        assert_close(y, layer.quant_method.apply_reference(layer, x, layer.bias))
    gemv, layer.wo_gemv = layer.wo_gemv, None  # the previous fast path agrees too
    x = torch.randn(1, K_IN, generator=gen(1)).to(dtype)
    without = layer(x)
    layer.wo_gemv = gemv
    assert (layer(x).float() - without.float()).abs().max() <= 4 * ULP[dtype] * without.float().abs().max() + 1e-3


def static_w8a8_layer(modelslim: bool, seed: int):
    """A static W8A8 linear from a ModelSlim (offset, deq_scale, quant_bias) or compressed-tensors checkpoint."""
    g = gen(seed)
    q = torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8)
    s_w = torch.rand(N_OUT, 1, generator=g) * 0.01
    ck = {"weight": q, "weight_scale": s_w, "input_scale": torch.tensor([0.03])}
    if modelslim:
        ck.update(weight_offset=torch.zeros(N_OUT, 1), input_offset=torch.tensor([2.0]),
                  deq_scale=(0.03 * s_w[:, 0]), quant_bias=torch.randint(-900, 900, (N_OUT,), generator=g,
                                                                          dtype=torch.int32))
    spec = QuantSpec("W8A8") if modelslim else QuantSpec("W8A8", source_format="compressed-tensors")
    return build(spec, ck, bias=not modelslim)


def test_large_m_keeps_previous_paths(ops):
    g = gen(8)
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01}
    layer = build(QuantSpec("W8A8_DYNAMIC"), ck)
    x = torch.randn(kernels.INT8_GEMV_MAX_M + 1, K_IN, generator=g)
    layer.w8a8_gemv = None  # the kernel must not be consulted above the crossover
    assert torch.equal(layer(x), kernels.int8_linear_dynamic(x, layer.w8a8_w_t, layer.w8a8_ws))
    assert not kernels.gemv_fits(x, kernels.INT8_GEMV_MAX_M)
    assert kernels.gemv_fits(x[:1], kernels.INT8_GEMV_MAX_M)
    assert not kernels.gemv_fits(x[:1].double(), kernels.INT8_GEMV_MAX_M)


def test_nd_and_strided_inputs(ops):
    """x [..., K] keeps its leading dims; row-strided and non-contiguous x and a non-contiguous bias are taken."""
    x, q, scale, _, bias = operands(6, 64, 24, 1, 8, 3, torch.bfloat16)
    rs, ws = q.sum(1, dtype=torch.int32), scale.reshape(-1).contiguous()
    ref = ops.w8a8_dynamic_linear(x, q, rs, ws, bias)
    assert torch.equal(ops.w8a8_dynamic_linear(x.reshape(2, 3, 64), q, rs, ws, bias), ref.reshape(2, 3, 24))
    wide = torch.zeros(6, 80, dtype=torch.bfloat16)
    wide[:, :64] = x
    assert torch.equal(ops.w8a8_dynamic_linear(wide[:, :64], q, rs, ws, bias), ref)  # row stride 80
    assert torch.equal(ops.w8a8_dynamic_linear(x.t().contiguous().t(), q, rs, ws, bias), ref)  # column-major
    assert torch.equal(ops.w8a8_dynamic_linear(x, q, rs, ws, torch.stack([bias, bias], 1)[:, 0]), ref)
    assert ops.w8a16_linear(x[0], q, scale, None, None).shape == (24,)
    assert_close(ops.w8a16_linear(x.reshape(3, 2, 64), q, scale, None, bias),
                 ref_weight_only(x, q, scale, None, bias).reshape(3, 2, 24))


def run_stack_spec(ops, spec, x: torch.Tensor) -> torch.Tensor:
    """What a C++ decode stack does with ``decode_stack_call``'s spec (kinds in ``kernels.STACK_KIND_*``)."""
    kind, tensors, ints = spec

    def opt(t: torch.Tensor) -> torch.Tensor | None:
        return t if t.numel() else None

    if kind == kernels.STACK_KIND_W8A8_DYNAMIC:
        w, rs, ws, b = tensors
        return ops.w8a8_dynamic_linear(x, w, rs, ws, opt(b))
    if kind == kernels.STACK_KIND_W8A8_DYNAMIC_NV:
        wp, rs, ws, b = tensors
        return ops.w8a8_dynamic_linear_nv(x, wp, rs, ws, opt(b))
    if kind == kernels.STACK_KIND_W8A8_STATIC_NV:
        wp, rs, deq, qb, b, so = tensors
        return ops.w8a8_static_linear_nv(x, wp, rs, float(so[0]), float(so[1]), deq, opt(qb), opt(b))
    if kind == kernels.STACK_KIND_WO_NV:
        wp, scale, zero, snv, zsnv, b = tensors
        return ops.wo_nv_linear(x, wp, ints[0], ints[1], ints[2], scale, opt(zero), snv, opt(zsnv), opt(b))
    if kind == kernels.STACK_KIND_W8A8_DYNAMIC_AMX:
        wp, ws, b, _ = tensors
        return ops.w8a8_dynamic_linear_amx(x, wp, ws, opt(b))
    if kind == kernels.STACK_KIND_W8A8_STATIC_AMX:
        wp, deq, qb, b, so = tensors
        return ops.w8a8_static_linear_amx(x, wp, float(so[0]), float(so[1]), deq, opt(qb), opt(b))
    if kind == kernels.STACK_KIND_W8A16_AMX:
        w, scale, zero, b, packed = tensors
        if x.shape[0] > ints[0]:
            return ops.w8a16_linear_amx(x, packed, scale.view(-1), opt(b))
        return ops.w8a16_linear(x, w, scale, opt(zero), opt(b))
    w, scale, zero, b = tensors
    if kind == kernels.STACK_KIND_W8A16:
        return ops.w8a16_linear(x, w, scale, opt(zero), opt(b))
    assert kind == kernels.STACK_KIND_W4A16
    return ops.w4a16_linear(x, w, ints[0], scale, opt(zero), opt(b))


@pytest.mark.parametrize("name,spec,ck", weight_only_layers(), ids=lambda v: v if isinstance(v, str) else "")
def test_decode_stack_call_weight_only(ops, name, spec, ck):
    layer = build(spec, ck, bias=True)
    for m in (1, 2, min(5, layer.wo_gemv.max_m)):  # up to the kernel's own limit (the stack's too)
        x = torch.randn(m, K_IN, generator=gen(2)).bfloat16()
        assert torch.equal(run_stack_spec(ops, layer.quant_method.scheme.decode_stack_call(layer), x), layer(x))


def test_decode_stack_call_w8a8_dynamic(ops):
    g = gen(10)
    ck = {"weight": torch.randint(-128, 128, (N_OUT, K_IN), generator=g, dtype=torch.int8),
          "weight_scale": torch.rand(N_OUT, 1, generator=g) * 0.01}
    for bias in (False, True):
        layer = build(QuantSpec("W8A8_DYNAMIC"), ck, bias=bias)
        x = torch.randn(2, K_IN, generator=g).bfloat16()
        assert torch.equal(run_stack_spec(ops, layer.quant_method.scheme.decode_stack_call(layer), x), layer(x))


# ---- 16-bit x weight-only kernels: VDPBF16PS (quant_wo_bf16.h, int4; int8 on request) and FMA (quant_wo_fma8.h,
# int8): bit-trick weights, per-block offsets / end corrections, 64-byte chunks with a masked tail, group halves ----


@pytest.fixture(params=["vnni", "int8-dp", "fma"])
def bf16_ops(request, ops):
    """The module with W8A16 on 16-bit x routed through the VNNI fixed-point kernel (the default), the VDPBF16PS
    kernel (slower on this CPU, kept correct) or the FMA kernel (the default without VNNI)."""
    old_vnni = ops.set_wo_vnni(1 if request.param == "vnni" else 0)
    old_dp = ops.set_wo_bf16_int8(1 if request.param == "int8-dp" else 0)
    yield ops
    ops.set_wo_bf16_int8(old_dp)
    ops.set_wo_vnni(old_vnni)


def extreme_operands(m: int, k: int, n: int, groups: int, bits: int, seed: int):
    """Operands with the extreme weights (-2^(b-1), 2^(b-1) - 1) in whole rows and scattered."""
    x, q, scale, zero, bias = operands(m, k, n, groups, bits, seed, torch.bfloat16)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q[0].fill_(lo)
    q[1].fill_(hi)
    q[2, ::3] = lo
    q[3, 1::3] = hi
    return x, q, scale, zero, bias


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k,groups", [(576, 1), (64, 1), (100, 1), (7, 1), (1000, 1), (256, 8), (96, 3),
                                      (192, 2), (384, 3), (200, 5), (1536, 12), (1024, 4), (1000, 4)])
def test_w8a16_bf16_kernel(bf16_ops, m, k, groups):
    x, q, scale, zero, bias = extreme_operands(m, k, 37, groups, 8, m * 31 + k)
    for z, b in ((None, None), (zero, bias), (None, bias)):
        assert_close(bf16_ops.w8a16_linear(x, q, scale, z, b), ref_weight_only(x, q, scale, z, b))


@pytest.fixture(params=["vnni", "bf16-dp"])
def wo4_ops(request, ops):
    """The module with W4A16 on 16-bit x through the VNNI fixed-point kernel (default) or the VDPBF16PS one."""
    old = ops.set_wo_vnni(1 if request.param == "vnni" else 0)
    yield ops
    ops.set_wo_vnni(old)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("k,groups", [(576, 1), (128, 1), (7, 1), (255, 1), (1000, 1), (576, 9), (384, 3),
                                      (640, 5), (1536, 12), (256, 2), (1536, 48), (160, 5)])
def test_w4a16_bf16_kernel(wo4_ops, m, k, groups):
    x, q, scale, zero, bias = extreme_operands(m, k, 37, groups, 4, m * 17 + k)
    packed = wo4_ops.w4a16_pack(q)
    for z, b in ((None, None), (zero, bias), (None, bias)):
        assert_close(wo4_ops.w4a16_linear(x, packed, k, scale, z, b), ref_weight_only(x, q, scale, z, b))


# ---- VNNI weight-only kernels (quant_wo_vnni.h): x as 16-bit fixed point per row, exact integer dot products ----


def weight_only(ops, bits: int, x, q, scale, zero, bias):
    """The W8A16 / W4A16 kernel on int8 values q."""
    if bits == 8:
        return ops.w8a16_linear(x, q, scale, zero, bias)
    return ops.w4a16_linear(x, ops.w4a16_pack(q), q.shape[1], scale, zero, bias)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,groups", [(576, 9), (1536, 24), (576, 1), (1000, 1)])
def test_vnni_with_outlier_activations(ops, bits, dtype, k, groups):
    """Activations with a few outliers 300x the rest (the fixed point's step is set by the largest): the VNNI
    kernels stay within one rounding of the output, as the floating-point kernels do."""
    x, q, scale, _, bias = operands(4, k, 64, groups, bits, k + groups + bits, dtype)
    x[:, 5] = 300.0
    x[1, k // 2] = -450.0
    ref = ref_weight_only(x, q, scale, None, bias)
    for mode in (1, 0):
        old = ops.set_wo_vnni(mode)
        try:
            assert_close(weight_only(ops, bits, x, q, scale, None, bias), ref)
        finally:
            ops.set_wo_vnni(old)


@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_rows_do_not_depend_on_the_batch(ops, bits):
    """Each x row gets its own fixed-point step: a row computed alone equals it computed in a batch, bit for bit
    (plain decode and speculative verification agree)."""
    x, q, scale, _, _ = operands(5, 576, 40, 9, bits, 3, torch.bfloat16)
    x[2] *= 1000.0  # a row with a much larger range must not change the others
    batch = weight_only(ops, bits, x, q, scale, None, None)
    for i in range(5):
        assert torch.equal(weight_only(ops, bits, x[i : i + 1], q, scale, None, None), batch[i : i + 1])


@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_zero_and_non_finite_rows(ops, bits):
    """An all-zero row gives exactly the bias; a NaN / inf in x reaches the output (the call falls back to the
    floating-point kernel, as the reference would propagate it)."""
    x, q, scale, _, bias = operands(3, 256, 12, 4, bits, 9, torch.bfloat16)
    x[0] = 0.0
    assert torch.equal(weight_only(ops, bits, x, q, scale, None, bias)[0], bias)
    x[1, 7] = float("nan")
    x[2, 3] = float("inf")
    y = weight_only(ops, bits, x, q, scale, None, bias)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_bf16_offset_cancels(bf16_ops, bits):
    """x with a large mean over a long K: the +2304 / +136 weight offsets must cancel per block, not at the end."""
    k, n = 8192, 16
    g = gen(11)
    x = (torch.rand(2, k, generator=g) + 1.0).bfloat16()
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (n, k), generator=g, dtype=torch.int8)
    q[:, : k // 2] = lo  # a large positive and a large negative half: the result is a small difference
    q[:, k // 2:] = -lo - 1
    scale = torch.rand(n, 1, generator=g) + 0.5
    ref = ref_weight_only(x, q, scale, None, None)
    y = bf16_ops.w8a16_linear(x, q, scale, None, None) if bits == 8 else \
        bf16_ops.w4a16_linear(x, bf16_ops.w4a16_pack(q), k, scale, None, None)
    assert_close(y, ref)


def test_bf16_kernel_paths_agree_with_fp32_path(ops):
    """The VNNI, VDPBF16PS and FMA int8 kernels and the portable path give the same bf16 results (to rounding)."""
    x, q, scale, zero, bias = extreme_operands(3, 320, 40, 5, 8, 5)
    ys = []
    for vnni, dp, generic in ((1, 0, 0), (0, 1, 0), (0, 0, 0), (0, 0, 1)):
        old_v, old_dp, old_gen = ops.set_wo_vnni(vnni), ops.set_wo_bf16_int8(dp), ops.set_force_generic(generic)
        try:
            ys.append(ops.w8a16_linear(x, q, scale, zero, bias))
        finally:
            ops.set_wo_vnni(old_v)
            ops.set_wo_bf16_int8(old_dp)
            ops.set_force_generic(old_gen)
    ref = ref_weight_only(x, q, scale, zero, bias)
    for y in ys:
        assert_close(y, ref)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1037, 576), (523, 80), (9, 1536)])
def test_w8a8_row_streams_bit_identical(isa_ops, m, n, k):
    """The AVX2 side-by-side row streams (quant_int8_avx2.h): leftover rows past the streams, K tails of 16 and of
    fewer columns, and the extreme pair |w| = 128 against |x| = 127 (exact only without int16 saturation)."""
    x, q, _, _, bias = operands(m, k, n, 1, 8, m * 31 + n + k, torch.bfloat16)
    q[: n // 2, :64] = -128
    x[0, :64] = -x[0, :64].abs().amax() * torch.sign(torch.arange(64) % 2 - 0.5).to(x.dtype)  # |q_x| = 127 there
    w_scale = torch.rand(n, generator=gen(n)) * 0.01
    row_sum = q.sum(1, dtype=torch.int32)
    y = isa_ops.w8a8_dynamic_linear(x, q, row_sum, w_scale, bias)
    assert torch.equal(y, kernels.int8_linear_dynamic(x, q.t(), w_scale, bias))
    # static activations reaching -128 (the streams stand aside for such calls) and not reaching it
    for sx in (0.001, 1.0):
        y = isa_ops.w8a8_static_linear(x, q, row_sum, sx, 0.0, w_scale, None, bias)
        assert torch.equal(y, kernels.int8_linear_static(x, q.t(), sx, 0.0, w_scale, None, bias))
