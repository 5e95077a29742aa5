"""SiluAndMul by composition of elementwise ops (the 310P path: no fused swiglu kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMulComposed(nn.Module):
    """``x [..., 2d]`` -> ``silu(x[..., :d]) * x[..., d:]`` of shape ``[..., d]``, in x's dtype.

    Computed as separate ops (split, silu, multiply into the silu result); numerically identical to
    :class:`ascent.layers.activation.SiluAndMul`. Raises ValueError for an odd last dimension.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        if width % 2:
            raise ValueError(f"SiluAndMul needs an even last dimension, got {width}")
        gate, up = x.split(width // 2, dim=-1)
        return F.silu(gate).mul_(up)
