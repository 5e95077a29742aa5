"""W4A8 dynamic (int4 weights, per-token dynamic int8 activations), spec §2.

ModelSlim: ``weight`` int8 [N/2, K] with two int4 per byte along N (row 2i low nibble), ``weight_scale`` /
``weight_offset`` [N, 1] (offset must be zero), optional ``scale_bias`` ([N, 1]; row-parallel layers [N, 16]
partial sums over 16 K-chunks) = ``8 * sum_k W4[n, k] * s_w[n]`` — used only as a consistency check.
compressed-tensors ``int-quantized``: ``weight`` int8 [N, K] one int4 per byte, ``weight_scale`` [N, 1] (channel)
or [N, K/g] (group).
Math: ``y = s_x[m] * sum_g s_w[n, g] * (xq @ W4^T)_g + b`` — one exact int32 product per scale group. With channel
scales this is W8A8 dynamic on int8 weights in [-8, 7], so it takes the W8A8-dynamic kernels (the small-M / AMX
kernels at decode sizes and the decode stack, ``_int_mm`` above).
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.layers.linear import RowParallelLinear
from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.kernels import StackSpec, int8_linear_grouped_weight
from ascent.quantization.packing import unpack_int4_pairs_int8
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import (
    add_param,
    check_zero_offset,
    expand_groups,
    group_size_of,
    layer_name,
    use_reference,
)
from ascent.quantization.schemes.w4a16 import check_int4_range
from ascent.quantization.schemes.w8a8_dynamic import (
    apply_int8_dynamic,
    attach_int8_dynamic,
    dynamic_reference,
    int8_dynamic_stack_call,
)

SCALE_BIAS_CHUNKS = 16


def scale_bias_columns(layer: nn.Module) -> int:
    """Columns of ModelSlim's ``scale_bias`` held by this rank: 16/tp partial sums for row-parallel layers."""
    if not isinstance(layer, RowParallelLinear):
        return 1
    tp = int(getattr(layer, "tp_size", 1))
    if tp > SCALE_BIAS_CHUNKS or SCALE_BIAS_CHUNKS % tp:
        raise ValueError(f"{layer_name(layer)}: ModelSlim W4A8 supports tensor parallel sizes dividing "
                         f"{SCALE_BIAS_CHUNKS}, got {tp}")
    return SCALE_BIAS_CHUNKS // tp


def check_scale_bias(layer: nn.Module, q: torch.Tensor, w_scale: torch.Tensor, stored: torch.Tensor) -> None:
    """``sum(stored)`` per row must equal ``+-8 * sum_k q * s_w`` (relative 1e-3 of the row's scale magnitude);
    ValueError naming the layer otherwise. An all-zero (absent) tensor is not checked."""
    if not bool((stored != 0).any()):
        return
    expected = 8.0 * q.double().sum(dim=1) * w_scale.double().reshape(-1)
    got = stored.double().sum(dim=1)
    tol = 1e-3 * (8.0 * q.shape[1] * w_scale.double().abs().reshape(-1)) + 1e-6
    if not (bool(((got - expected).abs() <= tol).all()) or bool(((got + expected).abs() <= tol).all())):
        worst = float((got.abs() - expected.abs()).abs().max())
        raise ValueError(f"{layer_name(layer)}: scale_bias does not match 8 * sum(W4) * weight_scale "
                         f"(max deviation {worst:.3g}); the checkpoint's int4 weight or scales are inconsistent")


@register_scheme("W4A8_DYNAMIC", "linear")
class W4A8DynamicLinear(QuantLinearScheme):
    """After loading: ``w4a8_q`` int8 [N, K] (values in [-8, 7]) and ``w4a8_ws`` fp32 [N, G]; with channel scales
    (G = 1) also the W8A8-dynamic operands of ``w8a8_dynamic.attach_int8_dynamic`` (sharing ``w4a8_q``)."""

    force_reference = False

    @property
    def modelslim(self) -> bool:
        return self.spec.source_format != "compressed-tensors"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        if not self.modelslim:
            groups = k // group_size_of(self.spec, k)
            add_param(layer, "weight", (n, k), torch.int8, weight_loader, output_dim=0, input_dim=1)
            dims = {"input_dim": 1} if groups > 1 or self.spec.weight_strategy == "group" else {}
            add_param(layer, "weight_scale", (n, groups), torch.float32, weight_loader, fill=1.0, output_dim=0,
                      **dims)
            return
        if self.spec.weight_strategy == "group":
            raise ValueError(f"{layer_name(layer)}: ModelSlim W4A8_DYNAMIC per-group weights are not supported "
                             f"(re-export per-channel)")
        if any(size % 2 for size in output_partition_sizes):
            raise ValueError(f"{layer_name(layer)}: int4 pairs along N need even shard sizes, got "
                             f"{output_partition_sizes}")
        add_param(layer, "weight", (n // 2, k), torch.int8, weight_loader, output_dim=0, input_dim=1,
                  packed_dim=0, packed_factor=2)
        add_param(layer, "weight_scale", (n, 1), torch.float32, weight_loader, fill=1.0, output_dim=0)
        add_param(layer, "weight_offset", (n, 1), torch.float32, weight_loader, output_dim=0, optional_default=0.0)
        cols = scale_bias_columns(layer)
        add_param(layer, "scale_bias", (n, cols), torch.float32, weight_loader, output_dim=0,
                  optional_default=0.0, **({"input_dim": 1} if cols > 1 else {}))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.modelslim:
            check_zero_offset(layer, "weight_offset", self.quant_type)
            q = unpack_int4_pairs_int8(layer.weight.detach(), dim=0)
            check_scale_bias(layer, q, layer.weight_scale.detach(), layer.scale_bias.detach())
        else:
            q = layer.weight.detach()
            check_int4_range(layer, q)
        layer.w4a8_q = q.contiguous()
        layer.w4a8_ws = layer.weight_scale.detach().float().contiguous()
        if layer.w4a8_ws.shape[1] == 1:
            attach_int8_dynamic(layer, layer.w4a8_q, layer.w4a8_ws)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        q, ws = layer.w4a8_q, layer.w4a8_ws
        if ws.shape[1] == 1:
            return apply_int8_dynamic(layer, x, bias)
        return int8_linear_grouped_weight(x, q, ws, q.shape[1] // ws.shape[1], bias)

    def decode_stack_call(self, layer: nn.Module) -> StackSpec | None:
        """Channel scales: the W8A8-dynamic small-M kernel's stack call; group scales have none (None)."""
        return int8_dynamic_stack_call(layer) if layer.w4a8_ws.shape[1] == 1 else None

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        q = layer.w4a8_q
        return q.float() * expand_groups(layer.w4a8_ws, q.shape[1])

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dynamic_reference(x, self.dequantized_weight(layer), bias)
