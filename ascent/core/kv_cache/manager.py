"""Paged KV-cache manager: prefix-cache lookup, slot allocation and freeing (engine_core spec §2.3).

One full-attention KV-cache group for now. The per-group bookkeeping lives in :class:`FullAttentionManager` so a
hybrid coordinator can later hold one manager per group over the same :class:`BlockPool`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ascent.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from ascent.core.kv_cache.spec import cdiv
from ascent.core.request import Request

logger = logging.getLogger(__name__)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last :meth:`KVCacheManager.make_prefix_cache_stats` call.

    ``queries`` counts prompt tokens looked up, ``hits`` the tokens found; requests that were preempted before
    are counted separately in the ``preempted_*`` fields. ``reset`` is True if the cache was reset meanwhile.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class FullAttentionManager:
    """Block lists of the requests in one full-attention group.

    Invariants: ``req_to_blocks[r]`` is append-only while ``r`` runs and holds one reference on each block;
    ``num_cached_block[r]`` blocks at its front are in the prefix map (or were hits).
    """

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int = 0) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """Cached blocks for the longest prefix of ``block_hashes`` that fits in ``max_length`` tokens."""
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[: max(max_length, 0) // self.block_size]:
            cached = self.block_pool.get_cached_block(block_hash, [self.group_id])
            if cached is None:
                break
            hits.append(cached[0])
        return hits

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Free-queue blocks needed: fresh blocks up to ``num_tokens`` plus hit blocks that are now evictable."""
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(cdiv(num_tokens, self.block_size) - held - len(new_computed_blocks), 0)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = list(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"Request {request_id!r} already holds blocks; it cannot take new prefix hits.")

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks covering its first ``num_tokens`` tokens into the prefix map."""
        num_cached = self.num_cached_block[request.request_id]
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, self.group_id)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks tail first, so a chain's later blocks are evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        count = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count


class KVCacheManager:
    """Scheduler-facing KV-cache manager over ``num_blocks`` blocks of ``block_size`` tokens.

    Protocol: ``get_computed_blocks`` once at admission, then ``allocate_slots(req, n, hit_tokens, hit_blocks)``;
    later steps ``allocate_slots(req, n)`` with ``request.num_computed_tokens`` = tokens computed *before* the step;
    ``free(req)`` on preemption or finish. ``request.block_hashes`` must be built with the same ``block_size``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}.")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.single_manager = FullAttentionManager(self.block_pool, block_size, group_id=0)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self._new_block_ids: dict[int, None] = {}

    # --- metrics ---------------------------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones (None when ``log_stats`` is off)."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # --- lookup ----------------------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: (hit blocks, hit tokens), hit tokens ≤ ``num_tokens - 1``.

        Returns ([], 0) when caching is off or the request wants prompt logprobs. Does not take references.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._check_hashes(request)
        hits = self.single_manager.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        num_hit_tokens = len(hits) * self.block_size
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)
        return hits, num_hit_tokens

    # --- allocation ------------------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Reserve KV slots for ``num_new_tokens`` (+ lookahead) tokens after the computed prefix.

        Returns the newly allocated blocks (not the hit blocks), or None — with no state changed — when the free
        queue cannot supply them. On success the hit blocks are referenced and every full block up to
        ``min(computed + num_new_computed_tokens + num_new_tokens, request.num_tokens)`` is cached.
        """
        if not new_computed_blocks and num_new_computed_tokens == 0 and self._fits_held_blocks(
                request, num_new_tokens, num_lookahead_tokens):
            return []
        hits = list(new_computed_blocks or [])
        self._validate_allocation(request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens)
        mgr = self.single_manager
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_need_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
        if self.enable_caching and num_to_cache // self.block_size > mgr.num_cached_block.get(request.request_id, 0):
            self._check_hashes(request)
        needed = mgr.get_num_blocks_to_allocate(request.request_id, num_need_slots, hits)
        if needed > self.block_pool.num_free_blocks:
            return None
        if self.enable_caching:
            self.block_pool.touch(hits)
        mgr.save_new_computed_blocks(request.request_id, hits)
        new_blocks = mgr.allocate_new_blocks(request.request_id, num_need_slots)
        for block in new_blocks:
            self._new_block_ids[block.block_id] = None
        if self.enable_caching:
            mgr.cache_blocks(request, num_to_cache)
        return new_blocks

    def _fits_held_blocks(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """Whether ``allocate_slots`` without prefix hits would change nothing and return no blocks: the slots fit in
        the blocks the request holds and no block became full (most decode steps). Negative counts go the full path,
        which rejects them."""
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            return False
        mgr = self.single_manager
        held = mgr.req_to_blocks.get(request.request_id)
        if held is None:
            return False
        num_computed = request.num_computed_tokens
        num_need_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if cdiv(num_need_slots, self.block_size) > len(held):
            return False
        num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
        return not self.enable_caching or num_to_cache // self.block_size <= mgr.num_cached_block.get(
            request.request_id, 0)

    def _validate_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> None:
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        if hits and not self.enable_caching:
            raise ValueError(f"new_computed_blocks given ({len(hits)} blocks) while prefix caching is disabled.")
        if hits and request.request_id in self.single_manager.req_to_blocks:
            raise ValueError(f"Request {request.request_id!r} already holds blocks; it cannot take new prefix hits.")
        if len(hits) != cdiv(num_new_computed_tokens, self.block_size):
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match {len(hits)} new computed blocks "
                f"of {self.block_size} tokens."
            )

    def _check_hashes(self, request: Request) -> None:
        expected = request.num_tokens // self.block_size
        if len(request.block_hashes) != expected:
            raise ValueError(
                f"Request {request.request_id!r} has {len(request.block_hashes)} block hashes for "
                f"{request.num_tokens} tokens; expected {expected} (block_hasher missing or built with another "
                f"block size than {self.block_size})."
            )

    # --- release ---------------------------------------------------------------------------------------------------
    def uncache_uncomputed(self, request: Request) -> None:
        """Take the blocks past the request's computed prefix out of the prefix map. ``allocate_slots`` caches the
        blocks a step will fill; a request preempted in the step that scheduled it never fills them, and a later
        prefix hit on them would read garbage."""
        mgr = self.single_manager
        blocks = mgr.req_to_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        cached = mgr.num_cached_block.get(request.request_id, 0)
        if cached > first:
            self.block_pool.uncache(blocks[first:cached])
            mgr.num_cached_block[request.request_id] = first

    def free(self, request: Request) -> None:
        """Release the request's blocks in reverse order (they stay cached until evicted). Idempotent."""
        self.single_manager.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible (True) when no block is in use."""
        if not self.block_pool.reset_prefix_cache():
            in_use = self.num_blocks - 1 - self.num_free_blocks
            logger.warning("Failed to reset the prefix cache: %d blocks are still in use.", in_use)
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # --- queries ---------------------------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.single_manager.req_to_blocks.get(request_id, ()))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Full block table of the request (hit blocks then allocated ones); [] for unknown ids."""
        return [b.block_id for b in self.single_manager.req_to_blocks.get(request_id, ())]

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """Leading blocks of ``request`` referenced by every running request (cascade-attention hint)."""
        return self.single_manager.get_num_common_prefix_blocks(request.request_id, num_running_requests)

    def take_new_block_ids(self) -> list[int]:
        """Block ids allocated since the last call, each once, in allocation order (zeroing hook, spec §2.10)."""
        ids = list(self._new_block_ids)
        self._new_block_ids.clear()
        return ids
