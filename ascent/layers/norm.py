"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.linear import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (statistics in fp32, output in x's dtype).

    ``forward(x)`` returns ``y``; ``forward(x, residual)`` computes ``s = x + residual`` and returns ``(norm(s), s)``
    so decoder layers carry the residual stream without extra ops.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        s = x + residual
        return F.rms_norm(s, (self.hidden_size,), self.weight, self.eps), s

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
