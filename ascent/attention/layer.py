"""The attention layer used by models: owns the layer's KV cache and dispatches to the selected backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascent.attention.backend import AttentionBackend
from ascent.forward_context import get_forward_context


def get_attn_backend(name: str | None = None) -> type[AttentionBackend]:
    """The attention backend class for ``name``; None -> the current hardware profile's attention backend family
    ("standard" -> ``SDPABackend``, "compat310p" -> ``A310PBackend``)."""
    if name is None:
        from ascent.platform.device_config import get_current_profile

        name = str(get_current_profile().attention_backend)
    key = name.lower()
    if key in ("sdpa", "standard"):
        from ascent.attention.backends.sdpa import SDPABackend

        return SDPABackend
    if key == "compat310p":
        from ascent.attention.backends.a310p import A310PBackend

        return A310PBackend
    raise ValueError(f"unknown attention backend {name!r} (available: 'sdpa'/'standard', 'compat310p')")


class Attention(nn.Module):
    """Paged multi-head attention (GQA when ``num_kv_heads < num_heads``).

    ``kv_cache`` starts empty; the model runner assigns the allocated tensor (backend layout, model dtype) before the
    first real forward. ``forward(q [T, num_heads*head_size], k/v [T, num_kv_heads*head_size])`` returns
    ``[T, num_heads*head_size]`` using the metadata of the current forward context: either the backend metadata or
    a dict ``layer_name -> metadata``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.layer_name = prefix
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = get_attn_backend(backend)
        self.impl = self.backend.get_impl_cls()(num_heads, head_size, scale, self.num_kv_heads, sliding_window)
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        metadata: Any = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.layer_name]
        return self.impl.forward(q, k, v, self.kv_cache, metadata)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"backend={self.backend.get_name()}")
