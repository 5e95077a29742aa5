"""Additive attention masks for the compatibility (310P-style) attention paths (device_ops spec §3.2).

Conventions: an additive mask is added to the attention scores; ``0`` = visible, the fill value = masked. Row = query,
column = key position. Query ``r`` of a request with ``q_len`` new tokens and ``seq_len`` context tokens (cached +
new) sits at absolute position ``pos = seq_len - q_len + r`` (bottom-right alignment) and sees key ``j`` iff
``j <= pos`` (and ``j > pos - window`` with a sliding window).

- causal: ``[q_len, seq_len]`` per request, a view of one cached square mask grown to the longest request seen (never
  a ``max_model_len``-squared mask unless a request is that long);
- splitfuse (plain): the causal rows at the absolute positions of every new token, concatenated over requests:
  ``[T, max(seq_lens)]``, built directly from the positions;
- splitfuse (compressed): one fixed ``[2048, 2048]`` tile with ``-10000`` strictly above the diagonal; the per-request
  ``[q_len, seq_len]`` mask is derived from it by :meth:`AttentionMaskBuilder.expand_compressed` (same semantics);
- FRACTAL_NZ relayout (a pure 310P layout artefact) with its inverse, for layout round-trip tests.
"""

from __future__ import annotations

import math

import numpy as np
import torch

COMPRESSED_MASK_SIZE = 2048
COMPRESSED_MASK_VALUE = -10000.0
_MIN_SQUARE = 128


def additive_fill_value(dtype: torch.dtype) -> float:
    """Fill value of masked positions in an additive mask of ``dtype``: ``-inf`` (every float dtype has it)."""
    if not dtype.is_floating_point:
        raise ValueError(f"additive masks need a floating dtype, got {dtype}")
    return float("-inf")


def compressed_fill_value(dtype: torch.dtype) -> float:
    """Fill value of the compressed splitfuse tile: ``-10000``, or the dtype's lowest finite value if that is higher."""
    if not dtype.is_floating_point:
        raise ValueError(f"additive masks need a floating dtype, got {dtype}")
    return max(COMPRESSED_MASK_VALUE, float(torch.finfo(dtype).min))


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool ``[len(q_pos), len(k_pos)]``: key visible to query (causal, optional sliding window)."""
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        allowed &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype, fill: float) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, fill)


def causal_additive_mask(length: int, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu",
                         window: int | None = None) -> torch.Tensor:
    """Uncached ``[length, length]`` causal additive mask: 0 on and below the diagonal, ``-inf`` strictly above
    (and beyond the sliding window, if given). The explicit form of upstream ``gen_causal_additive_mask``."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    _check_window(window)
    pos = torch.arange(length, device=device)
    return _additive(_visible(pos, pos, window), dtype, additive_fill_value(dtype))


def splitfuse_positions(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """int64 ``[sum(query_lens)]``: absolute position of every new token, requests concatenated in batch order."""
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if q.shape != s.shape:
        raise ValueError(f"query_lens has {q.size} entries but seq_lens has {s.size}")
    if np.any(q < 0) or np.any(q > s):
        raise ValueError(f"query_lens {q.tolist()} must lie in [0, seq_lens {s.tolist()}]")
    total = int(q.sum())
    req = np.repeat(np.arange(q.size), q)
    starts = np.concatenate([[0], np.cumsum(q)[:-1]]).astype(np.int64)
    return (s - q)[req] + np.arange(total, dtype=np.int64) - starts[req]


def to_fractal_nz(mask: torch.Tensor) -> torch.Tensor:
    """The 310P FRACTAL_NZ view of a 2-D ``[M, N]`` tensor: pad both dims to multiples of 16 (with zeros), then
    ``[M', N'] -> [1, N'/16, M', 16]``. Pure layout; :func:`from_fractal_nz` inverts it."""
    if mask.dim() != 2:
        raise ValueError(f"to_fractal_nz expects a 2-D tensor, got shape {tuple(mask.shape)}")
    m, n = mask.shape
    pm, pn = -(-m // 16) * 16, -(-n // 16) * 16
    padded = torch.nn.functional.pad(mask, (0, pn - n, 0, pm - m))
    return padded.view(pm, pn // 16, 16).transpose(0, 1).unsqueeze(0).contiguous()


def from_fractal_nz(nz: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_fractal_nz`: ``[1, N'/16, M', 16]`` -> the original ``[rows, cols]``."""
    if nz.dim() != 4 or nz.shape[0] != 1 or nz.shape[3] != 16:
        raise ValueError(f"not a FRACTAL_NZ tensor: shape {tuple(nz.shape)}")
    if rows > nz.shape[2] or cols > nz.shape[1] * 16:
        raise ValueError(f"rows {rows} / cols {cols} exceed the NZ tensor {tuple(nz.shape)}")
    return nz[0].transpose(0, 1).reshape(nz.shape[2], -1)[:rows, :cols]


class AttentionMaskBuilder:
    """Builds and caches the additive masks of the compatibility attention backend.

    ``max_model_len`` (optional) bounds every request length (ValueError beyond it). Masks are built in the dtype
    asked for (the attention dtype: fp16 on the 310P profile) on ``device``; caches are keyed by (dtype, device,
    window). The causal square grows by powers of two (at least 128) up to ``max_model_len``.
    """

    def __init__(self, max_model_len: int | None = None) -> None:
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.max_model_len = max_model_len
        self._squares: dict[tuple[torch.dtype, torch.device, int | None], torch.Tensor] = {}
        self._tiles: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _check_len(self, seq_len: int) -> None:
        if seq_len < 0:
            raise ValueError(f"seq_len must be >= 0, got {seq_len}")
        if self.max_model_len is not None and seq_len > self.max_model_len:
            raise ValueError(f"seq_len {seq_len} exceeds max_model_len {self.max_model_len}")

    def _square(self, size: int, dtype: torch.dtype, device: torch.device, window: int | None) -> torch.Tensor:
        key = (dtype, device, window)
        cached = self._squares.get(key)
        if cached is None or cached.shape[0] < size:
            grown = max(_MIN_SQUARE, 1 << math.ceil(math.log2(max(size, 1))))
            if self.max_model_len is not None:
                grown = max(size, min(grown, self.max_model_len))
            cached = causal_additive_mask(grown, dtype, device, window)
            self._squares[key] = cached
        return cached

    def cached_square_len(self, dtype: torch.dtype, device: torch.device | str = "cpu",
                          window: int | None = None) -> int:
        """Side of the cached causal square for (dtype, device, window); 0 if none was built yet."""
        cached = self._squares.get((dtype, torch.device(device), window))
        return 0 if cached is None else int(cached.shape[0])

    def causal_mask(self, seq_len: int, q_len: int | None = None, dtype: torch.dtype = torch.float16,
                    device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
        """Bottom-right aligned causal additive mask ``[q_len, seq_len]`` (``q_len`` defaults to ``seq_len``).

        A view of the cached square: the top-left corner of a (banded) causal mask is itself one, and its last
        ``q_len`` rows are the rows at positions ``seq_len - q_len .. seq_len - 1``.
        """
        q_len = seq_len if q_len is None else q_len
        self._check_len(seq_len)
        _check_window(window)
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"q_len {q_len} must lie in [0, seq_len {seq_len}]")
        additive_fill_value(dtype)
        square = self._square(seq_len, dtype, torch.device(device), window)
        return square[seq_len - q_len : seq_len, :seq_len]

    def non_causal_mask(self, seq_len: int, q_len: int | None = None, dtype: torch.dtype = torch.float16,
                        device: torch.device | str = "cpu") -> torch.Tensor:
        """All-visible (zero) additive mask ``[q_len, seq_len]`` for bidirectional (encoder/pooling) attention."""
        q_len = seq_len if q_len is None else q_len
        self._check_len(seq_len)
        additive_fill_value(dtype)
        return torch.zeros(q_len, seq_len, dtype=dtype, device=device)

    def splitfuse_mask(self, query_lens: np.ndarray, seq_lens: np.ndarray, dtype: torch.dtype = torch.float16,
                       device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
        """Plain splitfuse mask ``[sum(query_lens), max(seq_lens)]``: the causal row at each new token's absolute
        position. Columns past a request's own ``seq_len`` are masked for its rows too (they belong to no key)."""
        _check_window(window)
        positions = splitfuse_positions(query_lens, seq_lens)
        max_len = int(np.max(seq_lens)) if len(positions) else 0
        self._check_len(max_len)
        q_pos = torch.from_numpy(positions).to(device)
        k_pos = torch.arange(max_len, device=device)
        return _additive(_visible(q_pos, k_pos, window), dtype, additive_fill_value(dtype))

    def compressed_mask(self, dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu") -> torch.Tensor:
        """The fixed ``[2048, 2048]`` compressed splitfuse tile: 0 on/below the diagonal, ``-10000`` above."""
        key = (dtype, torch.device(device))
        if key not in self._tiles:
            pos = torch.arange(COMPRESSED_MASK_SIZE, device=device)
            self._tiles[key] = _additive(_visible(pos, pos, None), dtype, compressed_fill_value(dtype))
        return self._tiles[key]

    def expand_compressed(self, q_len: int, seq_len: int, dtype: torch.dtype = torch.float16,
                          device: torch.device | str = "cpu") -> torch.Tensor:
        """Per-request ``[q_len, seq_len]`` mask derived from the compressed tile, as the splitfuse kernel does.

        The cached context (``seq_len - q_len`` keys) is visible to every new token; the new-token block is covered by
        2048-row stripes: within a stripe the tile gives the diagonal block, keys before it are visible and keys
        after it are masked.
        """
        self._check_len(seq_len)
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"q_len {q_len} must lie in [0, seq_len {seq_len}]")
        tile, size = self.compressed_mask(dtype, device), COMPRESSED_MASK_SIZE
        out = torch.zeros(q_len, seq_len, dtype=dtype, device=device)
        context = seq_len - q_len
        for r0 in range(0, q_len, size):
            r1 = min(r0 + size, q_len)
            out[r0:r1, context + r0 : context + r1] = tile[: r1 - r0, : r1 - r0]
            out[r0:r1, context + r1 :] = compressed_fill_value(dtype)
        return out

    def key_padding_mask(self, context_lens: torch.Tensor, max_len: int, dtype: torch.dtype = torch.float16,
                         window: int | None = None) -> torch.Tensor:
        """Paged-decode mask ``[B, max_len]`` for one query per request at position ``context_lens[b] - 1``: key
        ``j`` visible iff ``j < context_lens[b]`` (and within the window)."""
        _check_window(window)
        self._check_len(max_len)
        k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)
        last = context_lens.to(torch.int64).unsqueeze(1) - 1
        allowed = k_pos <= last
        if window is not None:
            allowed &= k_pos > last - window
        return _additive(allowed, dtype, additive_fill_value(dtype))
