"""W4A16 on AMX-BF16 tiles for mid-sized M (``cpu_kernels/amx_w4_linear.h``).

On a CPU with AMX the unquantized bf16 weight runs on tiles from a few rows of x on, while the int4 kernels
(``quant_wo_nv.h``) do one VPDPWSSD per 32 weights per row: a SmolLM2 decode step at batch 32 took about twice
bf16's. ``amx_w4_linear`` dequantizes each int4 tile to the dense bf16 weight's values (``(q - zero) * scale``
rounded to nearest even) right before the tile product, so its output is ``amx_linear``'s on the dequantized weight,
bit for bit. The packed copy (``amx_w4_pack``: nibbles in tile order plus per-group scales and offsets, ~0.56 byte
per weight at group 64) is kept beside the layer's other int4 layout and counted by
``cpu_packing.limit_dual_layouts``.

Measured on a Xeon with AMX (SmolLM2's 120 decode linears, group 64, 2 threads, interleaved medians, ms; this
kernel | the row-interleaved int4 kernel | the dequantize-once oneDNN-packed bf16 weight | amx_linear on that bf16
weight): M = 4: 6.3 | 4.5 | 12.1 | 7.9; 8: 6.4 | 6.4 | 12.0 | 8.2; 16: 6.9 | 10.6 | 12.1 | 8.3; 32: 8.1 | 18.7 |
14.3 | 8.7; 64: 13.0 | 35.1 | 17.4 | 12.6; 128: 19.2 | - | 22.8 | 20.2; 256: 33.5 | - | 34.4 | 35.0. So it takes M in
(``W4_AMX_MIN_M``, ``W4_AMX_MAX_M``]; ``ASCENT_CPU_AMX=0`` (read at load) disables it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from ascent.quantization.kernels import STACK_KIND_W4A16_AMX, StackSpec

# Rows of x above which (and up to which) the AMX kernel serves a W4A16 layer.
W4_AMX_MIN_M = 8
W4_AMX_MAX_M = 256


@dataclass
class W4Amx:
    """``nib`` uint8 [N/16, K/32, 16, 16] and ``coef`` fp32 [N/16, G, 2, 16] (``amx_w4_pack``) and their kernels."""

    ops: ModuleType
    nib: torch.Tensor
    coef: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.nib.numel() + self.coef.numel() * self.coef.element_size()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x [..., K]`` goes to the tiles: bf16 on CPU with M in (``W4_AMX_MIN_M``, ``W4_AMX_MAX_M``]."""
        k = x.shape[-1]
        return (x.is_cpu and x.dtype == torch.bfloat16 and k > 0
                and W4_AMX_MIN_M * k < x.numel() <= W4_AMX_MAX_M * k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K]`` bf16 ``@ W^T (+ bias)`` -> bf16 ``[..., N]``."""
        return self.ops.amx_w4_linear(x, self.nib, self.coef, bias)

    def stack_spec(self, inner: StackSpec, inner_max_m: int, bias: torch.Tensor | None) -> StackSpec:
        """The decode-stack call (:data:`~ascent.quantization.kernels.STACK_KIND_W4A16_AMX`): ``inner`` (the layer's
        small-M kernel, which serves up to ``inner_max_m`` rows) up to ``W4_AMX_MIN_M`` rows, these tiles above;
        ``inner`` alone when it does not reach ``W4_AMX_MIN_M`` rows (the module path would run the dense weight
        between the two)."""
        if inner_max_m < W4_AMX_MIN_M:
            return inner
        kind, tensors, ints = inner
        bias_operand = bias if bias is not None else torch.empty(0, dtype=self.coef.dtype)
        return STACK_KIND_W4A16_AMX, [self.nib, self.coef, bias_operand, *tensors], [W4_AMX_MIN_M, kind, *ints]


def prepare_w4_amx(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   dtype: torch.dtype | None) -> W4Amx | None:
    """The AMX operands of int4 values ``q`` int8 [N, K] with ``scale`` fp32 [N, G] and subtractive ``zero`` fp32
    [N, G] or None; None unless the model is bf16 on a CPU with AMX-BF16 and the C++ kernels, N % 16 == 0, the
    groups are whole 32-column tile steps, the zero points are integers and ``ASCENT_CPU_AMX`` is not 0."""
    if dtype != torch.bfloat16 or q.device.type != "cpu" or os.environ.get("ASCENT_CPU_AMX", "1") == "0":
        return None
    n, k = q.shape
    groups = scale.shape[-1]
    if n == 0 or n % 16 or groups < 1 or k % (32 * groups):
        return None
    if zero is not None and not (bool(torch.equal(zero, zero.round())) and float(zero.abs().max()) < 65536 - 8):
        return None
    from ascent.layers.cpu_kernels import amx_ops

    ops = amx_ops()
    if ops is None:
        return None
    nib, coef = ops.amx_w4_pack(q.contiguous(), scale.float().contiguous(),
                                zero.float().contiguous() if zero is not None else None)
    return W4Amx(ops, nib, coef)
