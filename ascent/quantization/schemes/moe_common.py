"""Shared pieces of the quantized MoE schemes.

Parameter attributes read by ``FusedMoE.weight_loader`` (per-expert checkpoint tensors, shard ids "w1" gate, "w3"
up, "w2" down): ``moe_role`` ("w13" | "w2") says which projection a parameter belongs to; ``moe_shard_dim`` is the
per-expert dim that holds the (TP-sharded) intermediate size (w13: dim 0 — gate rows then up rows; w2: dim 1, or
None for per-output-channel tensors that are not sharded); ``moe_per_shard_scalar`` parameters hold one row per
shard (w13: [S, 2, *elem] gate row 0 / up row 1; w2: [S, 1, *elem]).

The int8-domain experts (W8A8_DYNAMIC, W4A8_DYNAMIC) share :class:`Int8DynamicExperts`: per expert e,
``h = (xq @ W13q_e^T) * s_x * s13_e``, ``a = act(h)`` re-quantized per token, ``y = (aq @ W2q_e^T) * s_a * s2_e``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascent.quantization.base import QuantMoEScheme, WeightLoader
from ascent.quantization.kernels import int8_mm, quantize_per_token_int8
from ascent.quantization.schemes.common import add_param, check_zero_offset, use_reference


def add_expert_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     weight_loader: WeightLoader, role: str, shard_dim: int | None, fill: float | None = 0.0,
                     optional_default: float | None = None, per_shard_scalar: bool = False) -> nn.Parameter:
    """Register an expert parameter ``[S, ...]`` with the FusedMoE loader attributes (module docstring)."""
    return add_param(layer, name, shape, dtype, weight_loader, fill=fill, optional_default=optional_default,
                     moe_role=role, moe_shard_dim=shard_dim, moe_per_shard_scalar=per_shard_scalar)


def expert_ranges(group_list: torch.Tensor, num_experts: int, num_rows: int) -> list[tuple[int, int]]:
    """Row range of each local expert from per-expert counts ``group_list [S]``."""
    counts = [int(c) for c in group_list.reshape(-1).tolist()]
    if len(counts) != num_experts or sum(counts) > num_rows or min(counts, default=0) < 0:
        raise ValueError(f"group_list {counts} does not describe {num_experts} experts over {num_rows} rows")
    ends = torch.tensor(counts).cumsum(0).tolist()
    return [(e - c, e) for c, e in zip(counts, ends)]


def gated_act(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` with gate = first half, up = second half of the last dim (silu, gelu, gelu_tanh)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up
    raise ValueError(f"activation={activation!r} must be silu, gelu or gelu_tanh")


class Int8DynamicExperts(QuantMoEScheme):
    """Experts with int8-domain weights and dynamic per-token int8 activations. Subclasses fill, in
    ``process_weights_after_loading``, ``moe_q13`` int8 [S, 2I, H], ``moe_q2`` int8 [S, H, I], ``moe_s13`` fp32
    [S, 2I] and ``moe_s2`` fp32 [S, H] via :meth:`set_int8_experts`."""

    force_reference = False

    def set_int8_experts(self, layer: nn.Module, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor,
                         s2: torch.Tensor) -> None:
        layer.moe_q13, layer.moe_q2 = q13.contiguous(), q2.contiguous()
        layer.moe_s13 = s13.float().reshape(q13.shape[0], -1).contiguous()
        layer.moe_s2 = s2.float().reshape(q2.shape[0], -1).contiguous()

    def experts_moved(self, layer: nn.Module, slots: list[int]) -> None:
        """Rebuild the ``moe_*`` operands from the (moved) parameters: after ``process_weights_after_loading`` the
        ``w13_weight`` / ``w2_weight`` parameters hold the int8-domain values (ModelSlim int4 pairs unpacked)."""
        self.set_int8_experts(layer, layer.w13_weight.detach(), layer.w13_weight_scale.detach(),
                              layer.w2_weight.detach(), layer.w2_weight_scale.detach())

    def dequantized_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return (layer.moe_q13.float() * layer.moe_s13.unsqueeze(-1),
                layer.moe_q2.float() * layer.moe_s2.unsqueeze(-1))

    def apply_experts(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                      activation: str) -> torch.Tensor:
        if use_reference(self):
            return self.apply_experts_reference(layer, x, group_list, activation)
        xq, sx = quantize_per_token_int8(x)
        out = torch.zeros(x.shape[0], layer.moe_q2.shape[1], dtype=torch.float32, device=x.device)
        for e, (s, t) in enumerate(expert_ranges(group_list, layer.moe_q13.shape[0], x.shape[0])):
            if t <= s:
                continue
            h = int8_mm(xq[s:t], layer.moe_q13[e].t()).float().mul_(sx[s:t].unsqueeze(1)).mul_(layer.moe_s13[e])
            aq, sa = quantize_per_token_int8(gated_act(h, activation))
            out[s:t] = int8_mm(aq, layer.moe_q2[e].t()).float().mul_(sa.unsqueeze(1)).mul_(layer.moe_s2[e])
        return out.to(x.dtype)

    def apply_experts_reference(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                                activation: str) -> torch.Tensor:
        """The formula in float64 with exact integer products (module docstring)."""
        xq, sx = quantize_per_token_int8(x)
        out = torch.zeros(x.shape[0], layer.moe_q2.shape[1], dtype=torch.float64, device=x.device)
        for e, (s, t) in enumerate(expert_ranges(group_list, layer.moe_q13.shape[0], x.shape[0])):
            if t <= s:
                continue
            h = (xq[s:t].double() @ layer.moe_q13[e].double().t()) * sx[s:t].double().unsqueeze(1)
            h = (h * layer.moe_s13[e].double()).float()
            aq, sa = quantize_per_token_int8(gated_act(h, activation))
            y = (aq.double() @ layer.moe_q2[e].double().t()) * sa.double().unsqueeze(1)
            out[s:t] = y * layer.moe_s2[e].double()
        return out.to(x.dtype)

    @staticmethod
    def check_offsets(layer: nn.Module, quant_type: str) -> None:
        for name in ("w13_weight_offset", "w2_weight_offset"):
            check_zero_offset(layer, name, quant_type)
