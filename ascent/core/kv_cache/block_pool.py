"""Physical KV blocks: ref counts, the LRU free queue and the prefix-cache map (engine_core spec §2.1).

Invariants maintained by :class:`BlockPool`:

* block 0 is the *null block*: never handed out, never cached, never freed, its ref count is not maintained;
* a block is in the free queue iff its ``ref_cnt == 0`` (null block excepted, it is never in the queue);
* the free queue is in eviction order: the front is the least recently used block;
* a block carries a ``block_hash`` iff it is in the prefix map; a cached block may be free (evictable) or in use;
* several blocks may carry the same hash (no de-duplication, so block tables stay append-only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class _HasBlockHashes(Protocol):
    request_id: str
    block_hashes: list[bytes]


class KVCacheBlock:
    """One physical KV block. ``prev_free``/``next_free`` link it into the free queue (None when not queued)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


def make_cache_key(block_hash: bytes, group_id: int) -> bytes:
    """Prefix-map key: the block hash followed by the 4-byte big-endian KV-cache group id."""
    return block_hash + group_id.to_bytes(4, "big")


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head/tail: O(1) popleft, append and remove-from-middle.

    The front is evicted (reused) first. Only the ``prev_free``/``next_free`` fields of the blocks are touched.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free blocks left in the free queue (num_free_blocks=0).")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks, only {self.num_free_blocks} are free.")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"Block {block.block_id} is already in the free queue.")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks from front (next evicted) to back (most recently freed)."""
        out: list[KVCacheBlock] = []
        cur = self._head.next_free
        while cur is not None and cur is not self._tail:
            out.append(cur)
            cur = cur.next_free
        return out


class BlockPool:
    """All physical blocks of the KV cache, shared by every KV-cache group.

    ``num_blocks`` ids 0..N-1 exist; block 0 is the null block, so N-1 are usable. With ``enable_caching=False``
    no block is ever put in the prefix map.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self._cached: dict[bytes, dict[int, KVCacheBlock]] = {}

    # --- queries ---------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use: ``1 - free / (N - 1)``."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(v) for v in self._cached.values())

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        out: list[KVCacheBlock] = []
        for gid in group_ids:
            entry = self._cached.get(make_cache_key(block_hash, gid))
            if not entry:
                return None
            out.append(next(iter(entry.values())))
        return out

    # --- allocation ------------------------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the front of the free queue (evicting their cache entries); ref_cnt = 1."""
        if num_blocks < 0 or num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} new blocks, {self.num_free_blocks} are free.")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self._maybe_evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a block at ref 0 leaves the free queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per listed block; blocks reaching 0 are appended to the free queue in list order.

        Raises ValueError (and changes nothing) if a block would be freed more often than it is referenced.
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        pending: dict[int, int] = {}
        for block in blocks:
            pending[block.block_id] = pending.get(block.block_id, 0) + 1
            if pending[block.block_id] > block.ref_cnt:
                raise ValueError(f"Double free of block {block.block_id} (ref_cnt={block.ref_cnt}).")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # --- prefix cache ----------------------------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: _HasBlockHashes,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Insert ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix map under ``request.block_hashes``.

        The hashes must already be computed (``len(request.block_hashes) >= num_full_blocks``); null blocks are
        skipped; a block may be cached only once.
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"Request {request.request_id!r} has {len(request.block_hashes)} block hashes, "
                f"cannot cache {num_full_blocks} full blocks."
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, block
            block.block_hash = request.block_hashes[i]
            block.group_id = group_id
            key = make_cache_key(block.block_hash, group_id)
            self._cached.setdefault(key, {})[block.block_id] = block

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop ``blocks`` from the prefix map (they stay allocated): their contents will never be computed."""
        for block in blocks:
            self._maybe_evict(block)

    def _maybe_evict(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        key = make_cache_key(block.block_hash, block.group_id)
        entry = self._cached.get(key)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self._cached[key]
        block.block_hash = None
        block.group_id = 0
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-map entry. Succeeds (True) only when no usable block is in use."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = 0
        return True
