"""SlidingWindowAdapter: block-aligned window formula, both ends of the rounding, block-table crop vs a loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.spec_decode.sliding_window import SlidingWindowAdapter


def _reference_row(seq_len: int, row: list[int], w: int, bk: int, f: int) -> tuple[int, list[int]]:
    """Visible positions = the blocks holding [seq_len + F - W, seq_len) rounded down to a block start."""
    first_visible = max(seq_len + f - w, 0)
    start = (first_visible // bk) * bk
    blocks = [row[b] for b in range(start // bk, (seq_len + bk - 1) // bk) if b < len(row)]
    width = (w + bk - 1) // bk + 1
    return seq_len - start, (blocks + [0] * width)[:width]


def test_rounding_ends():
    a = SlidingWindowAdapter(window_size=8, block_size=4, future_offset=0)
    # seq_len + F - W exactly on a block start: exactly W tokens stay visible
    assert a.window_start(np.array([16])).tolist() == [8] and a.windowed_seq_lens(np.array([16])).tolist() == [8]
    # one past a block start: rounds down, W + Bk - 1 tokens visible
    assert a.window_start(np.array([19])).tolist() == [8] and a.windowed_seq_lens(np.array([19])).tolist() == [11]
    # shorter than the window: nothing cut
    assert a.windowed_seq_lens(np.array([5, 8])).tolist() == [5, 8]


def test_future_offset_shifts_the_window():
    a = SlidingWindowAdapter(window_size=8, block_size=4, future_offset=3)  # EAGLE-3 with K = 3
    s = np.array([16, 13])
    assert a.window_start(s).tolist() == [8, 8]
    assert (s + 3 - a.window_start(s)).tolist() == [11, 8]  # tokens visible through the last draft position


def test_apply_crops_block_table_and_keeps_dtypes():
    a = SlidingWindowAdapter(window_size=8, block_size=4)
    table = np.arange(1, 11, dtype=np.int32)[None, :].repeat(2, axis=0)
    out = a.apply(np.array([19, 3], dtype=np.int32), table)
    assert out.seq_lens.dtype == np.int32 and out.block_table.dtype == np.int32
    assert out.seq_lens.tolist() == [11, 3] and out.start.tolist() == [8, 0]
    assert out.block_table.tolist() == [[3, 4, 5], [1, 0, 0]]
    assert a.windowed_seq_lens(np.array([19], dtype=np.int64)).dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 20), bk=st.integers(1, 8), f=st.integers(0, 4),
       seq_lens=st.lists(st.integers(1, 60), min_size=1, max_size=4))
def test_apply_matches_loop_reference(w, bk, f, seq_lens):
    a = SlidingWindowAdapter(window_size=w, block_size=bk, future_offset=f)
    cols = max((s + bk - 1) // bk for s in seq_lens)
    table = np.arange(1, 1 + len(seq_lens) * cols, dtype=np.int32).reshape(len(seq_lens), cols)
    out = a.apply(np.array(seq_lens, dtype=np.int32), table)
    for i, s in enumerate(seq_lens):
        ref_len, ref_row = _reference_row(s, table[i].tolist(), w, bk, f)
        assert out.seq_lens[i] == ref_len and out.block_table[i].tolist() == ref_row
        visible = s + f - out.start[i]
        assert min(w, s + f) <= visible <= w + bk - 1


def test_validation():
    with pytest.raises(ValueError, match="window_size=0"):
        SlidingWindowAdapter(window_size=0, block_size=4)
    with pytest.raises(ValueError, match="future_offset=-1"):
        SlidingWindowAdapter(window_size=4, block_size=4, future_offset=-1)
    with pytest.raises(ValueError, match="block_table shape"):
        SlidingWindowAdapter(window_size=4, block_size=4).apply(np.array([3, 4]), np.zeros((1, 2), np.int32))
