"""W8A8FP8_DYNAMIC (compressed-tensors FP8_DYNAMIC), spec §2.

Checkpoint: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` fp32 [N, 1] (ModelSlim also ``weight_offset``, must
be zero). Activations: per-token ``s_x = max|x| / 448``, ``xf = e4m3(clamp(x / s_x, -448, 448))`` (explicit clamp:
torch's CPU cast saturates while ml_dtypes gives NaN). ``y = (xf @ Wf^T) * s_x[m] * s_w[n] + b``.
CPU has no fast FP8 GEMM: the fast path dequantizes the weight once (bf16/fp16 oneDNN-packed) and multiplies the
dequantized FP8 activations.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.kernels import DenseWeightCache, quantize_per_token_fp8
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import add_param, check_zero_offset, use_reference


def fp8_act_dequant(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 quant-dequant of ``x [M, K]``: float32 ``xf * s_x``."""
    xf, s = quantize_per_token_fp8(x)
    return xf.float() * s.unsqueeze(1)


@register_scheme("W8A8FP8_DYNAMIC", "linear")
class Fp8DynamicLinear(QuantLinearScheme):
    """After loading: ``fp8_dense`` (dequantize-once cache of ``Wf * s_w``)."""

    force_reference = False

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        add_param(layer, "weight", (n, k), torch.float8_e4m3fn, weight_loader, fill=None, output_dim=0,
                  input_dim=1)
        add_param(layer, "weight_scale", (n, 1), torch.float32, weight_loader, fill=1.0, output_dim=0)
        if self.spec.source_format != "compressed-tensors":
            add_param(layer, "weight_offset", (n, 1), torch.float32, weight_loader, output_dim=0,
                      optional_default=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_zero_offset(layer, "weight_offset", self.quant_type)
        layer.fp8_dense = DenseWeightCache(lambda: self.dequantized_weight(layer))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        x_deq = fp8_act_dequant(x.reshape(-1, x.shape[-1])).to(x.dtype)
        return layer.fp8_dense.linear(x_deq, bias).reshape(*x.shape[:-1], -1)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.detach().float() * layer.weight_scale.detach().float().reshape(-1, 1)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf, s = quantize_per_token_fp8(x.reshape(-1, x.shape[-1]))
        y = (xf.float() @ layer.weight.detach().float().t()) * s.unsqueeze(1)
        y = y * layer.weight_scale.detach().float().reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)
