"""Packing conventions (spec §1.2, §3, §12 item 3): hand-computed words, compressed-tensors' own packer as the
oracle for ``pack-quantized``, ModelSlim int4 pairs, and round trips."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as ct_pack
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32 as ct_unpack

from ascent.quantization.packing import (
    pack_int4_pairs_int8,
    pack_to_int32,
    unpack_from_int32,
    unpack_int4_pairs_int8,
)


def _i32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_int4_offset_word_hand_computed():
    # stored nibbles q + 8 = 9, 6, 11, 4, 13, 2, 15, 0 -> element j at bits 4j (LSB first)
    values = torch.tensor([[1, -2, 3, -4, 5, -6, 7, -8]], dtype=torch.int8)
    assert pack_to_int32(values, 4, dim=1).tolist() == [[0x0F2D4B69]]
    sevens = torch.full((1, 8), 7, dtype=torch.int8)
    assert pack_to_int32(sevens, 4, dim=1).tolist() == [[-1]]  # 0xFFFFFFFF
    assert pack_to_int32(torch.full((1, 8), -8, dtype=torch.int8), 4, dim=1).tolist() == [[0]]


def test_two_and_eight_bit_words_hand_computed():
    two = torch.tensor([[-2, -1, 0, 1] * 4], dtype=torch.int8)  # stored 0, 1, 2, 3 repeating, 2 bits each
    expected = sum(((j % 4) << (2 * j)) for j in range(16))
    assert pack_to_int32(two, 2, dim=1).tolist() == [[_i32(expected)]]
    eight = torch.tensor([[0, -128, 127, 1]], dtype=torch.int8)  # stored 128, 0, 255, 129
    assert pack_to_int32(eight, 8, dim=1).tolist() == [[_i32(0x81FF0080)]]


def test_twos_complement_int4_in_int32_hand_computed():
    values = torch.tensor([[-1, 0, 1, -8, 7, 2, -2, 3]], dtype=torch.int8)  # nibbles F,0,1,8,7,2,E,3
    assert pack_to_int32(values, 4, dim=1, offset=False).tolist() == [[0x3E27810F]]
    assert torch.equal(unpack_from_int32(pack_to_int32(values, 4, 1, False), 4, 8, 1, False), values)


def test_partial_word_zero_padding_and_dim0():
    values = torch.tensor([[1], [2], [3]], dtype=torch.int8)  # packed along dim 0 (zero points along N)
    assert pack_to_int32(values, 4, dim=0).tolist() == [[0x9 | (0xA << 4) | (0xB << 8)]]
    assert torch.equal(unpack_from_int32(pack_to_int32(values, 4, 0), 4, 3, 0), values)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_matches_compressed_tensors_packer(bits, dim):
    g = torch.Generator().manual_seed(bits * 10 + dim)
    lo = -(1 << (bits - 1))
    values = torch.randint(lo, -lo, (32, 64), generator=g, dtype=torch.int8)
    ours = pack_to_int32(values, bits, dim=dim)
    assert torch.equal(ours, ct_pack(values, bits, dim))
    assert torch.equal(ct_unpack(ours, bits, values.shape, dim), values)
    assert torch.equal(unpack_from_int32(ours, bits, values.shape[dim], dim=dim), values)


def test_round_trip_3d_and_odd_lengths():
    g = torch.Generator().manual_seed(3)
    values = torch.randint(-8, 8, (3, 5, 37), generator=g, dtype=torch.int8)
    for dim in (0, 1, 2):
        packed = pack_to_int32(values, 4, dim=dim)
        assert packed.shape[dim] == -(-values.shape[dim] // 8)
        assert torch.equal(unpack_from_int32(packed, 4, values.shape[dim], dim=dim), values)


def test_modelslim_pairs_hand_computed():
    rows = torch.tensor([[1, -8], [-2, 7]], dtype=torch.int8)  # column 0: lo=1, hi=-2 -> 0xE1; column 1: 0x78
    packed = pack_int4_pairs_int8(rows, dim=0)
    assert packed.tolist() == [[0xE1 - 256, 0x78]]
    assert torch.equal(unpack_int4_pairs_int8(packed, dim=0), rows)


def test_modelslim_pairs_round_trip_all_values():
    grid = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8)).to(torch.int8).t().contiguous()
    packed = pack_int4_pairs_int8(grid, dim=0)
    assert packed.shape == (1, 256)
    assert sorted(packed.reshape(-1).tolist()) == list(range(-128, 128))  # every byte exactly once
    assert torch.equal(unpack_int4_pairs_int8(packed, dim=0), grid)
    three_d = torch.randint(-8, 8, (2, 6, 4), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    assert torch.equal(unpack_int4_pairs_int8(pack_int4_pairs_int8(three_d, dim=1), dim=1), three_d)


def test_errors():
    with pytest.raises(ValueError, match="signed 4-bit"):
        pack_to_int32(torch.tensor([[8]], dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="bits=3"):
        pack_to_int32(torch.zeros(1, 8, dtype=torch.int8), 3)
    with pytest.raises(ValueError, match="even"):
        pack_int4_pairs_int8(torch.zeros(3, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="int32"):
        unpack_from_int32(torch.zeros(1, 1, dtype=torch.int64), 4, 8)
