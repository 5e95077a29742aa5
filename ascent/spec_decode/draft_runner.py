"""The paged KV cache and forward driver of a drafter that has its own attention layers (draft model, EAGLE, MTP).

Memory: the worker sizes the KV cache from ONE budget. ``ModelRunner.kv_cache_bytes_per_block`` adds the drafter's
bytes per block (:meth:`DraftModelRunner.kv_cache_bytes_per_block`, from each draft attention layer's backend cache
shape) to the target's, so ``num_blocks = budget // (target_bytes + draft_bytes)``; the target's block pool and the
drafter's pool (:class:`DraftModelRunner`, its own ``BlockPool`` without prefix caching) then hold ``num_blocks``
blocks each. ``num_gpu_blocks_override`` gives both pools that many blocks.

Per request the drafter keeps its own block list and block-table row covering absolute positions ``[start, end)``:
``start`` is 0 unless the drafter could not see the first positions (an EAGLE/MTP head needs the target's hidden
states, which a prefix-cache hit skips): then the draft attends only to ``start..``. ``num_computed`` marks the
positions whose draft KV is valid; rolling back rejected drafts sets it back to the committed length (the rejected
slots are overwritten later). A request's blocks are freed by :meth:`remove` (finished or preempted request). If the
pool runs dry the request is dropped (it gets no drafts until blocks are free again); the output never depends on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ascent.attention.backend import CommonAttentionMetadata, make_metadata_builder
from ascent.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from ascent.forward_context import set_forward_context
from ascent.worker.block_table import BlockTable


def is_kv_layer(module: nn.Module) -> bool:
    """Modules owning a paged KV cache (``Attention`` and MLA), duck-typed like the model runner does."""
    return all(hasattr(module, a) for a in ("layer_name", "kv_cache", "backend", "num_kv_heads", "head_size"))


@dataclass
class DraftEnv:
    """Engine facts a drafter needs: where and how to build its model and cache."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_model_len: int
    load_format: str = "auto"
    target_model_path: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _DraftRequest:
    row: int
    start: int
    num_computed: int
    blocks: list[KVCacheBlock] = field(default_factory=list)


class DraftModelRunner:
    """Owns the draft attention layers' caches, a block pool, per-request block tables and the forward context."""

    def __init__(self, model: nn.Module, env: DraftEnv, max_extra_tokens: int) -> None:
        self.model = model
        self.env = env
        self.layers = [m for m in model.modules() if is_kv_layer(m)]
        if not self.layers:
            raise ValueError(f"draft model {type(model).__name__} has no attention layers")
        self.block_size = env.block_size
        max_blocks = -(-(env.max_model_len + max_extra_tokens + 1) // env.block_size)
        self.block_table = BlockTable(env.max_num_seqs, max_blocks, env.block_size, env.device)
        self.builder = make_metadata_builder(self.layers[0].backend, max_model_len=env.max_model_len + max_extra_tokens,
                                             max_num_seqs=env.max_num_seqs, chunked_prefill=True)
        self.pool: BlockPool | None = None
        self.requests: dict[str, _DraftRequest] = {}
        self._free_rows = list(range(env.max_num_seqs - 1, -1, -1))

    # ------------------------------------------------------------------------------------------------ cache
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block over all draft layers (each backend's own cache shape)."""
        elem = torch.tensor([], dtype=self.env.dtype).element_size()
        return sum(math.prod(layer.backend.get_kv_cache_shape(1, self.block_size, layer.num_kv_heads,
                                                               layer.head_size)) * elem for layer in self.layers)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per draft layer and bind them to the layers."""
        for layer in self.layers:
            shape = layer.backend.get_kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads,
                                                     layer.head_size)
            layer.kv_cache = torch.zeros(shape, dtype=self.env.dtype, device=self.env.device)
        self.pool = BlockPool(num_blocks, enable_caching=False)

    @property
    def num_free_blocks(self) -> int:
        return 0 if self.pool is None else self.pool.num_free_blocks

    # ------------------------------------------------------------------------------------------------ requests
    def num_computed(self, req_id: str) -> int | None:
        """End of the valid draft KV of ``req_id`` (absolute position), None when the request is not held."""
        state = self.requests.get(req_id)
        return None if state is None else state.num_computed

    def start(self, req_id: str) -> int:
        return self.requests[req_id].start

    def reset(self, req_id: str, start: int) -> None:
        """(Re)start ``req_id`` with an empty draft KV whose first position is ``start``."""
        self.remove(req_id)
        row = self._free_rows.pop()
        self.requests[req_id] = _DraftRequest(row=row, start=start, num_computed=start)
        self.block_table.clear_row(row)

    def remove(self, req_id: str) -> None:
        """Free the request's blocks and row (no-op for an unknown id)."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        assert self.pool is not None
        self.pool.free_blocks(reversed(state.blocks))
        self.block_table.clear_row(state.row)
        self._free_rows.append(state.row)

    def ensure_slots(self, req_id: str, end: int) -> bool:
        """Make positions ``< end`` addressable; False (nothing allocated) when the pool is short of blocks."""
        assert self.pool is not None, "initialize_kv_cache() was not called"
        state = self.requests[req_id]
        need = -(-(end - state.start) // self.block_size) - len(state.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        new = self.pool.get_new_blocks(need)
        state.blocks.extend(new)
        self.block_table.append_row([b.block_id for b in new], state.row)
        return True

    def set_computed(self, req_id: str, num_computed: int) -> None:
        """Positions ``[start, num_computed)`` hold valid draft KV (rollback: a smaller value than before)."""
        state = self.requests[req_id]
        assert state.start <= num_computed, (state.start, num_computed)
        state.num_computed = num_computed

    # ------------------------------------------------------------------------------------------------ forward
    def metadata(self, req_ids: list[str], first_positions: np.ndarray, num_tokens: np.ndarray) -> Any:
        """Backend metadata for a batch where request ``i`` feeds ``num_tokens[i]`` tokens at absolute positions
        ``first_positions[i] ..``; its draft KV before ``first_positions[i]`` must be valid (from ``start``)."""
        states = [self.requests[r] for r in req_ids]
        rows = np.array([s.row for s in states], dtype=np.int64)
        starts = np.array([s.start for s in states], dtype=np.int64)
        num = np.asarray(num_tokens, dtype=np.int64)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(num, out=qsl[1:])
        computed = (np.asarray(first_positions, dtype=np.int64) - starts).astype(np.int32)
        seq_lens = (computed + num).astype(np.int32)
        req_idx = np.repeat(np.arange(len(req_ids)), num)
        local = computed[req_idx] + np.arange(int(qsl[-1])) - qsl[req_idx]
        slots = self.block_table.compute_slot_mapping(rows[req_idx], local)
        dev = self.env.device
        table = self.block_table.get_device_tensor(self.env.max_num_seqs)[torch.from_numpy(rows).to(dev)]
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev), seq_lens=torch.from_numpy(seq_lens).to(dev),
            num_computed_tokens=torch.from_numpy(computed).to(dev), block_table=table,
            slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc_np=qsl, seq_lens_np=seq_lens,
            num_computed_tokens_np=computed, num_reqs=len(req_ids), num_actual_tokens=int(qsl[-1]),
            max_query_len=int(num.max()), max_seq_len=int(seq_lens.max()), block_size=self.block_size)
        return self.builder.build(common)

    def run(self, attn_metadata: Any, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` (the draft forward) with the draft attention metadata installed."""
        with set_forward_context(attn_metadata):
            return fn(*args)
