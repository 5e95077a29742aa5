"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.cpu_kernels import fused_ops


class SiluAndMul(nn.Module):
    """``x [..., 2d]`` -> ``silu(x[..., :d]) * x[..., d:]`` of shape ``[..., d]`` (one C++ kernel on CPU when the
    profile's fused kernels are available)."""

    def __init__(self) -> None:
        super().__init__()
        self._fused = fused_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and x.dim() == 2 and x.device.type == "cpu" and x.stride(-1) == 1:
            return self._fused.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act``; raises ValueError for unsupported names."""
    if hidden_act in ("silu", "swish"):
        from ascent.platform.device_config import get_current_profile
        from ascent.platform.profile import HardwareCapability

        if get_current_profile().supports(HardwareCapability.COMPATIBILITY_OP_IMPLEMENTATIONS):
            from ascent.layers.activation_compat import SiluAndMulComposed

            return SiluAndMulComposed()
        return SiluAndMul()
    raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: 'silu')")
