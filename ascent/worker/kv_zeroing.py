"""Zeroing of newly allocated KV blocks by direct tensor writes (the 310P path: no fused/Triton kernel).

Some paths read whole kernel blocks before every slot was written (e.g. hybrid models with multi-token speculation
on 310P), so the runner zeroes the blocks the KV manager handed out since the previous step
(``KVCacheManager.take_new_block_ids()``) before the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kernel_block_indices(block_ids: Sequence[int], kernel_blocks_per_block: int, num_kernel_blocks: int,
                         device: torch.device) -> torch.Tensor:
    """int64 kernel-block indices ``b*k .. b*k+k-1`` of manager blocks ``block_ids`` (deduplicated, sorted).

    Raises ValueError for ``k < 1`` or an id whose kernel blocks fall outside ``[0, num_kernel_blocks)``.
    """
    k = kernel_blocks_per_block
    if k < 1:
        raise ValueError(f"kernel_blocks_per_block must be >= 1, got {k}")
    ids = sorted(set(int(b) for b in block_ids))
    if ids and (ids[0] < 0 or (ids[-1] + 1) * k > num_kernel_blocks):
        bad = ids[0] if ids[0] < 0 else ids[-1]
        raise ValueError(f"block id {bad} is out of range for a cache of {num_kernel_blocks} kernel blocks "
                         f"({k} per block)")
    base = torch.tensor(ids, dtype=torch.int64, device=device)
    return (base.unsqueeze(1) * k + torch.arange(k, dtype=torch.int64, device=device)).reshape(-1)


def zero_new_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], kernel_blocks_per_block: int = 1,
                    block_dim: int = 1) -> None:
    """Zero manager blocks ``block_ids`` in every KV cache tensor, in place.

    ``kv_caches``: per-layer tensors whose dim ``block_dim`` indexes kernel blocks (the attention backends' layout
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` -> ``block_dim=1``); tensors sharing storage (KV-sharing
    layers) are zeroed once. A manager block ``b`` covers kernel blocks ``b*k .. b*k+k-1`` with
    ``k = kernel_blocks_per_block``. Empty ``block_ids`` is a no-op; all ids are validated before any write.
    """
    if not block_ids or not kv_caches:
        return
    plans: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[tuple[int, int]] = set()
    for cache in kv_caches:
        if not 0 <= block_dim < cache.dim():
            raise ValueError(f"block_dim {block_dim} is out of range for a cache of shape {tuple(cache.shape)}")
        key = (cache.data_ptr(), cache.stride(block_dim))
        if key in seen:
            continue
        seen.add(key)
        idx = kernel_block_indices(block_ids, kernel_blocks_per_block, cache.shape[block_dim], cache.device)
        plans.append((cache, idx))
    for cache, idx in plans:
        cache.index_fill_(block_dim, idx, 0)
