"""BlockTable: spec §2.4 vectors, vectorised slot mapping vs a scalar loop, kernel-block split, row edits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascent.worker.block_table import (
    PAD_SLOT_ID,
    SCALAR_SLOT_TOKENS,
    BlockTable,
    MultiGroupBlockTable,
    expand_to_kernel_blocks,
)

CPU = torch.device("cpu")


def _table(d: int = 1, r: int = 0, inter: int = 1, **kw: object) -> BlockTable:
    t = BlockTable(4, 128, 128, CPU, dcp_world_size=d, dcp_rank=r, cp_kv_cache_interleave_size=inter, **kw)
    t.add_row([0, 1, 2, 3], 0)
    t.add_row([4, 5, 6, 7], 1)
    return t


def _scalar_slot(table: list[list[int]], req: int, pos: int, bs: int, d: int, r: int, inter: int) -> int:
    vb, off = divmod(pos, bs * d)
    if (off // inter) % d != r:
        return PAD_SLOT_ID
    return table[req][vb] * bs + (off // (inter * d)) * inter + off % inter


def test_vector_dcp1() -> None:
    slots = _table().compute_slot_mapping(np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]))
    assert slots.dtype == np.int64
    assert slots.tolist() == [0, 1, 512, 513]


@pytest.mark.parametrize("rank", range(8))
def test_vector_dcp8_interleave1(rank: int) -> None:
    slots = _table(8, rank).compute_slot_mapping(np.zeros(16, dtype=np.int32), np.arange(16))
    expected = [-1] * 16
    expected[rank], expected[rank + 8] = 0, 1
    assert slots.tolist() == expected


@pytest.mark.parametrize("rank", range(8))
def test_vector_dcp8_interleave128(rank: int) -> None:
    slots = _table(8, rank, 128).compute_slot_mapping(np.zeros(130, dtype=np.int32), np.arange(130))
    expected = [-1] * 130
    if rank == 0:
        expected[:128] = range(128)
    elif rank == 1:
        expected[128:] = [0, 1]
    assert slots.tolist() == expected


@pytest.mark.parametrize("d,inter,bs", [(1, 1, 16), (1, 4, 16), (2, 1, 8), (4, 2, 8), (3, 4, 4), (8, 16, 16)])
def test_random_slot_mapping_matches_scalar_loop(d: int, inter: int, bs: int) -> None:
    rng = np.random.default_rng(d * 100 + inter * 10 + bs)
    num_reqs, max_blocks = 5, 9
    sizes = rng.integers(1, max_blocks + 1, size=num_reqs)
    rows = [rng.choice(1000, size=int(n), replace=False).tolist() for n in sizes]
    req = rng.integers(0, num_reqs, size=300)
    pos = np.array([rng.integers(0, len(rows[q]) * bs * d) for q in req])
    for rank in range(d):
        t = BlockTable(num_reqs, max_blocks, bs, CPU, d, rank, inter)
        for i, ids in enumerate(rows):
            t.add_row(ids[:2], i)
            t.append_row(ids[2:], i)
        expected = [_scalar_slot(rows, int(q), int(p), bs, d, rank, inter) for q, p in zip(req, pos)]
        assert t.compute_slot_mapping(req, pos).tolist() == expected


def test_every_token_has_exactly_one_owner_rank_and_slots_are_unique() -> None:
    d, inter, bs = 4, 2, 8
    tables = []
    for rank in range(d):
        t = BlockTable(1, 4, bs, CPU, dcp_world_size=d, dcp_rank=rank, cp_kv_cache_interleave_size=inter)
        t.add_row([3, 1, 7, 2], 0)
        tables.append(t)
    pos = np.arange(4 * bs * d)
    slots = np.stack([t.compute_slot_mapping(np.zeros_like(pos), pos) for t in tables])
    assert ((slots >= 0).sum(axis=0) == 1).all()
    for rank in range(d):
        local = slots[rank][slots[rank] >= 0]
        assert len(np.unique(local)) == len(local) == 4 * bs


def test_kernel_block_expansion() -> None:
    assert expand_to_kernel_blocks([3, 7], 4).tolist() == [12, 13, 14, 15, 28, 29, 30, 31]
    assert expand_to_kernel_blocks([5], 1).tolist() == [5]
    with pytest.raises(ValueError, match="0"):
        expand_to_kernel_blocks([1], 0)


def test_kernel_split_table_gives_the_manager_level_slots() -> None:
    rng = np.random.default_rng(0)
    split = BlockTable(2, 4, 64, CPU, kernel_block_size=16)
    whole = BlockTable(2, 4, 64, CPU)
    rows = [[9, 2, 5], [1, 8]]
    for i, ids in enumerate(rows):
        split.add_row(ids, i)
        whole.add_row(ids, i)
    assert split.max_num_blocks_per_req == 16 and split.block_size == 16
    assert split.num_blocks_per_row.tolist() == [12, 8]
    assert split.block_table_np[1, :8].tolist() == expand_to_kernel_blocks([1, 8], 4).tolist()
    req = rng.integers(0, 2, size=200)
    pos = np.array([rng.integers(0, len(rows[q]) * 64) for q in req])
    assert split.compute_slot_mapping(req, pos).tolist() == whole.compute_slot_mapping(req, pos).tolist()
    with pytest.raises(ValueError, match="24"):
        BlockTable(2, 4, 64, CPU, kernel_block_size=24)


def test_row_operations_against_list_model() -> None:
    t = BlockTable(4, 6, 4, CPU)
    model: list[list[int]] = [[] for _ in range(4)]

    def check() -> None:
        for i, ids in enumerate(model):
            assert t.num_blocks_per_row[i] == len(ids)
            assert t.block_table_np[i, : len(ids)].tolist() == ids

    t.add_row([1, 2], 0), model[0].extend([1, 2]), check()
    t.append_row([3], 0), model[0].append(3), check()
    t.add_row([7, 8, 9], 2), model.__setitem__(2, [7, 8, 9]), check()
    t.swap_row(0, 2), model.__setitem__(slice(0, 3, 2), [model[2], model[0]]), check()
    t.move_row(2, 1), model.__setitem__(1, list(model[2])), check()
    t.clear_row(2), model.__setitem__(2, []), check()
    t.add_row([4], 1), model.__setitem__(1, [4]), check()
    assert t.num_blocks_per_row.dtype == np.int32
    with pytest.raises(ValueError, match="7"):
        t.append_row([1, 2, 3, 4, 5, 6], 1)
    with pytest.raises(ValueError, match="-1"):
        t.clear_row(-1)


def test_device_tensor_and_slot_mapping_tensor() -> None:
    t = _table(slot_mapping_dtype=torch.int32)
    dev = t.get_device_tensor(2)
    assert dev.dtype == torch.int32 and tuple(dev.shape) == (2, 128)
    assert dev[1, :4].tolist() == [4, 5, 6, 7]
    t.add_row([9], 0)
    assert t.get_device_tensor(2)[0, 0].item() == 9 and t.num_blocks_per_row[0] == 1
    sm = t.compute_slot_mapping_tensor(np.array([0, 1]), np.array([3, 130]))
    assert sm.dtype == torch.int32 and sm.tolist() == [9 * 128 + 3, 5 * 128 + 2]


def test_padding_and_out_of_range_positions() -> None:
    t = _table()
    assert t.compute_slot_mapping(np.array([0, -1]), np.array([5, 0])).tolist() == [5, PAD_SLOT_ID]
    with pytest.raises(ValueError, match="512"):
        t.compute_slot_mapping(np.array([0]), np.array([512]))
    with pytest.raises(ValueError, match="dcp_rank"):
        BlockTable(1, 1, 16, CPU, dcp_world_size=2, dcp_rank=2)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        BlockTable(1, 1, 16, CPU, dcp_world_size=2, cp_kv_cache_interleave_size=3)


def test_multi_group_table() -> None:
    mg = MultiGroupBlockTable(2, [4, 2], [16, 32], CPU)
    mg.add_row([[1, 2], [3]], 0)
    mg.append_row([[4], []], 0)
    a, b = mg.compute_slot_mappings(np.array([0, 0]), np.array([17, 30]))
    assert a.tolist() == [2 * 16 + 1, 2 * 16 + 14] and b.tolist() == [3 * 32 + 17, 3 * 32 + 30]
    mg.swap_row(0, 1)
    assert mg[0].num_blocks_per_row[1] == 3 and mg[1].num_blocks_per_row[0] == 0
    with pytest.raises(ValueError, match="2"):
        mg.add_row([[1]], 0)


@pytest.mark.parametrize("tokens", [1, 2, SCALAR_SLOT_TOKENS, SCALAR_SLOT_TOKENS + 1, 40])
def test_few_token_slots_equal_the_vectorized_formula(tokens: int) -> None:
    """Up to SCALAR_SLOT_TOKENS tokens take the Python loop; both sides of the threshold give the formula's slots,
    padding tokens included."""
    rng = np.random.default_rng(tokens)
    t = BlockTable(6, 8, 16, CPU)
    rows = [rng.choice(500, size=int(n), replace=False).tolist() for n in rng.integers(1, 9, size=6)]
    for i, ids in enumerate(rows):
        t.add_row(ids, i)
    req = rng.integers(-1, 6, size=tokens)
    pos = np.array([rng.integers(0, len(rows[q]) * 16) if q >= 0 else 0 for q in req])
    expected = [PAD_SLOT_ID if q < 0 else rows[q][p // 16] * 16 + p % 16 for q, p in zip(req, pos)]
    slots = t.compute_slot_mapping(req, pos)
    assert slots.dtype == np.int64 and slots.tolist() == expected


@pytest.mark.parametrize("tokens", [1, SCALAR_SLOT_TOKENS + 1])
def test_slot_lookup_errors_name_the_bad_value_on_both_paths(tokens: int) -> None:
    t = _table()
    ones = np.zeros(tokens, dtype=np.int64)
    with pytest.raises(ValueError, match="position 512 of row 0 lies in block 4"):
        t.compute_slot_mapping(ones, np.full(tokens, 512))
    with pytest.raises(ValueError, match="positions must be >= 0, got -3"):
        t.compute_slot_mapping(ones, np.full(tokens, -3))
    with pytest.raises(ValueError, match="req_indices must be < max_num_reqs=4, got 4"):
        t.compute_slot_mapping(ones + 4, ones)


def test_host_table_views_follow_edits_inside_and_outside_inference_mode() -> None:
    t = _table()
    with torch.inference_mode():
        inside = t.get_device_tensor(2)
    assert t.get_device_tensor(2) is inside and not inside.is_inference()
    t.add_row([11, 12], 1)
    assert inside[1, :2].tolist() == [11, 12]
    inside[0, 0] = 3  # a normal view of the host table: writable outside inference mode
    assert t.block_table_np[0, 0] == 3
    assert tuple(t.get_device_tensor(1).shape) == (1, 128) and tuple(t.get_device_tensor(0).shape) == (0, 128)
