"""Test-only schemes (registered into fresh ``SchemeRegistry`` instances, never the global ones) and small
builders shared by the quantization config tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, QuantSpec, WeightLoader, mark_optional


class FakeInt8Linear(QuantLinearScheme):
    """int8 weight ``[N, K]`` + per-channel fp32 scale ``[N, 1]`` + a per-shard scalar ``input_scale``; math is
    ``y = x @ (q * s)^T`` (written here independently of any engine scheme)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        weight = nn.Parameter(torch.zeros(n, k, dtype=torch.int8), requires_grad=False)
        weight.output_dim, weight.input_dim, weight.weight_loader = 0, 1, weight_loader
        scale = nn.Parameter(torch.ones(n, 1), requires_grad=False)
        scale.output_dim, scale.weight_loader = 0, weight_loader
        input_scale = nn.Parameter(torch.zeros(len(output_partition_sizes), 1), requires_grad=False)
        input_scale.per_shard_scalar, input_scale.weight_loader = True, weight_loader
        mark_optional(input_scale, 1.0)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("input_scale", input_scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.processed = True

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale.float()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.apply_reference(layer, x, bias)


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def spec(quant_type: str, layer_type: str = "linear") -> QuantSpec:
    return QuantSpec(quant_type=quant_type, layer_type=layer_type)
