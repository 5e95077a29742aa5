"""FullAttentionSpec page-size formula (spec §2.5)."""

from __future__ import annotations

import pytest
import torch

from ascent.core.kv_cache.spec import FullAttentionSpec, cdiv


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_page_size_formula(dtype: torch.dtype, nbytes: int) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=dtype)
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * nbytes
    assert spec.max_memory_usage_bytes(33) == 3 * spec.page_size_bytes
    assert spec.num_blocks_for_memory(10 * spec.page_size_bytes * 4 + 1, num_layers=4) == 10


def test_validation_and_cdiv() -> None:
    assert [cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="head_size.*0"):
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_layers"):
        FullAttentionSpec(16, 1, 64, torch.float32).num_blocks_for_memory(1 << 20, 0)
