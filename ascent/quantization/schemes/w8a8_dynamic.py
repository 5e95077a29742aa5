"""W8A8 dynamic (per-token symmetric int8 activations, per-channel symmetric int8 weights), spec §2.

Checkpoint: ``weight`` int8 [N, K], ``weight_scale`` [N, 1] (+ ModelSlim ``weight_offset`` [N, 1], which must be
all zero — verified at load, spec §11.10). Forward: ``s_x[m] = max_k |x[m, k]| / 127``,
``xq = clamp(rint(x / s_x), -128, 127)``, ``y = (xq @ Wq^T) * s_x[m] * s_w[n] + b``. CPU with AMX-INT8 (any M,
2-4x faster than ``_int_mm`` also at prefill sizes, see ``kernels.py``): the fused quantize + AMX tile kernel on a
repacked copy of the weight; else decode (M <=
``Int8Gemv.max_m``): the fused quantize + VNNI kernel (on a row-interleaved copy where the CPU has AVX512-VNNI,
``quantization/wo_nv.py``); all bit-identical to ``int8_linear_dynamic``.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.kernels import (
    StackSpec, amx_takes, gemv_fits, int8_dynamic_stack_spec, int8_gemv_dynamic,
    int8_linear_dynamic, prepare_int8_amx, prepare_int8_gemv, quantize_per_token_int8,
)
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import add_param, check_zero_offset, use_reference
from ascent.quantization.schemes.w8a8_static import create_int8_weight


def dynamic_reference(x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``((xq * s_x) @ w_deq^T + b)`` in float32 with per-token int8 ``xq, s_x`` of ``x [..., K]``; ``w_deq``
    float32 [N, K] -> x's dtype."""
    xq, s = quantize_per_token_int8(x.reshape(-1, x.shape[-1]))
    y = (xq.float() * s.unsqueeze(1)) @ w_deq.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def attach_int8_dynamic(layer: nn.Module, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Set a layer's W8A8-dynamic operands from int8 ``weight [N, K]`` and per-channel ``weight_scale`` ([N] or
    [N, 1]): ``w8a8_w_t`` (int8 [K, N] column-major view), ``w8a8_ws`` fp32 [N], ``w8a8_gemv`` (small-M kernel
    operands, ``kernels.Int8Gemv``, or None) and ``w8a8_amx`` (``kernels.Int8Amx`` or None). Any int8 weight with
    per-channel scales and per-token activation quantization takes them (W8A8 dynamic, per-channel W4A8)."""
    layer.w8a8_w_t = weight.t()
    layer.w8a8_ws = weight_scale.float().reshape(-1).contiguous()
    layer.w8a8_amx = prepare_int8_amx(weight)
    layer.w8a8_gemv = prepare_int8_gemv(weight, nv=layer.w8a8_amx is None)


def apply_int8_dynamic(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y = (xq @ Wq^T) * s_x[m] * s_w[n] + b`` on the operands of :func:`attach_int8_dynamic`: the AMX-INT8 kernel
    at any M, else the small-M kernel at decode-sized M, else ``int8_linear_dynamic`` (all bit-identical)."""
    amx = getattr(layer, "w8a8_amx", None)
    if amx is not None and amx_takes(x):
        return amx.linear(x, layer.w8a8_ws, bias)
    gemv = getattr(layer, "w8a8_gemv", None)
    if gemv is not None and gemv_fits(x, gemv.max_m):
        return int8_gemv_dynamic(gemv, x, layer.w8a8_ws, bias)
    return int8_linear_dynamic(x, layer.w8a8_w_t, layer.w8a8_ws, bias)


def int8_dynamic_stack_call(layer: nn.Module) -> StackSpec | None:
    """The C++ decode stack's call of the small-M kernel of :func:`apply_int8_dynamic`, None without one."""
    bias = getattr(layer, "bias", None)
    amx = getattr(layer, "w8a8_amx", None)
    if amx is not None:
        return amx.stack_spec(layer.w8a8_ws, bias)
    gemv = getattr(layer, "w8a8_gemv", None)
    return int8_dynamic_stack_spec(gemv, layer.w8a8_ws, bias) if gemv is not None else None


@register_scheme("W8A8_DYNAMIC", "linear")
class W8A8DynamicLinear(QuantLinearScheme):
    """After loading: ``w8a8_w_t`` (int8 [K, N] column-major view), ``w8a8_ws`` fp32 [N], ``w8a8_gemv`` (small-M
    kernel operands, ``kernels.Int8Gemv``, or None) and ``w8a8_amx`` (``kernels.Int8Amx`` or None)."""

    force_reference = False

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n = sum(output_partition_sizes)
        create_int8_weight(layer, n, input_size_per_partition, weight_loader)
        if self.spec.source_format != "compressed-tensors":
            add_param(layer, "weight_offset", (n, 1), torch.float32, weight_loader, output_dim=0,
                      optional_default=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_zero_offset(layer, "weight_offset", self.quant_type)
        attach_int8_dynamic(layer, layer.weight.detach(), layer.weight_scale.detach())

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        return apply_int8_dynamic(layer, x, bias)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits: ``x`` widened exactly to float32 quantizes to the same int8 rows and scales, so the
        kernels' int32 sums and fp32 epilogue are :meth:`apply`'s, stored without the 16-bit rounding."""
        if use_reference(self):
            return self.apply_reference(layer, x.float(), bias)
        return apply_int8_dynamic(layer, x.float(), bias)

    def decode_stack_call(self, layer: nn.Module) -> StackSpec | None:
        """How a C++ decode stack calls this linear's small-M kernel (``kernels.STACK_KIND_*``), None without it."""
        return int8_dynamic_stack_call(layer)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.detach().float() * layer.weight_scale.detach().float().reshape(-1, 1)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dynamic_reference(x, self.dequantized_weight(layer), bias)
