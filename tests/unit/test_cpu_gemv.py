"""The small-M C++ linear kernel (``gemv_cpu.cpp``) and the CPU linear dispatch around it (``cpu_packing``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers import cpu_kernels, cpu_packing


@pytest.fixture(scope="module")
def gemv():
    module = cpu_kernels.gemv_ops()
    assert module is not None, "the small-M kernel must build on the CPU profile (g++ is part of the setup)"
    return module


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of a bf16/fp16 tensor, in fp32."""
    bits = 8 if x.dtype == torch.bfloat16 else 11
    exp = torch.frexp(x.float().abs().clamp_min(torch.finfo(x.dtype).tiny))[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - bits)


@pytest.fixture(params=[0, 1, 2, 3], ids=["scalar", "avx2", "avx512f", "avx512bf16"])
def isa(gemv, request):
    """Every instruction-set path the CPU has (levels above it run its best path): set_isa_limit caps the kernel."""
    previous = gemv.set_isa_limit(request.param)
    yield request.param
    gemv.set_isa_limit(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 24, 33, 70])
# (1030, 48): both threads' row ranges leave rows over after the AVX2 kernel's side-by-side streams, and K ends in
# a 16-column step; (7, 80): fewer rows than streams plus one leftover. From 24 x rows the AVX2 path repacks W into
# 16-row panels: (37, 100) and (260, 576) leave rows after the panels, (5, 33) fills no panel.
@pytest.mark.parametrize("n,k", [(96, 64), (37, 100), (260, 576), (5, 33), (1030, 48), (7, 80)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_reference_within_one_ulp(gemv, isa, dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    exact = x.float() @ w.float().T + (bias.float() if with_bias else 0.0)
    got = gemv.linear_small_m(x, w, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    # fp32 accumulation in another order than oneDNN: at most one output rounding step from the exact value
    torch.testing.assert_close(got.float(), exact, rtol=0, atol=float((_ulp(exact.to(dtype)) * 1.01).max()) + 1e-4)
    assert (got.float() - exact).abs().le(_ulp(exact.to(dtype)) + 1e-4 * exact.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 24, 35])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("float_output", [False, True])
def test_exact_sums_round_to_nearest_even_as_torch(gemv, isa, dtype, m, with_bias, float_output):
    """Small integers make every sum exact in fp32 whatever the summation order, and many of them odd above 256, so
    halfway between two bf16 values: each path (the AVX2 panels' vector stores from 24 rows) must round them, and
    NaN, exactly as torch's conversion does (a truncating or NaN-dropping store would pass the one-ulp test)."""
    gen = torch.Generator().manual_seed(m)
    n, k = 48, 64
    x = torch.randint(-8, 9, (m, k), generator=gen).to(dtype)
    w = torch.randint(-64, 65, (n, k), generator=gen).to(dtype)
    x[1, 5] = float("nan")
    bias = torch.randint(-300, 301, (n,), generator=gen).to(dtype) if with_bias else None
    exact = x.float() @ w.float().T + (bias.float() if with_bias else 0.0)
    assert (exact.abs() > 256).sum() > m * n // 4  # ties to round: the test needs them
    got = gemv.linear_small_m(x, w, bias, float_output)
    expected = exact.to(dtype)
    assert got.dtype == (torch.float32 if float_output else dtype)
    # (NaN bits: c10's scalar conversion, which the kernels follow, gives 0x7FC0; torch's vectorized one 0xFFFF)
    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan()[1].all()
    finite = ~expected.isnan()
    assert torch.equal(got[finite].float().view(torch.int32), expected[finite].float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 24])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float_output_is_the_rounded_result_widened(gemv, isa, dtype, m, with_bias):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 100, generator=gen).to(dtype)
    w = (torch.randn(259, 100, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(259, generator=gen).to(dtype) if with_bias else None
    got = gemv.linear_small_m(x, w, bias, float_output=True)
    assert got.dtype == torch.float32 and got.shape == (m, 259)
    assert torch.equal(got, gemv.linear_small_m(x, w, bias).float())


def test_leading_dims_and_strided_input(gemv):
    x = torch.randn(2, 1, 4, 64)[..., :48].to(torch.bfloat16)  # non-contiguous last-dim slice
    w = (torch.randn(24, 48) * 0.1).to(torch.bfloat16)
    got = gemv.linear_small_m(x, w, None)
    assert got.shape == (2, 1, 4, 24)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2)


@pytest.fixture
def avx2_path(gemv):
    """The kernel capped at its AVX2 path, whose layout the panels are (CPUs with AVX512 run it too); a CPU without
    AVX2 + FMA + F16C has no such path."""
    previous = gemv.set_isa_limit(1)
    cpu_packing.small_m_max.cache_clear()
    try:
        if gemv.kernel_path(False) != "avx2":
            pytest.skip("this CPU has no AVX2 + FMA + F16C: the kernel has no panel path here")
        yield gemv
    finally:
        gemv.set_isa_limit(previous)
        cpu_packing.small_m_max.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [24, 35, 300])
# (1030, 48): thread tasks of 4-row blocks would start mid-panel; (37, 100): 2 panels and 5 rows after them, K ends
# mid 16-column block; (8, 32): no full panel
@pytest.mark.parametrize("n,k", [(96, 64), (1030, 48), (37, 100), (8, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_panels_equal_per_call_repacking(avx2_path, gemv, dtype, m, n, k, with_bias):
    """pack_panels lays W out as the AVX2 panel path repacks it per call: passing it gives the same bits."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    panels = gemv.pack_panels(w)
    assert panels.dtype == torch.float32 and panels.shape == (n // 16, k, 16)
    for float_output in (False, True):
        want = gemv.linear_small_m(x, w, bias, float_output)
        assert torch.equal(gemv.linear_small_m(x, w, bias, float_output, panels), want)
    if n >= 16 and k % 16:  # the K % 16 tail keeps natural column order: column c of row r at [0, c, r]
        assert torch.equal(panels[0, k - 1], w[:16, k - 1].float())


def test_prepacked_panels_bad_inputs_raise(avx2_path, gemv):
    w = torch.zeros(32, 16, dtype=torch.bfloat16)
    x = torch.zeros(30, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="panels must be pack_panels"):
        gemv.linear_small_m(x, w, None, False, torch.zeros(2, 16, 8))
    with pytest.raises(RuntimeError, match="panels must be pack_panels"):
        gemv.linear_small_m(x, w, None, False, torch.zeros(2, 16, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16/fp16"):
        gemv.pack_panels(torch.zeros(32, 16))
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv.pack_panels(torch.zeros(16, 32, dtype=torch.bfloat16).T)


@pytest.mark.parametrize("released", [False, True])
def test_panel_weight_takes_every_row_count(avx2_path, gemv, monkeypatch, released):
    """On the kernel's AVX2 path a layer gets a PanelWeight and no fp32 GEMM copy: the kernel then takes calls beyond
    small_m_max too (with the prepacked panels, or repacking once limit_dual_layouts released them), within one
    output rounding of the exact product."""
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(40, 48, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    panels = cpu_packing.panel_weight(w, gemv)
    assert panels is not None and panels.panels.shape == (2, 48, 16) and panels.nbytes == 2 * 48 * 16 * 4
    if released:
        panels.panels = None
    recorder = _Recorder(gemv)
    for m in (1, 30, cpu_packing.small_m_max(torch.bfloat16) + 44):
        x = torch.randn(m, 48, generator=gen).to(torch.bfloat16)
        exact = x.float() @ w.float().T + bias.float()
        got = cpu_packing.cpu_linear(x, w, None, bias, recorder, panels=panels)
        assert (got.float() - exact).abs().le(_ulp(exact.to(torch.bfloat16)) + 1e-4 * exact.abs().max()).all()
    assert recorder.calls == 3
    monkeypatch.setattr(cpu_packing, "dual_layout_budget_bytes", lambda default_only=False: 40 * 48 * 4 - 1)
    assert cpu_packing.panel_weight(w, gemv).panels is None  # over the budget: the kernel alone, no panels
    assert cpu_packing.panel_weight(w, None) is None


def test_bad_inputs_raise(gemv):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x dtype"):
        gemv.linear_small_m(torch.zeros(1, 16, dtype=torch.float16), w, None)
    with pytest.raises(RuntimeError, match="last dim"):
        gemv.linear_small_m(torch.zeros(1, 15, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        gemv.linear_small_m(torch.zeros(1, 16, dtype=torch.bfloat16), w, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16/fp16"):
        gemv.linear_small_m(torch.zeros(1, 16), torch.zeros(8, 16), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv.linear_small_m(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16).T,
                            None)


class _Recorder:
    """Stands in for the kernel module to see which path ``cpu_linear`` takes."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def linear_small_m(self, x, w, b, float_output=False, panels=None):
        self.calls += 1
        return self.real.linear_small_m(x, w, b, float_output, panels)

    def kernel_path(self, half):
        return self.real.kernel_path(half)


def test_dispatch_small_m_kernel_then_packed(gemv):
    w = (torch.randn(64, 32) * 0.1).to(torch.bfloat16)
    packed = cpu_packing.pack_linear_weight(w)
    recorder = _Recorder(gemv)
    limit = cpu_packing.small_m_max(torch.bfloat16)
    for m in range(1, limit + 3):
        x = torch.randn(m, 32).to(torch.bfloat16)
        before = recorder.calls
        got = cpu_packing.cpu_linear(x, w, packed, None, recorder)
        assert recorder.calls == before + (1 if m <= limit else 0)
        torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    # released plain rows (packed-only layer) never reach the kernel
    assert cpu_packing.cpu_linear(torch.randn(1, 32).to(torch.bfloat16), torch.empty(0, dtype=torch.bfloat16),
                                  packed, None, recorder).shape == (1, 64)
    assert recorder.calls == limit


def _expected_small_m_max(gemv, dtype: torch.dtype) -> int:
    if dtype == torch.bfloat16 and gemv.bf16_dot_path():
        return cpu_packing.SMALL_M_MAX_BF16_DOT
    if gemv.kernel_path(dtype == torch.float16) == "avx2":
        return cpu_packing.SMALL_M_MAX_AVX2
    return cpu_packing.SMALL_M_MAX


@pytest.mark.parametrize("level,paths", [(3, None), (1, ("avx2", "scalar")), (0, ("scalar",))])
def test_small_m_range_follows_the_kernel_path(gemv, level, paths):
    """bf16 on the AVX512-BF16 dot path keeps the small-M kernel up to SMALL_M_MAX_BF16_DOT rows, the AVX2 path (bf16
    and fp16) up to SMALL_M_MAX_AVX2, other paths up to SMALL_M_MAX; capping the ISA moves the range with the path."""
    previous = gemv.set_isa_limit(level)
    cpu_packing.small_m_max.cache_clear()
    try:
        for dtype in (torch.bfloat16, torch.float16):
            path = gemv.kernel_path(dtype == torch.float16)
            assert paths is None or path in paths
            assert cpu_packing.small_m_max(dtype) == _expected_small_m_max(gemv, dtype)
        if level == 0:
            assert cpu_packing.small_m_max(torch.bfloat16) == cpu_packing.SMALL_M_MAX
        if level == 1 and gemv.kernel_path(False) == "avx2":
            assert cpu_packing.small_m_max(torch.float16) == cpu_packing.SMALL_M_MAX_AVX2
    finally:
        gemv.set_isa_limit(previous)
        cpu_packing.small_m_max.cache_clear()


def test_isa_limit_rejects_bad_levels(gemv):
    with pytest.raises(RuntimeError, match="level must be in"):
        gemv.set_isa_limit(4)
    assert gemv.set_isa_limit(3) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_gemm_copy_without_native_16bit_gemm(monkeypatch, dtype, with_bias):
    """Where oneDNN has no native 16-bit GEMM, the GEMM layout is an fp32 copy: x widened, fp32 sums, one rounding
    to x's dtype, so every row is within one output rounding of the exact value (as F.linear's 16-bit GEMM)."""
    monkeypatch.setattr(cpu_packing, "native_16bit_gemm", lambda dtype: False)
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 80, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype) if with_bias else None
    packed = cpu_packing.pack_linear_weight(w)
    assert packed is not None and packed.dtype == torch.float32 and torch.equal(packed, w.float())
    for m in (1, 7, 33):
        x = torch.randn(m, 80, generator=gen).to(dtype)
        exact = x.float() @ w.float().T + (bias.float() if with_bias else 0.0)
        got = cpu_packing.cpu_linear(x, torch.empty(0, dtype=dtype), packed, bias, None)
        assert got.dtype == dtype and got.shape == (m, 48)
        assert (got.float() - exact).abs().le(_ulp(exact.to(dtype)) + 1e-4 * exact.abs().max()).all()
    monkeypatch.setenv("ASCENT_CPU_PACK_WEIGHTS", "0")
    assert cpu_packing.pack_linear_weight(w) is None


def test_fp32_gemm_copy_limited_to_a_quarter_of_available_memory(monkeypatch):
    monkeypatch.setattr(cpu_packing, "native_16bit_gemm", lambda dtype: False)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(cpu_packing, "dual_layout_budget_bytes", lambda default_only=False: 64 * 64 * 4 - 1)
    assert cpu_packing.pack_linear_weight(w) is None
    monkeypatch.setattr(cpu_packing, "dual_layout_budget_bytes", lambda default_only=False: 64 * 64 * 4)
    assert cpu_packing.pack_linear_weight(w).dtype == torch.float32


def test_kernel_switch_off(monkeypatch):
    monkeypatch.setenv("ASCENT_CPU_SMALL_M_GEMV", "0")
    assert cpu_packing.small_m_kernel(torch.zeros(4, 4, dtype=torch.bfloat16)) is None
    monkeypatch.delenv("ASCENT_CPU_SMALL_M_GEMV")
    assert cpu_packing.small_m_kernel(torch.zeros(4, 4, dtype=torch.float32)) is None
    assert cpu_packing.small_m_kernel(torch.zeros(4, 4, dtype=torch.bfloat16)) is not None


def _linear_model() -> nn.Module:
    from ascent.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    model = nn.Sequential(ReplicatedLinear(32, 48, bias=False, params_dtype=torch.bfloat16),
                          ReplicatedLinear(48, 16, bias=True, params_dtype=torch.bfloat16))
    for layer in model:
        layer.weight.data.normal_(0, 0.1)
        if layer.bias is not None:
            layer.bias.data.normal_(0, 0.1)
    return model


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model:
        x = layer(x)
        x = x[0] if isinstance(x, tuple) else x
    return x


@pytest.mark.parametrize("amx", ["1", "0"])
@pytest.mark.parametrize("budget,expect_kept", [(1 << 30, True), (0, False)])
def test_dual_layout_budget(budget, expect_kept, amx):
    """The second copy beside the oneDNN-packed weight (AMX tiles where AMX-BF16 exists and the shape fits, else the
    plain rows of the small-M kernel) is kept within the budget and released beyond it. On the kernel's AVX2 path
    the plain rows are the only copy and the prepacked panels the second one."""
    from ascent.loader.base import finalize_model

    model = _linear_model()
    x = torch.randn(2, 32).to(torch.bfloat16)
    dense = _run(model, x).float()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASCENT_CPU_DUAL_LAYOUT_BYTES", str(budget))
        mp.setenv("ASCENT_CPU_AMX", amx)
        finalize_model(model)
    for layer in model:
        has_amx = layer.amx_weight is not None
        has_plain = layer.weight.numel() > 0 and layer.small_m_ops is not None
        if layer.panel_weight is not None:  # the AVX2 path: plain rows always, panels within the budget
            assert getattr(layer, "packed_weight", None) is None and has_plain and not has_amx
            assert (layer.panel_weight.panels is not None) == expect_kept
            continue
        assert getattr(layer, "packed_weight", None) is not None
        assert (has_amx or has_plain) == expect_kept and not (has_amx and has_plain)
    first, second = model  # [48, 32] fits AMX tiles; [16, 48] does not (K % 32 != 0)
    assert (first.amx_weight is not None) == (expect_kept and amx == "1" and cpu_packing.amx_ops() is not None)
    assert second.amx_weight is None
    torch.testing.assert_close(_run(model, x).float(), dense, rtol=2e-2, atol=2e-2)


def test_dual_layout_budget_rejects_negative(monkeypatch):
    monkeypatch.setenv("ASCENT_CPU_DUAL_LAYOUT_BYTES", "-1")
    with pytest.raises(ValueError, match="ASCENT_CPU_DUAL_LAYOUT_BYTES"):
        cpu_packing.dual_layout_budget_bytes()


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo") as info:
        return next(line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id"))


def test_stream_prefetch_follows_the_cpu_vendor(gemv) -> None:
    """The AVX2 row kernels prefetch their weight streams with NTA on AMD CPUs and with the T0 + T1 pair elsewhere
    (stream_prefetch.h), unless ASCENT_CPU_NTA_PREFETCH forces one (read once per process)."""
    if os.environ.get("ASCENT_CPU_NTA_PREFETCH") in ("0", "1"):
        assert gemv.nta_prefetch() == (os.environ["ASCENT_CPU_NTA_PREFETCH"] == "1")
    else:
        assert gemv.nta_prefetch() == (_cpu_vendor() == "AuthenticAMD")
    code = "from ascent.layers import cpu_kernels; print(cpu_kernels.gemv_ops().nta_prefetch())"
    for value, want in (("1", "True"), ("0", "False")):
        env = {**os.environ, "ASCENT_CPU_NTA_PREFETCH": value}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == want
