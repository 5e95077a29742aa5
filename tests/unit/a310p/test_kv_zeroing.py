"""KV block zeroing by direct writes: exactly the new blocks' kernel blocks become zero, nothing else changes."""

from __future__ import annotations

import pytest
import torch

from ascent.attention.backends.a310p import A310PBackend
from ascent.worker.kv_zeroing import kernel_block_indices, zero_new_blocks

NUM_KERNEL_BLOCKS = 12


def make_caches(num_layers: int, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = A310PBackend.get_kv_cache_shape(NUM_KERNEL_BLOCKS, 4, 2, 8)
    gen = torch.Generator().manual_seed(num_layers)
    return [torch.randn(shape, generator=gen).add_(5.0).to(dtype) for _ in range(num_layers)]


def expected_after(cache: torch.Tensor, kernel_blocks: set[int]) -> torch.Tensor:
    """Element-wise definition: an element is zero iff its block index (dim 1) is one of ``kernel_blocks``."""
    out = cache.clone()
    for b in range(cache.shape[1]):
        if b in kernel_blocks:
            out[:, b] = 0
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_zeroes_exactly_the_new_blocks(dtype: torch.dtype, k: int) -> None:
    caches = make_caches(3, dtype)
    before = [c.clone() for c in caches]
    block_ids = [3, 0, 3] if k < 3 else [1, 3]
    zero_new_blocks(caches, block_ids, kernel_blocks_per_block=k)
    targets = {b * k + j for b in block_ids for j in range(k)}
    for cache, old in zip(caches, before):
        assert torch.equal(cache, expected_after(old, targets))
        assert torch.count_nonzero(old) == old.numel()


def test_shared_caches_empty_ids_and_other_block_dims() -> None:
    base = make_caches(1, torch.float32)[0]
    before = base.clone()
    zero_new_blocks([base, base], [])
    assert torch.equal(base, before)
    zero_new_blocks([base, base.view(base.shape)], [5])
    assert torch.equal(base, expected_after(before, {5}))
    flat = torch.ones(6, 4, 3)
    zero_new_blocks([flat], [2, 4], block_dim=0)
    assert torch.equal(flat.sum(dim=(1, 2)), torch.tensor([12.0, 12, 0, 12, 0, 12]))
    assert kernel_block_indices([2, 0], 2, 8, torch.device("cpu")).tolist() == [0, 1, 4, 5]


def test_invalid_ids_are_rejected_before_any_write() -> None:
    caches = make_caches(2, torch.float32)
    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="block id 6"):
        zero_new_blocks(caches, [1, 6], kernel_blocks_per_block=2)
    with pytest.raises(ValueError, match="block id -1"):
        zero_new_blocks(caches, [-1])
    with pytest.raises(ValueError, match="kernel_blocks_per_block must be >= 1, got 0"):
        zero_new_blocks(caches, [1], kernel_blocks_per_block=0)
    with pytest.raises(ValueError, match="block_dim 5"):
        zero_new_blocks(caches, [1], block_dim=5)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
