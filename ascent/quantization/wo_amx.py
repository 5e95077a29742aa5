"""Weight-only int4 / int8 linears on AMX-BF16 tiles for mid-sized M (``cpu_kernels/amx_wo_linear.h``).

On a CPU with AMX the unquantized bf16 weight runs on tiles from a few rows of x on, while the weight-only VNNI
kernels (``quant_wo_nv.h``) do one VPDPWSSD per 32 (int4) or 16 (int8) weights per row: a SmolLM2 W4A16 decode step
at batch 32 took about twice bf16's. ``amx_wo_linear`` dequantizes each tile to the dense bf16 weight's values
(``(q - zero) * scale`` in fp32 rounded to nearest even) right before the tile product, so its output is
``amx_linear``'s on the dequantized weight, bit for bit. It serves W4A16, and W8A16 where no AMX-INT8 copy does (per
group or with zero points; per-channel symmetric W8A16 keeps its exact fixed-point AMX-INT8 kernel, as fast up to 64
rows). The packed copy (``amx_w4_pack`` / ``amx_w8_pack``: values in tile order plus per-group scales and offsets,
~0.56 / 1.06 byte per weight at group 64) is kept beside the layer's other layouts and counted by
``cpu_packing.limit_dual_layouts``.

Measured on a Xeon with AMX (SmolLM2's 120 decode linears, 2 threads, interleaved medians, ms). W4A16 group 64, this
kernel | the row-interleaved int4 kernel | the dequantize-once oneDNN-packed bf16 weight | amx_linear on that bf16
weight: M = 4: 6.3 | 4.5 | 12.1 | 7.9; 8: 6.4 | 6.4 | 12.0 | 8.2; 16: 6.9 | 10.6 | 12.1 | 8.3; 32: 8.1 | 18.7 |
14.3 | 8.7; 64: 13.0 | 35.1 | 17.4 | 12.6; 128: 19.2 | - | 22.8 | 20.2; 256: 33.5 | - | 34.4 | 35.0. W8A16 group 64,
this kernel | the row-interleaved int8 kernel: M = 4: 6.5 | 5.7; 8: 6.8 | 7.4; 16: 6.8 | 11.6; 32: 8.0 | 19.5; 64:
12.6 | 37.0 (per channel, against the AMX-INT8 kernel: M = 16: 6.2 | 5.4; 32: 7.7 | 7.7; 64: 12.0 | 12.8; 128:
18.8 | 24.8). So it takes M in (``WO_AMX_MIN_M``, ``WO_AMX_MAX_M``]; ``ASCENT_CPU_AMX=0`` (read at load) disables it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from ascent.quantization.kernels import STACK_KIND_WO_AMX, StackSpec

# Rows of x above which (and up to which) the AMX kernel serves a weight-only layer.
WO_AMX_MIN_M = 8
WO_AMX_MAX_M = 256


@dataclass
class WoAmx:
    """``tiles``: uint8 [N/16, K/32, 16, 16] nibbles (``amx_w4_pack``) or int8 [N/16, K/32, 16, 32] values
    (``amx_w8_pack``), ``coef`` fp32 [N/16, G, 2, 16], and their kernels."""

    ops: ModuleType
    tiles: torch.Tensor
    coef: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tiles.numel() + self.coef.numel() * self.coef.element_size()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x [..., K]`` goes to the tiles: bf16 on CPU with M in (``WO_AMX_MIN_M``, ``WO_AMX_MAX_M``]."""
        k = x.shape[-1]
        return (x.is_cpu and x.dtype == torch.bfloat16 and k > 0
                and WO_AMX_MIN_M * k < x.numel() <= WO_AMX_MAX_M * k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` bf16 ``@ W^T (+ bias)`` -> bf16 ``[..., N]``."""
        return self.ops.amx_wo_linear(x, self.tiles, self.coef, bias)

    def stack_spec(self, inner: StackSpec, inner_max_m: int, bias: torch.Tensor | None) -> StackSpec:
        """The decode-stack call (:data:`~ascent.quantization.kernels.STACK_KIND_WO_AMX`): ``inner`` (the layer's
        small-M kernel, which serves up to ``inner_max_m`` rows) up to ``WO_AMX_MIN_M`` rows, these tiles above;
        ``inner`` alone when it does not reach ``WO_AMX_MIN_M`` rows (the module path would run the dense weight
        between the two)."""
        if inner_max_m < WO_AMX_MIN_M:
            return inner
        kind, tensors, ints = inner
        bias_operand = bias if bias is not None else torch.empty(0, dtype=self.coef.dtype)
        return STACK_KIND_WO_AMX, [self.tiles, self.coef, bias_operand, *tensors], [WO_AMX_MIN_M, kind, *ints]


def prepare_wo_amx(q: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor | None,
                   dtype: torch.dtype | None) -> WoAmx | None:
    """The AMX operands of ``bits``-bit (4 or 8) values ``q`` int8 [N, K] with ``scale`` fp32 [N, G] and subtractive
    ``zero`` fp32 [N, G] or None; None unless the model is bf16 on a CPU with AMX-BF16 and the C++ kernels, N % 16 ==
    0, the groups are whole 32-column tile steps, int4 zero points are integers and ``ASCENT_CPU_AMX`` is not 0."""
    if dtype != torch.bfloat16 or q.device.type != "cpu" or os.environ.get("ASCENT_CPU_AMX", "1") == "0":
        return None
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: the AMX weight-only kernel takes 4- or 8-bit values")
    n, k = q.shape
    groups = scale.shape[-1]
    if n == 0 or n % 16 or groups < 1 or k % (32 * groups):
        return None
    if bits == 4 and zero is not None and not (bool(torch.equal(zero, zero.round()))
                                               and float(zero.abs().max()) < 65536 - 8):
        return None
    from ascent.layers.cpu_kernels import amx_ops

    ops = amx_ops()
    if ops is None:
        return None
    pack = ops.amx_w4_pack if bits == 4 else ops.amx_w8_pack
    tiles, coef = pack(q.contiguous(), scale.float().contiguous(),
                       zero.float().contiguous() if zero is not None else None)
    return WoAmx(ops, tiles, coef)
