"""The row-interleaved VNNI layout of the weight-only decode kernels (``cpu_kernels/quant_wo_nv.h``).

64 output rows share each 64-byte-vector step, so one VPDPBUSD serves 16 rows with no horizontal reductions; the
weight is repacked once at load (``wo_nv_pack``), scales and zero points are rearranged to ``[Npad/64, G, 64]``.
Measured on the Zen 4 CPU (AVX512-VNNI, no AMX; 2 threads, the 120 linears of a SmolLM2-135M decode step,
DRAM-resident, interleaved minima, ms, row layout (``quant_wo_vnni.h``) vs this one):
  W4A16 group 64:   M=1 3.78 vs 3.19;  M=2 4.95 vs 3.76;  M=4 8.97 vs 6.38;
  W8A16 per channel: M=1 5.31 vs 5.59;  M=2 6.31 vs 6.19;  M=4 11.10 vs 8.81 (before the scale-dtype template fix;
  after it, M=1: 4.70 vs 4.42 and 5.44 vs 4.93 per channel, 6.59 vs 5.08 and 6.40 vs 5.54 with group-64 fp32 scales
  and zero points).
Cache-resident the new layout is 1.4-2.5x faster (W4A16) and 1.2-1.7x (W8A16): a decode GEMV from DRAM is bound
by the memory system, not by these instructions. W4A16 takes this layout on VNNI CPUs with a 16-bit model (its row
layout reads the checkpoint's bytes in place and the int4pack copy is dropped, so memory is unchanged). W8A16 adds
this one as a second copy beside its checkpoint rows (+1 byte per weight, counted by
``cpu_packing.limit_dual_layouts``, which falls back to the rows) for M up to ``kernels.WO_NV_MAX_M`` unless AMX-INT8
tiles serve the layer: without it a batch of 5-32 decodes ran the dequantized dense weight through the module path
(SmolLM2 at batch 32: 0.76-0.88x bf16). W8A8 dynamic (``quant_int8_nv.h``, signed weight bytes, bit-identical to
the row kernel) adds the layout as a second copy on VNNI CPUs without AMX-INT8, for M up to
``kernels.INT8_NV_MAX_M`` (1.2x the row kernel at M=1, 1.7x at M=16, 1.9x quantize + ``_int_mm`` at M=32).
``ASCENT_QUANT_NV=0`` (read at load) keeps the row layouts only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

NV_ROWS = 64
NV_BITS = (4, 8)
NV_ENV = "ASCENT_QUANT_NV"


@dataclass
class NvLayout:
    """``packed`` uint8 [Npad/64, K steps, 4, 64] (``wo_nv_pack``), ``scale`` [Npad/64, G, 64] (bf16 when every
    scale is a bf16 value, as checkpoints of 16-bit models store them: half the scale bytes streamed per call; else
    fp32), ``zero_scale`` fp32 [Npad/64, G, 64] (zero point * scale) or None; ``n`` the true rows N."""

    n: int
    packed: torch.Tensor
    scale: torch.Tensor
    zero_scale: torch.Tensor | None


def nv_applies(ops: ModuleType, bits: int, k: int, groups: int, dtype: torch.dtype | None) -> bool:
    """Whether a weight takes the row-interleaved layout: ``NV_BITS``, an AVX512-VNNI CPU, a 16-bit model, scale
    groups of whole kernel steps (8 columns int4, 4 int8) and ``ASCENT_QUANT_NV`` not 0."""
    step = 8 if bits == 4 else 4
    return (bits in NV_BITS and dtype in (torch.bfloat16, torch.float16) and "vnni" in ops.isa()
            and (groups == 1 or (k // groups) % step == 0) and os.environ.get(NV_ENV, "1") != "0")


def w4_blocked_applies(ops: ModuleType, bits: int, k: int, groups: int, dtype: torch.dtype | None) -> bool:
    """Whether an int4 weight takes the blocked layout (``cpu_kernels/quant_w4_layouts.h``: 4 rows' 64-column halves
    side by side, one sequential stream per thread; 0.75x the time of the row layout for the 120 linears of a
    SmolLM2-135M decode step on a Zen 2): a CPU with AVX2 but no AVX512-VNNI (where the row-interleaved layout
    serves), a 16-bit model, K and the group size multiples of 64 columns and ``ASCENT_QUANT_NV`` not 0."""
    isa = ops.isa()
    return (bits == 4 and dtype in (torch.bfloat16, torch.float16) and isa != "generic" and "vnni" not in isa
            and k % 64 == 0 and (groups == 1 or (k // groups) % 64 == 0) and os.environ.get(NV_ENV, "1") != "0")


def int8_nv_applies(ops: ModuleType) -> bool:
    """Whether W8A8 dynamic adds its row-interleaved copy (``quant_int8_nv.h``): AVX512-VNNI and ``ASCENT_QUANT_NV``
    not 0 (the caller leaves CPUs with AMX-INT8 to their tile kernels)."""
    return "vnni" in ops.isa() and os.environ.get(NV_ENV, "1") != "0"


def nv_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 ``[N, G]`` -> ``[Npad/64, G, 64]`` (padding rows 0)."""
    npad = -(-n // NV_ROWS) * NV_ROWS
    t = t.float()
    if npad > n:
        t = torch.cat([t, t.new_zeros(npad - n, t.shape[1])])
    return t.reshape(npad // NV_ROWS, NV_ROWS, t.shape[1]).permute(0, 2, 1).contiguous()


def prepare_nv(ops: ModuleType, q: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor | None
               ) -> NvLayout:
    """The layout of int8 values ``q`` [N, K] with ``scale`` / ``zero`` fp32 [N, G]."""
    n = q.shape[0]
    zero_scale = None if zero is None else nv_rows(zero.float() * scale.float(), n)
    scale_nv = nv_rows(scale, n)
    as_bf16 = scale_nv.to(torch.bfloat16)
    if torch.equal(as_bf16.float(), scale_nv):  # exact: the kernel widens them back to the same fp32 values
        scale_nv = as_bf16
    return NvLayout(n, ops.wo_nv_pack(q.contiguous(), bits), scale_nv, zero_scale)
