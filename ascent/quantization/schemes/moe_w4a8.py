"""W4A8 dynamic routed experts (spec §2): int4 per-channel symmetric weights, dynamic per-token int8 activations;
the math is W8A8_DYNAMIC's over the int4 values (exact: int4 values are int8 values).

ModelSlim: ``w13_weight`` int8 [S, I, H] (two int4 per byte along the output dim: gate rows then up rows, row 2i
in the low nibble), ``w2_weight`` int8 [S, H/2, I]; ``w13_weight_scale`` [S, 2I, 1], ``w2_weight_scale`` [S, H, 1],
zero ``*_weight_offset``; optional ``w13_scale_bias`` [S, 2I, 1] / ``w2_scale_bias`` [S, H, 16/tp] (consistency
check only). compressed-tensors: one int4 per int8 (``w13_weight`` [S, 2I, H], ``w2_weight`` [S, H, I]),
per-channel scales (per-group W4A8 experts are rejected, as upstream).
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import WeightLoader
from ascent.quantization.packing import unpack_int4_pairs_int8
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import layer_name
from ascent.quantization.schemes.moe_common import Int8DynamicExperts, add_expert_param
from ascent.quantization.schemes.moe_w8a8_dynamic import create_channel_scales
from ascent.quantization.schemes.w4a8 import SCALE_BIAS_CHUNKS, check_scale_bias
from ascent.quantization.schemes.w4a16 import check_int4_range


@register_scheme("W4A8_DYNAMIC", "moe")
class W4A8DynamicMoE(Int8DynamicExperts):
    """int4 experts unpacked once to int8 storage at load (CPU has no int4 x int8 kernel)."""

    @property
    def modelslim(self) -> bool:
        return self.spec.source_format != "compressed-tensors"

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        if self.spec.weight_strategy == "group":
            raise ValueError(f"{layer_name(layer)}: per-group W4A8_DYNAMIC experts are not supported "
                             f"(group_size={self.spec.group_size}); re-export per-channel")
        s, h, i = num_local_experts, hidden_size, intermediate_size_per_partition
        pack = 2 if self.modelslim else 1
        if self.modelslim and (i % 2 or h % 2):
            raise ValueError(f"{layer_name(layer)}: int4 pairs need even sizes, got I={i}, H={h}")
        add_expert_param(layer, "w13_weight", (s, 2 * i // pack, h), torch.int8, weight_loader, "w13", 0)
        add_expert_param(layer, "w2_weight", (s, h // pack, i), torch.int8, weight_loader, "w2", 1)
        create_channel_scales(layer, s, 2 * i, h, weight_loader, self.modelslim)
        if self.modelslim:
            tp = int(getattr(layer, "moe_tp_size", 1))
            if tp > SCALE_BIAS_CHUNKS or SCALE_BIAS_CHUNKS % tp:
                raise ValueError(f"{layer_name(layer)}: ModelSlim W4A8 experts support TP sizes dividing 16, got {tp}")
            add_expert_param(layer, "w13_scale_bias", (s, 2 * i, 1), torch.float32, weight_loader, "w13", 0,
                             optional_default=0.0)
            add_expert_param(layer, "w2_scale_bias", (s, h, SCALE_BIAS_CHUNKS // tp), torch.float32,
                             weight_loader, "w2", 1, optional_default=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.check_offsets(layer, self.quant_type)
        q13, q2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        if self.modelslim:
            q13, q2 = unpack_int4_pairs_int8(q13, dim=1), unpack_int4_pairs_int8(q2, dim=1)
            for e in range(q13.shape[0]):
                check_scale_bias(layer, q13[e], layer.w13_weight_scale[e].detach(), layer.w13_scale_bias[e].detach())
                check_scale_bias(layer, q2[e], layer.w2_weight_scale[e].detach(), layer.w2_scale_bias[e].detach())
            layer.w13_weight.data, layer.w2_weight.data = q13, q2
        else:
            check_int4_range(layer, q13)
            check_int4_range(layer, q2)
        self.set_int8_experts(layer, q13, layer.w13_weight_scale.detach(), q2, layer.w2_weight_scale.detach())
