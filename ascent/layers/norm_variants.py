"""RMSNorm variants used by Gemma-style and Qwen3-Next / Qwen3.5 models (device_ops spec §5.4), torch ops only.

- :class:`GemmaRMSNorm`: ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` with the statistics and the scaling in fp32,
  cast to x's dtype at the end; ``w`` starts at zero. Residual form: ``s = x + residual`` (in x's dtype), returns
  ``(norm(s), s in residual's dtype)``.
- :class:`RMSNormGated`: ``norm_before_gate`` -> ``(RMSNorm(x) * w) * act(z)``, else ``RMSNorm(x * act(z)) * w``;
  ``act`` is silu (= swish) or sigmoid; with ``group_size`` the statistics are taken per contiguous group of
  ``group_size`` channels. Statistics in fp32; ``w`` is a plain weight (ones at init).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.linear import default_weight_loader, set_weight_attrs
from ascent.layers.norm import RMSNorm

GATE_ACTIVATIONS = ("silu", "swish", "sigmoid")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with ``(1 + weight)`` scaling (weight zero-initialised), computed in fp32 and cast back.

    ``forward(x [..., hidden])`` -> same shape and dtype; ``forward(x, residual)`` -> ``(norm(x + residual), x +
    residual)`` with the sum taken in x's dtype and returned in residual's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (self.hidden_size,), scale, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        s = x + residual.to(x.dtype)
        return self._norm(s), s.to(residual.dtype)


class RMSNormGated(nn.Module):
    """Gated RMSNorm (Qwen3-Next ``Qwen3NextRMSNormGated`` generalised).

    ``forward(x [..., hidden], z [..., hidden] | None)`` -> ``[..., hidden]`` in x's dtype. ``z=None`` is a plain
    (group-wise) RMSNorm. ``group_size`` must divide ``hidden_size``; ``activation`` in ``GATE_ACTIVATIONS``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = True, activation: str = "silu", dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
        if group_size is not None and (group_size < 1 or hidden_size % group_size):
            raise ValueError(f"group_size {group_size} must be >= 1 and divide hidden_size {hidden_size}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def _act(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(z) if self.activation == "sigmoid" else F.silu(z)

    def _normalize(self, x32: torch.Tensor) -> torch.Tensor:
        if self.group_size is None:
            return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        groups = x32.unflatten(-1, (-1, self.group_size))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.flatten(-2)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x has last dim {x.shape[-1]}, expected hidden_size {self.hidden_size}")
        if z is not None and z.shape != x.shape:
            raise ValueError(f"gate shape {tuple(z.shape)} != x shape {tuple(x.shape)}")
        dtype = x.dtype
        x32 = x.float()
        if z is not None and not self.norm_before_gate:
            x32 = x32 * self._act(z.float())
        out = self.weight * self._normalize(x32).to(dtype)
        if z is not None and self.norm_before_gate:
            out = out * self._act(z.float())
        return out.to(dtype)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}, activation={self.activation}")
