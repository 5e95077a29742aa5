"""Weight-only int4 (W4A16), spec §1.2 / §2.

compressed-tensors ``pack-quantized``: ``weight_packed`` int32 [N, K/8] (value + 8, 8 nibbles per word along K,
LSB first), ``weight_scale`` [N, K/g] (or [N, 1] channel), ``weight_shape`` int64 [2] (= [N, K], one row per
fused shard), asymmetric: ``weight_zero_point`` int32 packed along N [N/8, K/g]. ModelSlim legacy: ``weight`` int8
[N, K] holding one int4 per byte, ``weight_scale`` / ``weight_offset`` [N, K/g] like W8A16.
``W = (q - zp) * s``. Decode fast path: ``_weight_int4pack_mm_for_cpu`` (``w = (u - 8) * scale + zero`` with
u = q + 8, scale = s, zero = -zp * s); on CPU with the C++ kernels ``quant_gemv_cpu.cpp``'s ``w4a16_linear`` for
M <= ``WEIGHT_ONLY_GEMV_MAX_M[4]`` (reads ``weight_packed``'s bytes in place; ModelSlim int4-per-byte weights are
packed once); prefill: dequantize-once dense weight.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.kernels import int4pack_group_size, prepare_int4pack, weight_int4_linear
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import layer_name
from ascent.quantization.schemes.w8a16 import WeightOnlyLinear


def check_int4_range(layer: nn.Module, q: torch.Tensor) -> None:
    """One-int4-per-byte storage must hold values in [-8, 7]."""
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError(f"{layer_name(layer)}: int4 weight holds values outside [-8, 7] "
                         f"(min {int(q.min())}, max {int(q.max())})")


@register_scheme("W4A16", "linear")
class W4A16Linear(WeightOnlyLinear):
    """int4 weight-only; after loading ``wo_packed = (uint8 [N, K/2], fp32 [K/g', N, 2], g')`` when the int4pack
    kernel takes the shape (N % 16 == 0, g' in {32, 64, 128, 256}) and the small-M kernels have neither the
    row-interleaved nor the blocked layout (``wo_nv.py``), else None."""

    bits = 4

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.modelslim:
            check_int4_range(layer, layer.weight.detach())
        super().process_weights_after_loading(layer)
        if layer.wo_gemv is not None and (layer.wo_gemv.nv is not None or layer.wo_gemv.blocked):
            # the kernels take every M the int4pack path would (M <= 2); the int4pack copy had the size of the
            # new layout's, so memory is unchanged where it existed
            layer.wo_packed = None

    def prepare_packed(self, layer: nn.Module) -> None:
        layer.wo_packed = None
        q = self.int_weight(layer)
        n, k = q.shape
        kernel_group = int4pack_group_size(n, k, k // layer.wo_scale.shape[1])
        if kernel_group is None or q.device.type != "cpu":
            return
        packed, scale_zeros = prepare_int4pack(q, layer.wo_scale, layer.wo_zero, kernel_group)
        layer.wo_packed = (packed, scale_zeros, kernel_group)

    def gemv_weight(self, layer: nn.Module) -> torch.Tensor:
        """compressed-tensors: ``weight_packed``'s bytes (uint8 [N, K/2], no copy); ModelSlim: int8 values [N, K]."""
        if self.packed_checkpoint:
            return layer.weight_packed.detach().contiguous().view(torch.uint8)
        return layer.weight.detach()

    def packed_linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed, scale_zeros, kernel_group = layer.wo_packed
        return weight_int4_linear(x, packed, kernel_group, scale_zeros, bias)
