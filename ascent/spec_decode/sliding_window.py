"""Sliding-window draft attention (vLLM Ascend's ``SlidingWindowAdapter``, ``draft_window_size``).

The draft model attends only to (about) the last ``W`` tokens: with KV block size ``Bk`` and future offset ``F``
(EAGLE-3: K, because its seq_lens exclude the K draft positions; DFlash: 0):

    start            = floor(max(seq_len + F - W, 0) / Bk) * Bk
    windowed_seq_len = seq_len - start
    block row        = full_row[start / Bk : start / Bk + ceil(windowed_seq_len / Bk)], zero padded to
                       ceil(W / Bk) + 1 columns

The window is block aligned: positions ``start .. seq_len + F - 1`` stay visible, which is between ``W`` and
``W + Bk - 1`` tokens once ``seq_len + F >= W``. Slot mapping and RoPE positions stay absolute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowedMetadata:
    """``seq_lens`` int32 [B] (windowed), ``block_table`` int32 [B, max_window_blocks], ``start`` int64 [B] (first
    visible absolute position, a multiple of the block size)."""

    seq_lens: np.ndarray
    block_table: np.ndarray
    start: np.ndarray


@dataclass(frozen=True)
class SlidingWindowAdapter:
    window_size: int
    block_size: int
    future_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("window_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.future_offset < 0:
            raise ValueError(f"future_offset={self.future_offset} is invalid: must be >= 0")

    @property
    def max_window_blocks(self) -> int:
        return -(-self.window_size // self.block_size) + 1

    def window_start(self, seq_lens: np.ndarray) -> np.ndarray:
        """Block-aligned first visible position per request (int64, same shape as ``seq_lens``)."""
        s = np.asarray(seq_lens, dtype=np.int64)
        return np.maximum(s + self.future_offset - self.window_size, 0) // self.block_size * self.block_size

    def windowed_seq_lens(self, seq_lens: np.ndarray) -> np.ndarray:
        """``seq_len - start`` in ``seq_lens``' dtype (also used for the host mirrors of seq_lens)."""
        s = np.asarray(seq_lens)
        return (s - self.window_start(s)).astype(s.dtype)

    def apply(self, seq_lens: np.ndarray, block_table: np.ndarray) -> WindowedMetadata:
        """``seq_lens`` int [B], ``block_table`` int32 [B, M] (full rows) -> the windowed metadata."""
        s = np.asarray(seq_lens)
        table = np.asarray(block_table)
        if table.ndim != 2 or table.shape[0] != s.shape[0] or table.shape[1] == 0:
            raise ValueError(f"block_table shape {table.shape} is invalid for seq_lens shape {s.shape}: "
                             "need [B, M >= 1]")
        start = self.window_start(s)
        windowed = (s - start).astype(np.int64)
        first_block = start // self.block_size
        needed = np.minimum(-(-windowed // self.block_size), self.max_window_blocks)
        cols = np.arange(self.max_window_blocks)[None, :]
        src = first_block[:, None] + cols
        valid = (cols < needed[:, None]) & (src < table.shape[1])
        gathered = np.take_along_axis(table, np.minimum(src, table.shape[1] - 1), axis=1)
        out = np.where(valid, gathered, 0).astype(np.int32)
        return WindowedMetadata(seq_lens=windowed.astype(np.int32), block_table=out, start=start)
