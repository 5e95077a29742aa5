"""Shared helpers for the KV-cache tests."""

from __future__ import annotations

from ascent.core.kv_cache.hashing import make_block_hasher
from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request
from ascent.sampling_params import SamplingParams


def make_request(
    request_id: str,
    tokens: list[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    return Request(
        request_id,
        tokens,
        SamplingParams(prompt_logprobs=prompt_logprobs),
        block_hasher=make_block_hasher(block_size),
        lora_name=lora_name,
        cache_salt=cache_salt,
    )


def admit(mgr: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> int:
    """Prefix lookup + allocation the way the scheduler admits a request; returns the hit tokens."""
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    blocks = mgr.allocate_slots(req, n, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert blocks is not None
    req.num_computed_tokens = num_hit + n
    return num_hit


def pool_snapshot(mgr: KVCacheManager, request_ids: list[str]) -> tuple:
    pool = mgr.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {r: mgr.get_block_ids(r) for r in request_ids},
        pool.num_cached_blocks,
    )
