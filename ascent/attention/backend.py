"""Attention backend interface and the backend-independent per-step metadata.

The model runner builds one ``CommonAttentionMetadata`` per step; each backend's ``AttentionMetadataBuilder`` turns
it into the backend's own metadata once per step (shared by all layers), and every ``Attention`` layer calls
``AttentionImpl.forward`` with that metadata. Requests may appear in any order; decodes and prefills may be mixed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """Batch layout of one step (B = num_reqs, T = number of token rows incl. padding).

    query_start_loc: int32 ``[B+1]`` on the model device; the tokens of request i are rows ``qsl[i]:qsl[i+1]``.
    seq_lens: int32 ``[B]``, context length including this step's tokens (= num_computed + num_scheduled).
    num_computed_tokens: int32 ``[B]``, tokens already in the KV cache before this step.
    block_table: int32 ``[B, max_blocks_per_req]``; unused entries 0.
    slot_mapping: int64 ``[T]``; slot = block_id * block_size + offset; -1 marks padding rows (never written).
    ``*_np``: host (int32 numpy) copies so backends never synchronize on device tensors.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    num_computed_tokens_np: np.ndarray
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int


class AttentionMetadataBuilder(ABC):
    """Turns the common metadata into backend metadata, once per step."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend metadata for this step (read by every attention layer)."""


class AttentionImpl(ABC):
    """Per-layer attention computation over a paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:
        """q ``[T, num_heads*head_size]``, k/v ``[T, num_kv_heads*head_size]`` -> out ``[T, num_heads*head_size]``.

        Writes this step's k/v into ``kv_cache`` first (rows with slot -1 are skipped), then attends causally over
        each request's full context (cached prefix + new tokens).
        """


class AttentionBackend(ABC):
    """A family of attention kernels: KV-cache layout, metadata builder and implementation."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """Short backend name (e.g. ``"SDPA"``)."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""

    @staticmethod
    def kv_cache_block_dim() -> int:
        """Which dimension of ``get_kv_cache_shape`` indexes blocks (1 for ``[2, blocks, ...]`` K/V pairs)."""
        return 1

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        """The metadata builder class (constructed with no arguments)."""

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]:
        """The per-layer implementation class."""


def make_metadata_builder(backend: type[AttentionBackend], **options: Any) -> AttentionMetadataBuilder:
    """Instantiate ``backend``'s metadata builder, passing only the engine ``options`` its constructor accepts
    (e.g. ``max_model_len``, ``max_num_seqs``, ``chunked_prefill``), so backends declare what they need."""
    import inspect

    builder_cls = backend.get_builder_cls()
    params = inspect.signature(builder_cls.__init__).parameters
    return builder_cls(**{k: v for k, v in options.items() if k in params})
