"""W8A8FP8_DYNAMIC (compressed-tensors FP8_DYNAMIC, HF fp8 dynamic) and W8A8FP8 (static FP8 activations), spec §2.

Checkpoint: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` fp32: [N, 1] per channel, or one value per fused
shard for the tensor strategy (``[1]`` per checkpoint module; expanded to the shard's rows after loading). ModelSlim
adds ``weight_offset`` (must be zero). Activations, dynamic: per token ``s_x = max|x| / 448``; static: the
checkpoint's ``input_scale`` (one per shard; fused shards share the largest, vLLM's rule). ``xf = e4m3(clamp(x / s_x,
-448, 448))`` (explicit clamp: torch's CPU cast saturates while ml_dtypes gives NaN); ``y = (xf @ Wf^T) * s_x *
s_w[n] + b``. CPU has no fast FP8 GEMM: the fast path dequantizes the weight once (bf16/fp16 oneDNN-packed) and
multiplies the dequantized FP8 activations.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.dense_weights import DenseWeightCache
from ascent.quantization.kernels import quantize_per_token_fp8
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import (
    add_param,
    check_zero_offset,
    max_shard_scalar,
    num_shards,
    shard_scalars,
    use_reference,
)

FP8_MAX = 448.0


def fp8_act_dequant(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 quant-dequant of ``x [M, K]``: float32 ``xf * s_x``."""
    xf, s = quantize_per_token_fp8(x)
    return xf.float() * s.unsqueeze(1)


def quantize_static_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Static per-tensor FP8 of ``x [M, K]``: ``e4m3(clamp(x / scale, -448, 448))``."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@register_scheme("W8A8FP8_DYNAMIC", "linear")
class Fp8DynamicLinear(QuantLinearScheme):
    """After loading: ``fp8_row_scale`` fp32 [N] (the weight scale of every output row) and ``fp8_dense`` (the
    dequantize-once cache of ``Wf * s_w``)."""

    force_reference = False

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        add_param(layer, "weight", (n, k), torch.float8_e4m3fn, weight_loader, fill=None, output_dim=0,
                  input_dim=1)
        if self.spec.weight_strategy == "tensor":
            add_param(layer, "weight_scale", (num_shards(output_partition_sizes), 1), torch.float32, weight_loader,
                      fill=1.0, per_shard_scalar=True)
            layer.fp8_shard_rows = list(output_partition_sizes) or [n]
        else:
            add_param(layer, "weight_scale", (n, 1), torch.float32, weight_loader, fill=1.0, output_dim=0)
        if self.spec.source_format not in ("compressed-tensors", "fp8"):
            add_param(layer, "weight_offset", (n, 1), torch.float32, weight_loader, output_dim=0,
                      optional_default=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_zero_offset(layer, "weight_offset", self.quant_type)
        scale = layer.weight_scale.detach().float()
        if self.spec.weight_strategy == "tensor":
            rows = torch.tensor(layer.fp8_shard_rows)
            layer.fp8_row_scale = shard_scalars(layer.weight_scale).repeat_interleave(rows).contiguous()
        else:
            layer.fp8_row_scale = scale.reshape(-1).contiguous()
        layer.fp8_dense = DenseWeightCache(lambda: self.dequantized_weight(layer))

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(xf float8 [M, K], s_x fp32 [M, 1])`` for ``x [M, K]``: per token."""
        xf, s = quantize_per_token_fp8(x)
        return xf, s.unsqueeze(1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        xf, s = self.quantize_input(layer, x.reshape(-1, x.shape[-1]))
        x_deq = (xf.float() * s).to(x.dtype)
        return layer.fp8_dense.linear(x_deq, bias).reshape(*x.shape[:-1], -1)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.detach().float() * layer.fp8_row_scale.reshape(-1, 1)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf, s = self.quantize_input(layer, x.reshape(-1, x.shape[-1]))
        y = (xf.float() @ layer.weight.detach().float().t()) * s
        y = y * layer.fp8_row_scale.reshape(1, -1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


@register_scheme("W8A8FP8", "linear")
class Fp8StaticLinear(Fp8DynamicLinear):
    """FP8 weights with static per-tensor FP8 activations (compressed-tensors "FP8", HF fp8 ``activation_scheme:
    static``): ``input_scale`` per shard; after loading ``fp8_input_scale`` (python float, the shards' largest)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, weight_loader)
        add_param(layer, "input_scale", (num_shards(output_partition_sizes), 1), torch.float32, weight_loader,
                  fill=1.0, per_shard_scalar=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.fp8_input_scale = max_shard_scalar(layer, layer.input_scale, "input_scale")

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_static_fp8(x, layer.fp8_input_scale), torch.tensor(layer.fp8_input_scale)
