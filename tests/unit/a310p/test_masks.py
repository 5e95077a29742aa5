"""Compatibility attention masks vs their mathematical definitions, built element by element with explicit loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.attention.mask import (
    COMPRESSED_MASK_SIZE,
    AttentionMaskBuilder,
    additive_fill_value,
    causal_additive_mask,
    compressed_fill_value,
    from_fractal_nz,
    splitfuse_positions,
    to_fractal_nz,
)

NEG_INF = float("-inf")


def loop_mask(q_len: int, seq_len: int, fill: float, window: int | None = None) -> torch.Tensor:
    """float64 ``[q_len, seq_len]``: query r at position seq_len - q_len + r sees key j iff j <= pos (and in window)."""
    out = torch.empty(q_len, seq_len, dtype=torch.float64)
    for r in range(q_len):
        pos = seq_len - q_len + r
        for j in range(seq_len):
            visible = j <= pos and (window is None or j > pos - window)
            out[r, j] = 0.0 if visible else fill
    return out


def same(mask: torch.Tensor, expected: torch.Tensor) -> bool:
    return mask.shape == expected.shape and torch.equal(mask.double(), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_causal_additive_mask_definition(dtype: torch.dtype, window: int | None) -> None:
    for length in (0, 1, 2, 7, 16):
        mask = causal_additive_mask(length, dtype, window=window)
        assert mask.dtype == dtype
        assert same(mask, loop_mask(length, length, NEG_INF, window))


def test_per_request_causal_masks_are_sized_to_the_request_and_cached() -> None:
    mb = AttentionMaskBuilder(max_model_len=4096)
    for seq_len, q_len in [(5, 5), (9, 3), (9, 1), (130, 4), (12, 0)]:
        mask = mb.causal_mask(seq_len, q_len, torch.float16)
        assert same(mask, loop_mask(q_len, seq_len, NEG_INF))
    assert mb.cached_square_len(torch.float16) == 256
    first = mb.causal_mask(20, None, torch.float16)
    again = mb.causal_mask(20, None, torch.float16)
    assert first.data_ptr() == again.data_ptr()
    assert mb.cached_square_len(torch.float32) == 0
    windowed = mb.causal_mask(11, 4, torch.float32, window=5)
    assert same(windowed, loop_mask(4, 11, NEG_INF, 5))


def test_square_never_exceeds_max_model_len_and_lengths_are_validated() -> None:
    mb = AttentionMaskBuilder(max_model_len=200)
    mask = mb.causal_mask(150, 2, torch.float32)
    assert same(mask, loop_mask(2, 150, NEG_INF))
    assert mb.cached_square_len(torch.float32) == 200
    with pytest.raises(ValueError, match="seq_len 201"):
        mb.causal_mask(201)
    with pytest.raises(ValueError, match="q_len 6"):
        mb.causal_mask(5, 6)
    with pytest.raises(ValueError, match="int64"):
        mb.causal_mask(5, None, torch.int64)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        mb.causal_mask(5, window=0)
    with pytest.raises(ValueError, match="max_model_len must be >= 1, got 0"):
        AttentionMaskBuilder(0)


def test_non_causal_mask_is_all_visible() -> None:
    mask = AttentionMaskBuilder().non_causal_mask(6, 2, torch.float16)
    assert mask.shape == (2, 6) and mask.dtype == torch.float16 and torch.count_nonzero(mask) == 0


@pytest.mark.parametrize("window", [None, 4])
def test_splitfuse_mask_rows_are_causal_rows_at_absolute_positions(window: int | None) -> None:
    query_lens = np.array([3, 1, 0, 5, 2])
    seq_lens = np.array([10, 7, 4, 5, 12])
    mask = AttentionMaskBuilder().splitfuse_mask(query_lens, seq_lens, torch.float16, window=window)
    width = int(seq_lens.max())
    expected = torch.empty(int(query_lens.sum()), width, dtype=torch.float64)
    row = 0
    for ql, cl in zip(query_lens, seq_lens):
        for p in range(cl - ql, cl):
            for j in range(width):
                visible = j <= p and (window is None or j > p - window)
                expected[row, j] = 0.0 if visible else NEG_INF
            row += 1
    assert same(mask, expected)
    assert splitfuse_positions(query_lens, seq_lens).tolist() == [7, 8, 9, 6, 0, 1, 2, 3, 4, 10, 11]
    with pytest.raises(ValueError, match="query_lens"):
        splitfuse_positions(np.array([4]), np.array([3]))


def test_compressed_tile_definition() -> None:
    mb = AttentionMaskBuilder()
    tile = mb.compressed_mask(torch.float16)
    assert tile.shape == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE) and tile.dtype == torch.float16
    rows = torch.arange(COMPRESSED_MASK_SIZE).unsqueeze(1)
    cols = torch.arange(COMPRESSED_MASK_SIZE).unsqueeze(0)
    assert torch.all(tile[cols <= rows] == 0) and torch.all(tile[cols > rows] == -10000.0)
    for i, j in [(0, 1), (5, 5), (2047, 0), (100, 2047)]:
        assert float(tile[i, j]) == (0.0 if j <= i else -10000.0)
    assert mb.compressed_mask(torch.float16) is tile
    assert compressed_fill_value(torch.float32) == -10000.0 and additive_fill_value(torch.bfloat16) == NEG_INF


@pytest.mark.parametrize("q_len,seq_len", [(1, 9), (6, 6), (5, 40), (2100, 2110), (4200, 4200)])
def test_compressed_expansion_has_the_splitfuse_semantics(q_len: int, seq_len: int) -> None:
    mb = AttentionMaskBuilder()
    got = mb.expand_compressed(q_len, seq_len, torch.float32)
    if q_len <= 64:
        assert same(got, loop_mask(q_len, seq_len, -10000.0))
    else:
        pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        keys = torch.arange(seq_len).unsqueeze(0)
        expected = torch.where(keys <= pos, 0.0, -10000.0).double()
        assert same(got, expected)
        for r, j in [(0, seq_len - q_len), (2047, seq_len - q_len + 2048), (2048, seq_len - q_len + 2048),
                     (q_len - 1, seq_len - 1), (2049, 3)]:
            assert float(got[r, j]) == (0.0 if j <= seq_len - q_len + r else -10000.0)


def test_key_padding_mask_definition() -> None:
    lens = torch.tensor([3, 1, 6])
    for window in (None, 2):
        mask = AttentionMaskBuilder().key_padding_mask(lens, 6, torch.float16, window)
        for b, length in enumerate(lens.tolist()):
            for j in range(6):
                last = length - 1
                visible = j <= last and (window is None or j > last - window)
                assert float(mask[b, j]) == (0.0 if visible else NEG_INF)


def test_fractal_nz_shape_corner_and_round_trip() -> None:
    length = 48
    mask = causal_additive_mask(length, torch.float16)
    nz = to_fractal_nz(mask)
    assert nz.shape == (1, length // 16, length, 16)
    assert float(nz[0][-1][0][-1]) == NEG_INF
    assert torch.equal(from_fractal_nz(nz, length, length), mask)
    odd = torch.randn(5, 21)
    nz_odd = to_fractal_nz(odd)
    assert nz_odd.shape == (1, 2, 16, 16)
    assert torch.equal(from_fractal_nz(nz_odd, 5, 21), odd)
    with pytest.raises(ValueError, match="2-D"):
        to_fractal_nz(torch.zeros(2, 2, 2))
