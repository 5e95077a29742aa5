"""W4A16 routed experts, compressed-tensors ``pack-quantized`` (spec §2; e.g. Kimi-K2 int4 g32).

Parameters: ``w13_weight_packed`` int32 [S, 2I, H/8], ``w13_weight_scale`` [S, 2I, H/g], ``w13_weight_shape`` int64
[S, 2, 2] (gate row, up row), ``w2_weight_packed`` int32 [S, H, I/8], ``w2_weight_scale`` [S, H, I/g],
``w2_weight_shape`` [S, 1, 2]. ``W = q * s`` (symmetric, q = nibble - 8). The group size comes from the spec's
``weights.group_size`` (never a top-level default: spec §11.2). Fast path: per-expert
``_weight_int4pack_mm_for_cpu`` when the shapes fit the kernel, else per-expert dequantized weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ascent.quantization.base import QuantMoEScheme, WeightLoader
from ascent.quantization.kernels import int4pack_group_size, prepare_int4pack, weight_int4_linear
from ascent.quantization.packing import unpack_from_int32
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import expand_groups, layer_name, use_reference
from ascent.quantization.schemes.moe_common import add_expert_param, expert_ranges, gated_act


@register_scheme("W4A16", "moe")
class W4A16MoE(QuantMoEScheme):
    """After loading: ``moe_i4`` (per-expert int4pack operands for w13 and w2, or None) and a lazily built
    per-dtype dequantized weight cache ``moe_dense``."""

    force_reference = False

    def _group(self, k: int, what: str) -> int:
        if self.spec.weight_strategy != "group":
            return k
        g = int(self.spec.group_size)
        if k % g:
            raise ValueError(f"W4A16 experts: {what} size {k} is not a multiple of group_size {g}")
        return g

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        if not self.spec.weight_symmetric:
            raise ValueError(f"{layer_name(layer)}: asymmetric W4A16 experts are not supported")
        s, h, i = num_local_experts, hidden_size, intermediate_size_per_partition
        if h % 8 or i % 8:
            raise ValueError(f"{layer_name(layer)}: pack-quantized experts need H, I multiples of 8 (H={h}, I={i})")
        g13, g2 = self._group(h, "hidden"), self._group(i, "intermediate")
        add_expert_param(layer, "w13_weight_packed", (s, 2 * i, h // 8), torch.int32, weight_loader, "w13", 0)
        add_expert_param(layer, "w13_weight_scale", (s, 2 * i, h // g13), torch.float32, weight_loader, "w13", 0,
                         fill=1.0)
        add_expert_param(layer, "w2_weight_packed", (s, h, i // 8), torch.int32, weight_loader, "w2", 1)
        add_expert_param(layer, "w2_weight_scale", (s, h, i // g2), torch.float32, weight_loader, "w2",
                         1 if self.spec.weight_strategy == "group" else None, fill=1.0)
        add_expert_param(layer, "w13_weight_shape", (s, 2, 2), torch.int64, weight_loader, "w13", None,
                         optional_default=0, per_shard_scalar=True)
        add_expert_param(layer, "w2_weight_shape", (s, 1, 2), torch.int64, weight_loader, "w2", None,
                         optional_default=0, per_shard_scalar=True)

    @staticmethod
    def int_weights(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Signed int4 values int8 ``(q13 [S, 2I, H], q2 [S, H, I])``."""
        p13, p2 = layer.w13_weight_packed.detach(), layer.w2_weight_packed.detach()
        return (unpack_from_int32(p13, 4, p13.shape[-1] * 8, dim=-1),
                unpack_from_int32(p2, 4, p2.shape[-1] * 8, dim=-1))

    def dequantized_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        q13, q2 = self.int_weights(layer)
        return (q13.float() * expand_groups(layer.w13_weight_scale.detach(), q13.shape[-1]),
                q2.float() * expand_groups(layer.w2_weight_scale.detach(), q2.shape[-1]))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.moe_dense = {}
        layer.moe_i4 = None
        if self._int4pack_groups(layer) is not None:
            layer.moe_i4 = [None] * layer.w13_weight_packed.shape[0]
            self._build_int4pack(layer, range(layer.w13_weight_packed.shape[0]))

    def _int4pack_groups(self, layer: nn.Module) -> tuple[int, int] | None:
        """Group sizes ``(g13, g2)`` of the int4pack kernel operands, or None when the shapes / device do not fit."""
        p13, p2 = layer.w13_weight_packed, layer.w2_weight_packed
        s13, s2 = layer.w13_weight_scale, layer.w2_weight_scale
        k13, k2 = p13.shape[2] * 8, p2.shape[2] * 8
        g13 = int4pack_group_size(p13.shape[1], k13, k13 // s13.shape[2])
        g2 = int4pack_group_size(p2.shape[1], k2, k2 // s2.shape[2])
        if g13 is None or g2 is None or p13.device.type != "cpu":
            return None
        return g13, g2

    def _build_int4pack(self, layer: nn.Module, slots: Iterable[int]) -> None:
        """(Re)build ``layer.moe_i4[e]`` for the given local slots from the packed weights and scales."""
        groups = self._int4pack_groups(layer)
        if groups is None or layer.moe_i4 is None:
            raise RuntimeError(f"{layer_name(layer)}: the int4pack kernel does not take these experts' shapes")
        g13, g2 = groups
        for e in slots:
            p13, p2 = layer.w13_weight_packed.detach()[e], layer.w2_weight_packed.detach()[e]
            q13 = unpack_from_int32(p13, 4, p13.shape[-1] * 8, dim=-1)
            q2 = unpack_from_int32(p2, 4, p2.shape[-1] * 8, dim=-1)
            layer.moe_i4[e] = (prepare_int4pack(q13, layer.w13_weight_scale.detach()[e], None, g13), g13,
                               prepare_int4pack(q2, layer.w2_weight_scale.detach()[e], None, g2), g2)

    def experts_moved(self, layer: nn.Module, slots: list[int]) -> None:
        """Drop the dequantized-weight cache and rebuild the int4pack operands of the refilled slots."""
        layer.moe_dense = {}
        if layer.moe_i4 is not None:
            self._build_int4pack(layer, slots)

    def _dense(self, layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in layer.moe_dense:
            w13, w2 = self.dequantized_weights(layer)
            layer.moe_dense[dtype] = (w13.to(dtype), w2.to(dtype))
        return layer.moe_dense[dtype]

    def apply_experts(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                      activation: str) -> torch.Tensor:
        if use_reference(self):
            return self.apply_experts_reference(layer, x, group_list, activation)
        out = x.new_zeros(x.shape[0], layer.w2_weight_packed.shape[1])
        dense = None if layer.moe_i4 is not None else self._dense(layer, x.dtype)
        for e, (s, t) in enumerate(expert_ranges(group_list, layer.w13_weight_packed.shape[0], x.shape[0])):
            if t <= s:
                continue
            if dense is None:
                (p13, sz13), g13, (p2, sz2), g2 = layer.moe_i4[e]
                a = gated_act(weight_int4_linear(x[s:t], p13, g13, sz13), activation)
                out[s:t] = weight_int4_linear(a, p2, g2, sz2)
            else:
                out[s:t] = gated_act(x[s:t] @ dense[0][e].t(), activation) @ dense[1][e].t()
        return out

    def apply_experts_reference(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                                activation: str) -> torch.Tensor:
        """float32 dequantize -> matmul per expert."""
        w13, w2 = self.dequantized_weights(layer)
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        for e, (s, t) in enumerate(expert_ranges(group_list, w13.shape[0], x.shape[0])):
            if t > s:
                out[s:t] = gated_act(x[s:t].float() @ w13[e].t(), activation) @ w2[e].t()
        return out.to(x.dtype)
