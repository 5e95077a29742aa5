"""Per-layer KV-cache specs and their page sizes (engine_core spec §2.5). Only full attention for now."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """KV cache of one full-attention layer: K and V pages of ``block_size`` tokens each.

    ``page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_bytes`` (one block of one layer).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}.")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes one request of ``max_model_len`` tokens needs in this layer."""
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def num_blocks_for_memory(self, available_bytes: int, num_layers: int) -> int:
        """Blocks that fit in ``available_bytes`` when each block holds one page in each of ``num_layers`` layers."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        return max(available_bytes, 0) // (self.page_size_bytes * num_layers)
