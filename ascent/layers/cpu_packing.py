"""CPU bf16/fp16 linear weights: oneDNN-packed (or fp32 where oneDNN lacks native 16-bit GEMM) for GEMM-sized
calls, plain rows for the small-M C++ kernel.

oneDNN re-lays-out a plain row-major bf16 weight on every matmul call; packing it once after loading removes that
traffic (measured here: a SmolLM2-shaped bf16 decode step's linears 20.8 -> 14.0 ms at batch 1, 28 -> 21 ms at
batch 64). fp32 weights are left alone (MKL's sgemv already streams at memory bandwidth). Where oneDNN lacks native
bf16/fp16 kernels (AVX2 CPUs), torch's 16-bit matmul is emulated at ~10 GFLOP/s on 2 threads against ~40-57 for
fp32 (Zen 1, 32-256 rows): the GEMM layout is then an fp32 copy of the weight (:func:`pack_linear_weight`).
``ASCENT_CPU_PACK_WEIGHTS=0`` disables both.

Decode-sized calls (at most ``small_m_max(dtype)`` rows) go to ``gemv_cpu.cpp`` instead: one pybind call that
streams the plain weight with software prefetch, where oneDNN pays ~10 µs of primitive dispatch per call and AMX
tiles that small M cannot fill. That needs the plain rows *and* the packed copy; ``limit_dual_layouts`` drops the
plain copies of a model whose duplicated bytes exceed ``dual_layout_budget_bytes()`` (then every call uses the packed
weight).
``ASCENT_CPU_SMALL_M_GEMV=0`` disables the kernel. Where the kernel runs its AVX2 path, it takes every call and
the fp32 copy is not made: its 16-row panels are prepacked instead (:class:`PanelWeight`, the same 4 bytes per
weight).

On CPUs with AMX-BF16 a third layout replaces the plain rows: ``amx_linear_cpu.cpp`` streams B tiles packed once
(:class:`AmxWeight`) and takes every call of at most ``AMX_MAX_M`` rows (measured on a Xeon with AMX, SmolLM2's 120
linears of 30 layers, time against oneDNN's packed GEMM: 2 threads M = 32 0.57x, 64 0.66x, 128 0.78-0.87x, 192
0.93-0.99x, 256 1.08x, 384 1.05x, 512 1.15x; 1 thread M = 128 0.94-0.96x, 192 1.02-1.04x, 256 1.11x, 512 1.22x. A
prefill of 512-token steps took 0.89x the time with the limit at 256 instead of 512; at 200- and 256-token steps
oneDNN was 1.01-1.03x slower than the tiles, hence oneDNN above 256 rows). A single row reads the same tiles' bytes
with AVX512-BF16 dot products instead (``gemv_range``: measured on a Xeon with AMX, 2 threads, 120 decode linears +
lm_head, 0.94-0.96x the tiles' time), as four side-by-side streams per thread (1.10-1.15x the GB/s of one).
``ASCENT_CPU_AMX=0`` disables it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.cpu_kernels import amx_ops, gemv_ops

# Rows of x up to which the C++ small-M kernel is used (above it oneDNN wins; see ``small_m_max``).
SMALL_M_MAX = 4
# bf16 on the kernel's AVX512-BF16 path, measured on a Zen 4 without AMX (SmolLM2, 2 threads). Per layer with hot
# caches, time against oneDNN's packed bf16 GEMM: M = 4 0.67, 8 0.84, 16 0.99, 25 1.10, 32 1.21. End to end, decode
# tok/s with this limit at 4 -> 8 -> 16: batch 6 298 -> 358-379, batch 8 313-325 -> 425-485, batch 12 440-494 ->
# 555-561, batch 16 478-498 -> 542-585 (the weights stream from DRAM once per 4 rows of x, then from L2/L3); batch
# 24 / 32 at 16 vs 32: 593 vs 616 / 644 vs 591 (no gain).
SMALL_M_MAX_BF16_DOT = 16
# bf16 / fp16 on the kernel's AVX2 path (CPUs without AVX512, whose oneDNN has no native 16-bit GEMM: the GEMM
# layout is an fp32 copy). Measured on a Zen 2 (SmolLM2's 30 layers, 2 threads, ms per sweep, small-M kernel vs fp32
# GEMM): M = 1 9.0 vs 38, 4 11 vs 66, 8 20 vs 71, 16 38 vs 86, 32 75 vs 114, 64 155 vs 183, 96 219 vs 238. With
# x widened once and 2 x 6 register tiles from 5 rows on (gemv_avx2.h): M = 64 124 vs 172, 96 198 vs 253, 128 266 vs
# 341, 192 402 vs 454, 256 534 vs 568, 512 1106 vs 1036; the range ends where the margin is still about 20 %.
# With the panel tiles from 24 rows (gemv_panel_avx2.h), on a Zen 3 (2 threads, 4 layers' linears, time against
# the fp32 GEMM copy): M = 128 0.82, 192 0.88, 256 0.85, 384 1.02, 512 0.98, 1024 1.04; hence 256.
SMALL_M_MAX_AVX2 = 256

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
# Rows of x up to which an AMX-packed weight is used (oneDNN's blocked GEMM wins above).
AMX_MAX_M = 256


@dataclass(frozen=True)
class AmxWeight:
    """A bf16 weight ``[N, K]`` packed into AMX B tiles (``amx_pack``: ``[N/16, K/32, 16, 32]``) and its kernels."""

    ops: ModuleType
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


@dataclass
class PanelWeight:
    """A layer on the small-M kernel's AVX2 path, which then serves every row count (no fp32 GEMM copy is made): its
    panel tiles ran 0.91-1.02x MKL's fp32 GEMM time from 512 rows up (Zen 3, 2 threads, SmolLM2's shapes, the fp32
    conversions included) and far ahead of it below. ``panels`` holds W's 16-row panels prepacked (``pack_panels``:
    fp32 ``[N / 16, K, 16]``), which spares the kernel its per-call repacking (~20 % of the panel path's time in a
    batch-35 decode step), or None once ``limit_dual_layouts`` released it (the kernel then repacks)."""

    panels: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return 0 if self.panels is None else self.panels.numel() * self.panels.element_size()


def panel_weight(weight: torch.Tensor, small_m: ModuleType | None) -> PanelWeight | None:
    """A :class:`PanelWeight` for ``weight [N, K]`` where ``small_m`` (the kernel module, or None) takes its dtype on
    the AVX2 path (the panels within a quarter of the memory available now, as an fp32 copy would be), else None."""
    if small_m is None or not _packable(weight) or small_m.kernel_path(weight.dtype == torch.float16) != "avx2":
        return None
    fits = weight.numel() * 4 <= dual_layout_budget_bytes(default_only=True)
    return PanelWeight(small_m.pack_panels(weight.detach()) if fits else None)


def amx_linear_weight(weight: torch.Tensor) -> AmxWeight | None:
    """The AMX layout of a bf16 CPU ``weight [N, K]`` with N % 16 == K % 32 == 0, or None (no AMX-BF16, another
    dtype or shape, ``ASCENT_CPU_AMX=0``)."""
    if os.environ.get("ASCENT_CPU_AMX", "1") == "0" or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype != torch.bfloat16 or weight.shape[0] % 16 or weight.shape[1] % 32 or weight.numel() == 0:
        return None
    ops = amx_ops()
    return AmxWeight(ops, ops.amx_pack(weight.detach())) if ops is not None else None


def _packable(weight: torch.Tensor) -> bool:
    """A 16-bit 2-D CPU weight, with packing not switched off (``ASCENT_CPU_PACK_WEIGHTS=0``)."""
    if os.environ.get("ASCENT_CPU_PACK_WEIGHTS", "1") == "0":
        return False
    return weight.device.type == "cpu" and weight.dtype in _PACKABLE_DTYPES and weight.dim() == 2


def native_16bit_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN has native ``dtype`` (bf16/fp16) GEMM kernels on this CPU (AVX512-BF16 / AVX512-FP16 / AMX
    class); elsewhere (AVX2 CPUs such as AMD Zen 1-3) torch's 16-bit matmul emulates them at a fraction of the fp32
    rate."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN can pack this weight for its native 16-bit GEMM."""
    return _packable(weight) and native_16bit_gemm(weight.dtype)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` -> its GEMM layout for ``packed_linear``: an opaque oneDNN tensor where oneDNN has native
    16-bit kernels, else an fp32 copy (fp32 GEMM at the CPU's full FMA rate, measured 4-5x the emulated bf16 matmul
    from 32 rows up on an AVX2 Zen 1, 2 threads) when it takes at most a quarter of the memory available now; None
    when neither applies."""
    if not _packable(weight):
        return None
    if native_16bit_gemm(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    if weight.numel() * 4 > dual_layout_budget_bytes(default_only=True):
        return None
    return weight.detach().float().contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` in x's dtype; same result as ``F.linear`` with the unpacked weight up to fp32
    summation order. An fp32 ``packed`` (the copy of ``pack_linear_weight`` on CPUs without native 16-bit GEMM) takes
    x widened to fp32 and rounds the result once to x's dtype, as the 16-bit GEMM does (fp32 accumulation)."""
    if packed.dtype == torch.float32:
        out = F.linear(x.float(), packed, bias.float() if bias is not None else None)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def small_m_kernel(weight: torch.Tensor) -> ModuleType | None:
    """The small-M kernel module for this plain ``weight [out, in]``, or None (disabled, unsupported dtype/device)."""
    if os.environ.get("ASCENT_CPU_SMALL_M_GEMV", "1") == "0":
        return None
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return None
    return gemv_ops()


@functools.lru_cache(maxsize=None)
def small_m_max(dtype: torch.dtype) -> int:
    """Rows of x up to which ``dtype`` calls take the small-M kernel: ``SMALL_M_MAX_BF16_DOT`` for bf16 where the
    kernel has AVX512-BF16 dot products (one W pass serves 4 rows at full rate), ``SMALL_M_MAX_AVX2`` on its AVX2
    path, else ``SMALL_M_MAX``. (With AMX the tiles take these calls first; this range is then unused.) Cached once
    computed, so the module path and the decode stack always agree (a test that lowers the kernel's ISA limit and
    then asks must clear the cache)."""
    ops = gemv_ops()
    if ops is None:
        return SMALL_M_MAX
    if dtype == torch.bfloat16 and ops.bf16_dot_path():
        return SMALL_M_MAX_BF16_DOT
    if ops.kernel_path(dtype == torch.float16) == "avx2":
        return SMALL_M_MAX_AVX2
    return SMALL_M_MAX


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None,
               small_m: ModuleType | None, amx: AmxWeight | None = None, float_output: bool = False,
               panels: PanelWeight | None = None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` through the fastest applicable path; all agree with ``F.linear`` up to fp32
    summation order. ``weight`` may be an empty placeholder when only packed copies are kept. ``float_output``: the
    caller wants fp32 (the lm_head's logits); the AMX and small-M paths then write the rounded values as fp32 in one
    pass, the others return their usual dtype (the caller converts). ``panels``: the layer's :class:`PanelWeight`
    (the small-M kernel then takes every row count)."""
    if amx is not None and x.dtype == torch.bfloat16 and x.numel() <= AMX_MAX_M * x.shape[-1]:
        return amx.ops.amx_linear(x, amx.packed, bias, float_output)
    if (small_m is not None and x.dtype == weight.dtype and weight.numel() > 0
            and (panels is not None or x.numel() <= small_m_max(x.dtype) * weight.shape[1])
            and (bias is None or bias.dtype == x.dtype)):
        return small_m.linear_small_m(x, weight, bias, float_output, panels.panels if panels is not None else None)
    if packed is not None and (x.dtype == packed.dtype or packed.dtype == torch.float32):
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def dual_layout_budget_bytes(default_only: bool = False) -> int:
    """Extra bytes a model may spend on plain copies beside its packed weights: ``ASCENT_CPU_DUAL_LAYOUT_BYTES``, else
    a quarter of the memory available now (Linux ``sysconf``; 0 where unknown). ``default_only``: ignore the
    variable (the per-weight limit of fp32 GEMM copies, which replace rather than duplicate a layout)."""
    configured = None if default_only else os.environ.get("ASCENT_CPU_DUAL_LAYOUT_BYTES")
    if configured is not None:
        value = int(configured)
        if value < 0:
            raise ValueError(f"ASCENT_CPU_DUAL_LAYOUT_BYTES={configured!r} must be >= 0")
        return value
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 0


# Quantized layers' AMX tile copies beside their integer weights: AMX-INT8 (W8A8 schemes, W8A16 per channel) and the
# AMX-BF16 weight-only tiles (W4A16, other W8A16; ``quantization/wo_amx.py``).
QUANT_AMX_COPIES = ("w8a8_amx", "wo_amx", "wo_amx_bf16")


def limit_dual_layouts(model: nn.Module, budget_bytes: int | None = None) -> int:
    """After loading: if the second copies kept beside oneDNN-packed weights (plain rows for the small-M kernel,
    ``layer.small_m_ops`` set; AMX tiles, ``layer.amx_weight``) and beside int8 weights (AMX-INT8 tiles,
    ``QUANT_AMX_COPIES``; the row-interleaved copies of W8A8, ``layer.w8a8_gemv.nv``, and W8A16, ``layer.wo_gemv.nv``)
    and the prepacked panels beside the plain rows of the AVX2 path (``layer.panel_weight``) exceed the budget,
    release them all so the model costs no more memory than packed-only (plain-only on the AVX2 path). Returns the
    bytes kept."""
    packed = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    plain = [m for m in packed
             if getattr(m, "small_m_ops", None) is not None and getattr(m, "owns_plain_weight", False)]
    amx = [m for m in packed if getattr(m, "amx_weight", None) is not None]
    amx_quant = [(m, name) for m in model.modules() for name in QUANT_AMX_COPIES if getattr(m, name, None) is not None]
    int8_nv = [g for m in model.modules() if (g := getattr(m, "w8a8_gemv", None)) is not None and g.nv is not None]
    w8a16_nv = [g for m in model.modules()
                if (g := getattr(m, "wo_gemv", None)) is not None and g.nv is not None and g.bits == 8]
    panels = [p for m in model.modules() if (p := getattr(m, "panel_weight", None)) is not None and p.nbytes]
    kept = (sum(m.weight.numel() * m.weight.element_size() for m in plain) + sum(m.amx_weight.nbytes for m in amx)
            + sum(getattr(m, name).nbytes for m, name in amx_quant) + sum(g.nv.numel() for g in int8_nv)
            + sum(g.nv.packed.numel() for g in w8a16_nv) + sum(p.nbytes for p in panels))
    if kept <= (dual_layout_budget_bytes() if budget_bytes is None else budget_bytes):
        return kept
    for module in plain:
        module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        module.small_m_ops = None
    for module in amx:
        module.amx_weight = None
    for module, name in amx_quant:
        setattr(module, name, None)
    for gemv in int8_nv + w8a16_nv:  # the row-layout kernels keep serving M up to their own limits
        gemv.nv = None
    for panel in panels:  # the small-M kernel keeps serving every row count, repacking per call
        panel.panels = None
    return 0
