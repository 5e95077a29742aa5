"""Integer sub-byte packing conventions of the quantized checkpoint formats (specs/quantization.md §1.2, §3).

* compressed-tensors ``pack-quantized`` (dense packing, b in {2, 4, 8}): each signed value ``q`` in
  ``[-2^(b-1), 2^(b-1))`` is stored unsigned as ``q + 2^(b-1)``; along the packed dim, element ``j`` sits in
  word ``j // (32/b)`` at bit shift ``b * (j % (32/b))`` (LSB first). Words are int32 (the top nibble may make the
  word negative). Weights pack along K (dim 1, ``weight_packed [N, ceil(K*b/32)]``), asymmetric zero points along
  N (dim 0). A trailing partial word is zero-padded.
* Two's-complement int4 in int32 (no offset; eight nibbles per word, element ``j`` at shift ``4*(j%8)``): the
  layout Ascend's int4 kernels view weights in; kept for completeness and round-trip tests.
* ModelSlim W4A8 pairs: two int4 per int8 byte along the output dim N: row ``2i`` in the low nibble, row ``2i+1`` in
  the high nibble, both two's complement (``weight [N/2, K]``).

Every unpack helper returns int8 values (the signed integers), never floats.
"""

from __future__ import annotations

import torch

_SUPPORTED_BITS = (2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported for int32 packing (one of {_SUPPORTED_BITS})")
    return 32 // bits


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in ``[0, 2^32)`` -> int32 with the same bit pattern."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_to_int32(values: torch.Tensor, bits: int, dim: int = -1, offset: bool = True) -> torch.Tensor:
    """Pack signed integers ``values`` (any int dtype, each in ``[-2^(b-1), 2^(b-1))``) into int32 words along
    ``dim``: ``[..., L, ...]`` -> ``[..., ceil(L*b/32), ...]``. ``offset=True`` stores ``q + 2^(b-1)``
    (compressed-tensors), ``offset=False`` the two's-complement bits. ValueError on out-of-range values."""
    per_word = _check_bits(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    v = values.to(torch.int64).movedim(dim, -1)
    if v.numel() and (int(v.min()) < lo or int(v.max()) > hi):
        raise ValueError(f"values outside the signed {bits}-bit range [{lo}, {hi}]")
    u = v + (1 << (bits - 1)) if offset else v & ((1 << bits) - 1)
    length = u.shape[-1]
    pad = (-length) % per_word
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], dim=-1)
    u = u.reshape(*u.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=u.device) * bits
    words = (u << shifts).sum(dim=-1)
    return _wrap_int32(words).movedim(-1, dim)


def unpack_from_int32(packed: torch.Tensor, bits: int, length: int, dim: int = -1,
                      offset: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack_to_int32`: int32 words ``[..., W, ...]`` -> int8 values ``[..., length, ...]``."""
    per_word = _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed dtype {packed.dtype} must be int32")
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    if length > w.shape[-1] * per_word or length < 0:
        raise ValueError(f"length {length} does not fit {w.shape[-1]} words of {per_word} values")
    shifts = torch.arange(per_word, dtype=torch.int64, device=w.device) * bits
    u = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], -1)[..., :length]
    if offset:
        q = u - (1 << (bits - 1))
    else:
        q = torch.where(u >= (1 << (bits - 1)), u - (1 << bits), u)
    return q.to(torch.int8).movedim(-1, dim)


def pack_int4_pairs_int8(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """ModelSlim W4A8 packing: signed int4 ``values`` ``[..., 2P, ...]`` -> int8 ``[..., P, ...]`` along ``dim``
    with element ``2i`` in the low nibble and ``2i+1`` in the high nibble (two's complement)."""
    v = values.to(torch.int64).movedim(dim, 0)
    if v.shape[0] % 2:
        raise ValueError(f"int4 pair packing needs an even size along dim {dim}, got {v.shape[0]}")
    if v.numel() and (int(v.min()) < -8 or int(v.max()) > 7):
        raise ValueError("values outside the signed 4-bit range [-8, 7]")
    lo, hi = v[0::2] & 0xF, v[1::2] & 0xF
    byte = lo | (hi << 4)
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8).movedim(0, dim)


def unpack_int4_pairs_int8(packed: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`pack_int4_pairs_int8`: int8 ``[..., P, ...]`` -> int8 values ``[..., 2P, ...]``."""
    if packed.dtype != torch.int8:
        raise ValueError(f"packed dtype {packed.dtype} must be int8")
    p = packed.movedim(dim, 0)
    lo = torch.bitwise_right_shift(torch.bitwise_left_shift(p, 4), 4)  # arithmetic shifts sign-extend the nibble
    hi = torch.bitwise_right_shift(p, 4)
    out = torch.stack([lo, hi], dim=1).reshape(2 * p.shape[0], *p.shape[1:])
    return out.movedim(0, dim)
