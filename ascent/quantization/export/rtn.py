"""Round-to-nearest (RTN) weight quantization and the integer packings the checkpoint formats use.

Conventions (the same for every format this package writes):

* symmetric: ``scale = absmax / qmax`` with ``qmax = 2**(bits-1) - 1`` (127 for int8, 7 for int4), taken per output row
  (channel) or per group of ``group_size`` consecutive input columns; an all-zero row/group gets scale 1;
* the scale is rounded to its storage dtype *first* and the integers are
  ``clamp(rint(w / stored_scale), -qmax-1, qmax)`` computed in float64, so ``q * stored_scale`` is the best
  representable weight for the scale actually written;
* ``rint`` is round-half-to-even (``torch.round``);
* asymmetric (weight-only schemes): ``scale = (max - min) / (2**bits - 1)`` per row or group (stored dtype first), a
  float subtractive offset ``z = -2**(bits-1) - min / stored_scale`` (fp32, ModelSlim's ``weight_offset``:
  ``W = (q - z) * scale``) and ``q = clamp(rint(w / stored_scale + z), -2**(bits-1), 2**(bits-1) - 1)``: the group's
  minimum and maximum map to the ends of the integer range. A weight already on a per-group affine 4-bit grid with
  float minimum (GGUF Q4_1, the default model's format, blocks of 32) is reproduced up to the scale's rounding.

Packings:

* :func:`pack_rows_int32` - compressed-tensors ``pack-quantized`` (>= 0.20 dense layout): values stored unsigned as
  ``q + 2**(bits-1)``; element ``j`` of a row occupies bits ``[j*bits, (j+1)*bits)`` of the row's little-endian bit
  stream, i.e. for int4 element ``j`` sits in int32 word ``j // 8`` at shift ``4 * (j % 8)``;
* :func:`pack_int4_pairs_along_n` - ModelSlim W4A8: two int4 per int8 along the output dim, even row in the low
  nibble, odd row in the high nibble (two's-complement nibbles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """An RTN-quantized ``[N, K]`` weight: ``q`` int8 ``[N, K]`` (int4 values are stored one per int8 here) and
    ``scale`` ``[N, 1]`` (per channel) or ``[N, K // group_size]`` (per group) in the storage dtype."""

    q: torch.Tensor
    scale: torch.Tensor
    bits: int
    group_size: int | None = None
    offset: torch.Tensor | None = None  # asymmetric: fp32 subtractive offsets, the scale's shape

    def dequantize(self) -> torch.Tensor:
        """float64 ``[N, K]`` weight the integers, the stored scales and offsets represent."""
        scale = self.scale.double()
        offset = self.offset.double() if self.offset is not None else torch.zeros_like(scale)
        if self.group_size:
            scale = scale.repeat_interleave(self.group_size, dim=1)
            offset = offset.repeat_interleave(self.group_size, dim=1)
        return (self.q.double() - offset) * scale


def qmax_for(bits: int) -> int:
    """Largest positive value of a signed ``bits``-bit integer."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits={bits!r} must be between 2 and 8")
    return (1 << (bits - 1)) - 1


def _rtn(w64: torch.Tensor, absmax: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Integers and stored scales for ``w64`` split in rows that share one scale (``absmax [..., 1]``)."""
    qmax = qmax_for(bits)
    scale = absmax / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(scale_dtype)
    q = torch.clamp(torch.round(w64 / scale.double()), -qmax - 1, qmax).to(torch.int8)
    return q, scale


def _groups_of(weight: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """float64 ``weight [N, K]`` as ``[N, K // group_size, group_size]``; ValueError naming ``name`` and the sizes
    when it is not 2-D or K is not divisible by ``group_size``."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"{name}: input size K={k} is not divisible by group_size={group_size} "
                         f"(weight shape [{n}, {k}]); choose a --group-size that divides {k}")
    return weight.detach().double().reshape(n, k // group_size, group_size)


def _rtn_asymmetric(w64: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Integers, stored scales and fp32 offsets for ``w64`` split in rows of one scale each (last dim)."""
    qmin, qmax = -qmax_for(bits) - 1, qmax_for(bits)
    low, high = w64.amin(dim=-1, keepdim=True), w64.amax(dim=-1, keepdim=True)
    scale = (high - low) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(scale_dtype)
    offset = (qmin - low / scale.double()).to(torch.float32)
    q = torch.clamp(torch.round(w64 / scale.double() + offset.double()), qmin, qmax).to(torch.int8)
    return q, scale, offset


def quantize_asymmetric(weight: torch.Tensor, bits: int, group_size: int | None, scale_dtype: torch.dtype,
                        name: str = "weight") -> QuantizedWeight:
    """Asymmetric min-max RTN (module docstring) per channel (``group_size`` None) or per group of ``group_size``
    input columns; ``scale`` / ``offset`` ``[N, G]``."""
    size = group_size or weight.shape[-1]
    q, scale, offset = _rtn_asymmetric(_groups_of(weight, size, name), bits, scale_dtype)
    n, k = weight.shape
    return QuantizedWeight(q=q.reshape(n, k), scale=scale.reshape(n, k // size), bits=bits, group_size=group_size,
                           offset=offset.reshape(n, k // size))


def quantize_per_channel(weight: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> QuantizedWeight:
    """Symmetric per-output-channel RTN of ``weight [N, K]``; scale ``[N, 1]`` in ``scale_dtype``."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    w64 = weight.detach().double()
    q, scale = _rtn(w64, w64.abs().amax(dim=1, keepdim=True), bits, scale_dtype)
    return QuantizedWeight(q=q, scale=scale, bits=bits)


def quantize_per_group(weight: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype,
                       name: str = "weight") -> QuantizedWeight:
    """Symmetric RTN with one scale per ``group_size`` consecutive input columns; scale ``[N, K // group_size]``.

    Raises ValueError naming ``name`` and the sizes when K is not divisible by ``group_size``."""
    w64 = _groups_of(weight, group_size, name)
    n, k = weight.shape
    q, scale = _rtn(w64, w64.abs().amax(dim=2, keepdim=True), bits, scale_dtype)
    return QuantizedWeight(q=q.reshape(n, k), scale=scale.reshape(n, k // group_size), bits=bits,
                           group_size=group_size)


def pack_rows_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` rows: ``q [N, K]`` signed ``bits``-bit values -> int32
    ``[N, ceil(K * bits / 32)]`` (unsigned offset ``2**(bits-1)``, LSB-first dense bit stream per row)."""
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {tuple(q.shape)}")
    qmax = qmax_for(bits)
    n, k = q.shape
    unsigned = (q.to(torch.int64) + qmax + 1)
    if int(unsigned.min()) < 0 or int(unsigned.max()) >= (1 << bits):
        raise ValueError(f"values outside the signed {bits}-bit range cannot be packed")
    words = (k * bits + 31) // 32
    out = torch.zeros(n, words, dtype=torch.int64)
    bit = torch.arange(k, dtype=torch.int64) * bits
    word, shift = bit // 32, bit % 32
    low = (unsigned << shift) & 0xFFFFFFFF
    out.index_add_(1, word, low)
    spill = shift + bits > 32  # only for bit widths that do not divide 32
    if bool(spill.any()):
        high = unsigned[:, spill] >> (32 - shift[spill])
        out.index_add_(1, word[spill] + 1, high)
    out = torch.where(out >= (1 << 31), out - (1 << 32), out)
    return out.to(torch.int32)


def unpack_rows_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows_int32`: int32 ``[N, words]`` -> int8 ``[N, k]`` signed values."""
    qmax = qmax_for(bits)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    bit = torch.arange(k, dtype=torch.int64) * bits
    word, shift = bit // 32, bit % 32
    value = words[:, word] >> shift
    spill = shift + bits > 32
    if bool(spill.any()):
        value[:, spill] |= words[:, word[spill] + 1] << (32 - shift[spill])
    return ((value & ((1 << bits) - 1)) - qmax - 1).to(torch.int8)


def pack_int4_pairs_along_n(q: torch.Tensor) -> torch.Tensor:
    """ModelSlim W4A8: int4 values ``q [N, K]`` (N even) -> int8 ``[N // 2, K]``; row ``2i`` in the low nibble,
    row ``2i + 1`` in the high nibble."""
    if q.dim() != 2 or q.shape[0] % 2:
        raise ValueError(f"int4 pair packing along N needs an even number of rows, got shape {tuple(q.shape)}")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("values outside the int4 range [-8, 7] cannot be packed")
    low = q[0::2].to(torch.int16) & 0xF
    high = q[1::2].to(torch.int16) & 0xF
    byte = low | (high << 4)
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def unpack_int4_pairs_along_n(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_pairs_along_n`: int8 ``[N // 2, K]`` -> int8 ``[N, K]``."""
    byte = packed.to(torch.int16) & 0xFF
    low, high = byte & 0xF, byte >> 4
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    out = torch.stack((low, high), dim=1).reshape(2 * packed.shape[0], packed.shape[1])
    return out.to(torch.int8)


def deq_scale_int64(deq_scale: torch.Tensor) -> torch.Tensor:
    """ModelSlim's fp16-model encoding of ``deq_scale``: the fp32 bit pattern widened into int64."""
    return deq_scale.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
