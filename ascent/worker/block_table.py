"""Per-request block tables and slot mapping on the worker (engine_core spec §2.4).

Host-side state is numpy (``block_table_np`` int32 [max_num_reqs, max_num_blocks_per_req],
``num_blocks_per_row`` int32 [max_num_reqs]); the device copy is refreshed by :meth:`BlockTable.get_device_tensor`
(on CPU it is a view of the host table).

Slot of token ``pos`` of row ``req`` (kernel block size ``bs``, DCP world ``D``, rank ``r``, interleave ``I``):
``vb = pos // (bs*D)``, ``off = pos % (bs*D)``; local iff ``(off // I) % D == r``; then
``slot = table[req, vb] * bs + (off // (I*D)) * I + off % I``, else ``PAD_SLOT_ID``. With ``D == 1`` this is
``table[req, pos // bs] * bs + pos % bs``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PAD_SLOT_ID = -1
# Tokens up to which compute_slot_mapping (without DCP) loops in Python instead of vectorizing.
SCALAR_SLOT_TOKENS = 8


def expand_to_kernel_blocks(block_ids: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Manager block ids -> kernel block ids when a manager block holds ``k`` kernel blocks: b -> b*k .. b*k+k-1."""
    if k < 1:
        raise ValueError(f"k (kernel blocks per manager block) must be >= 1, got {k}.")
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    return (ids[:, None] * k + np.arange(k, dtype=np.int64)).reshape(-1)


class BlockTable:
    """Block table of one KV-cache group for up to ``max_num_reqs`` request rows.

    ``block_size`` is the manager block size; ``kernel_block_size`` (default: the same) must divide it, and each
    manager block id is stored as ``k = block_size // kernel_block_size`` kernel block ids, so rows are k× wider
    and slots are computed with the kernel block size. Row ``i`` holds ``num_blocks_per_row[i]`` valid entries.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        cp_kv_cache_interleave_size: int = 1,
        slot_mapping_dtype: torch.dtype = torch.int64,
        kernel_block_size: int | None = None,
    ) -> None:
        kernel_block_size = block_size if kernel_block_size is None else kernel_block_size
        _validate(max_num_reqs, max_num_blocks_per_req, block_size, kernel_block_size)
        _validate_dcp(dcp_world_size, dcp_rank, cp_kv_cache_interleave_size, kernel_block_size)
        if slot_mapping_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slot_mapping_dtype must be torch.int32 or torch.int64, got {slot_mapping_dtype}.")
        self.max_num_reqs = max_num_reqs
        self.manager_block_size = block_size
        self.block_size = kernel_block_size
        self.blocks_per_kv_block = block_size // kernel_block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block
        self.device = torch.device(device)
        self.dcp_world_size = dcp_world_size
        self.dcp_rank = dcp_rank
        self.cp_kv_cache_interleave_size = cp_kv_cache_interleave_size
        self.slot_mapping_dtype = slot_mapping_dtype
        self.block_table_np = np.zeros((max_num_reqs, self.max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # On CPU the "device" table is a view of block_table_np itself, so a step copies nothing; its row-prefix
        # views are kept (they share the table's memory, so they always show its current rows).
        self._host_views: dict[int, torch.Tensor] = {}
        self._device_table = (torch.from_numpy(self.block_table_np) if self.device.type == "cpu" else torch.zeros(
            (max_num_reqs, self.max_num_blocks_per_req), dtype=torch.int32, device=self.device))

    # --- row edits -------------------------------------------------------------------------------------------------
    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        """Replace row ``row`` by ``block_ids`` (manager block ids)."""
        self._check_row(row)
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        """Append manager block ids to row ``row``."""
        self._check_row(row)
        if len(block_ids) == 0:
            return
        ids = self._to_kernel_ids(block_ids)
        start = int(self.num_blocks_per_row[row])
        end = start + ids.shape[0]
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"Row {row} would hold {end} kernel blocks, more than max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})."
            )
        self.block_table_np[row, start:end] = ids
        self.num_blocks_per_row[row] = end

    def clear_row(self, row: int) -> None:
        self._check_row(row)
        self.block_table_np[row] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` into row ``tgt`` (``src`` is left as is)."""
        self._check_row(src)
        self._check_row(tgt)
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        self.block_table_np[[a, b]] = self.block_table_np[[b, a]]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    # --- slot mapping ----------------------------------------------------------------------------------------------
    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot of every token: int64 [T]. ``req_indices[t] < 0`` marks a padding token (slot PAD_SLOT_ID).

        Raises ValueError when a position lies beyond the blocks held by its row.
        """
        req = np.asarray(req_indices, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if req.shape != pos.shape:
            raise ValueError(f"req_indices {req.shape} and positions {pos.shape} must have the same length.")
        bs, d, inter = self.block_size, self.dcp_world_size, self.cp_kv_cache_interleave_size
        if d == 1 and req.size <= SCALAR_SLOT_TOKENS:
            return self._slots_of_few(req, pos)
        if d == 1 and (req.size == 0 or int(req.min()) >= 0):  # no padding tokens, no DCP: the direct formula
            virtual_block = pos // bs
            self._check_lookup(req, pos, virtual_block)
            return self.block_table_np[req, virtual_block].astype(np.int64) * bs + pos % bs
        valid = req >= 0
        rows = np.where(valid, req, 0)
        virtual_block = pos // (bs * d)
        self._check_lookup(rows[valid], pos[valid], virtual_block[valid])
        block_numbers = self.block_table_np[rows, np.where(valid, virtual_block, 0)].astype(np.int64)
        if d == 1:
            slots = block_numbers * bs + pos % bs
            return np.where(valid, slots, PAD_SLOT_ID)
        off = pos % (bs * d)
        local = valid & ((off // inter) % d == self.dcp_rank)
        local_off = (off // (inter * d)) * inter + off % inter
        return np.where(local, block_numbers * bs + local_off, PAD_SLOT_ID)

    def _slots_of_few(self, req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """``compute_slot_mapping`` without DCP for a few tokens, in Python scalars: a decode step's handful of
        tokens costs ~1 us this way against ~30 us of small numpy calls (min, max, any, fancy indexing)."""
        bs, held, table = self.block_size, self.num_blocks_per_row, self.block_table_np
        slots = []
        for r, p in zip(req.tolist(), pos.tolist()):
            if r < 0:  # a padding token
                slots.append(PAD_SLOT_ID)
                continue
            block = p // bs
            if r >= self.max_num_reqs or p < 0 or block >= held[r]:
                self._check_lookup(np.array([r]), np.array([p]), np.array([block]))  # raises, naming the token
            slots.append(int(table[r, block]) * bs + p % bs)
        return np.array(slots, dtype=np.int64)

    def compute_slot_mapping_tensor(self, req_indices: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """:meth:`compute_slot_mapping` as a ``slot_mapping_dtype`` tensor on the table's device."""
        slots = self.compute_slot_mapping(req_indices, positions)
        return torch.from_numpy(slots).to(device=self.device, dtype=self.slot_mapping_dtype)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """int32 [num_reqs, max_num_blocks_per_req] device copy of the first ``num_reqs`` rows (on CPU a view of the
        host table: valid until the rows are next edited, i.e. for the step it was taken for)."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs must be in [0, {self.max_num_reqs}], got {num_reqs}.")
        if self.device.type != "cpu":
            self._device_table[:num_reqs].copy_(torch.from_numpy(self.block_table_np[:num_reqs]), non_blocking=True)
            return self._device_table[:num_reqs]
        view = self._host_views.get(num_reqs)  # (a tensor slice costs ~15-40 us in a decode step's caches)
        if view is None:
            with torch.inference_mode(False):  # a normal view, usable inside and outside inference mode
                view = self._host_views[num_reqs] = self._device_table[:num_reqs]
        return view

    # --- helpers ---------------------------------------------------------------------------------------------------
    def _to_kernel_ids(self, block_ids: Sequence[int]) -> np.ndarray:
        if self.blocks_per_kv_block == 1:
            return np.asarray(block_ids, dtype=np.int64).reshape(-1)
        return expand_to_kernel_blocks(block_ids, self.blocks_per_kv_block)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row must be in [0, {self.max_num_reqs}), got {row}.")

    def _check_lookup(self, rows: np.ndarray, pos: np.ndarray, virtual_block: np.ndarray) -> None:
        if rows.size == 0:
            return
        if rows.max() >= self.max_num_reqs:
            raise ValueError(f"req_indices must be < max_num_reqs={self.max_num_reqs}, got {int(rows.max())}.")
        if pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}.")
        beyond = virtual_block >= self.num_blocks_per_row[rows]
        if beyond.any():
            t = int(np.argmax(beyond))
            raise ValueError(
                f"position {int(pos[t])} of row {int(rows[t])} lies in block {int(virtual_block[t])}, but the row "
                f"holds {int(self.num_blocks_per_row[rows[t]])} blocks."
            )


class MultiGroupBlockTable:
    """One :class:`BlockTable` per KV-cache group; row edits take one block-id list per group."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: Sequence[int],
        block_sizes: Sequence[int],
        device: torch.device,
        kernel_block_sizes: Sequence[int] | None = None,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        cp_kv_cache_interleave_size: int = 1,
        slot_mapping_dtype: torch.dtype = torch.int64,
    ) -> None:
        if len(max_num_blocks_per_req) != len(block_sizes):
            raise ValueError(
                f"max_num_blocks_per_req {list(max_num_blocks_per_req)} needs one entry per block size "
                f"{list(block_sizes)}."
            )
        kernels = list(kernel_block_sizes) if kernel_block_sizes is not None else list(block_sizes)
        if len(kernels) != len(block_sizes):
            raise ValueError(f"kernel_block_sizes {kernels} needs one entry per block size {list(block_sizes)}.")
        self.block_tables = [
            BlockTable(
                max_num_reqs, n, bs, device, dcp_world_size, dcp_rank, cp_kv_cache_interleave_size,
                slot_mapping_dtype, kernel_block_size=kb,
            )
            for n, bs, kb in zip(max_num_blocks_per_req, block_sizes, kernels)
        ]

    def __getitem__(self, group: int) -> BlockTable:
        return self.block_tables[group]

    def _per_group(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(f"Expected one block-id list per group ({len(self.block_tables)}), got {len(block_ids)}.")

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._per_group(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table.add_row(ids, row)

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._per_group(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table.append_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.block_tables:
            table.clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.block_tables:
            table.swap_row(a, b)

    def compute_slot_mappings(self, req_indices: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
        return [table.compute_slot_mapping(req_indices, positions) for table in self.block_tables]


def _validate(max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, kernel_block_size: int) -> None:
    for name, value in (
        ("max_num_reqs", max_num_reqs),
        ("max_num_blocks_per_req", max_num_blocks_per_req),
        ("block_size", block_size),
        ("kernel_block_size", kernel_block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if block_size % kernel_block_size:
        raise ValueError(f"kernel_block_size {kernel_block_size} must divide block_size {block_size}.")


def _validate_dcp(world: int, rank: int, interleave: int, block_size: int) -> None:
    if world < 1:
        raise ValueError(f"dcp_world_size must be >= 1, got {world}.")
    if not 0 <= rank < world:
        raise ValueError(f"dcp_rank must be in [0, {world}), got {rank}.")
    if interleave < 1 or block_size % interleave:
        raise ValueError(
            f"cp_kv_cache_interleave_size must be >= 1 and divide the block size {block_size}, got {interleave}."
        )
