"""W8A8 dynamic routed experts (spec §2): per-expert int8 ``w13`` / ``w2`` with per-channel scales, dynamic
per-token int8 activations before each GEMM (the SwiGLU output is re-quantized).

Parameters (S local slots, I = intermediate per TP rank, H hidden): ``w13_weight`` int8 [S, 2I, H],
``w13_weight_scale`` [S, 2I, 1], ``w13_weight_offset`` [S, 2I, 1] (ModelSlim; must be zero), ``w2_weight`` int8
[S, H, I], ``w2_weight_scale`` [S, H, 1], ``w2_weight_offset`` [S, H, 1]. Checkpoint
``experts.E.gate_proj.weight_scale`` lands in ``w13_weight_scale[E, :I]``, ``up_proj`` in ``[E, I:]``.
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import WeightLoader
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.moe_common import Int8DynamicExperts, add_expert_param


def create_channel_scales(layer: nn.Module, s: int, n13: int, n2: int, weight_loader: WeightLoader,
                          with_offset: bool) -> None:
    """Per-channel ``w13_weight_scale [S, n13, 1]`` / ``w2_weight_scale [S, n2, 1]`` (+ optional zero offsets)."""
    specs = [("weight_scale", 1.0, None), ("weight_offset", 0.0, 0.0)][: 2 if with_offset else 1]
    for name, fill, optional in specs:
        add_expert_param(layer, f"w13_{name}", (s, n13, 1), torch.float32, weight_loader, "w13", 0, fill=fill,
                         optional_default=optional)
        add_expert_param(layer, f"w2_{name}", (s, n2, 1), torch.float32, weight_loader, "w2", None, fill=fill,
                         optional_default=optional)


@register_scheme("W8A8_DYNAMIC", "moe")
class W8A8DynamicMoE(Int8DynamicExperts):
    """int8 experts; ``weight_offset`` declared for ModelSlim checkpoints and verified all-zero."""

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        s, h, i = num_local_experts, hidden_size, intermediate_size_per_partition
        add_expert_param(layer, "w13_weight", (s, 2 * i, h), torch.int8, weight_loader, "w13", 0)
        add_expert_param(layer, "w2_weight", (s, h, i), torch.int8, weight_loader, "w2", 1)
        create_channel_scales(layer, s, 2 * i, h, weight_loader, self.spec.source_format != "compressed-tensors")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.check_offsets(layer, self.quant_type)
        self.set_int8_experts(layer, layer.w13_weight.detach(), layer.w13_weight_scale.detach(),
                              layer.w2_weight.detach(), layer.w2_weight_scale.detach())
