"""RMSNorm with an optional fused residual add and an optional additive bias.

The bias exists only when a quantization config asks for it (``enable_bias``): ModelSlim anti-outlier recipes
(SmoothQuant-style ``anti_method``) fold the smoothing into the norm and store ``<norm>.bias``; it is zero-initialised
and optional (checkpoints without it keep zeros) and is added after normalisation, also in the fused add+norm path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.cpu_kernels import fused_ops
from ascent.layers.linear import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight (+ bias)`` over the last dim (statistics in fp32, output in x's dtype).

    ``forward(x)`` returns ``y``; ``forward(x, residual)`` computes ``s = x + residual`` and returns ``(norm(s), s)``
    so decoder layers carry the residual stream without extra ops.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        self.register_parameter("bias", None)
        self._fused = fused_ops()  # C++ kernels of the CPU profile (None: torch ops)

    def enable_bias(self) -> None:
        """Add a zero ``bias [hidden_size]`` (weight dtype/device) that checkpoints may provide (``quant_optional``)."""
        if self.bias is not None:
            return
        bias = nn.Parameter(torch.zeros(self.hidden_size, dtype=self.weight.dtype, device=self.weight.device),
                            requires_grad=False)
        set_weight_attrs(bias, {"weight_loader": default_weight_loader, "quant_optional": True})
        self.bias = bias

    def _norm_bias(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return y if self.bias is None else y + self.bias

    def _can_fuse(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        # cheapest tests first: this runs twice per layer per step
        return (x.is_cpu and x.dtype is weight.dtype and x.dim() == 2 and x.stride(-1) == 1
                and self.bias is None
                and (residual is None or (residual.dtype is x.dtype and residual.stride(-1) == 1)))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused, weight = self._fused, self.weight
        if fused is not None and self._can_fuse(x, residual, weight):
            if residual is None:
                return fused.rms_norm(x, weight, self.eps)
            out, s = fused.add_rms_norm(x, residual, weight, self.eps)
            return out, s
        if residual is None:
            return self._norm_bias(x)
        s = x + residual
        return self._norm_bias(s), s

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"
