"""KVCacheManager against analytic prefix-hit counts and the eviction rules of spec §2.1/§2.3."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request
from ascent.sampling_params import SamplingParams
from tests.unit.kv_cache.helpers import admit, make_request, pool_snapshot


def _decode(mgr: KVCacheManager, req: Request, steps: int, token: int = 9) -> None:
    """Run ``steps`` decode steps: the sampled token is appended, then one slot is allocated for it."""
    for _ in range(steps):
        req.append_output_token_ids(token)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 31, 32, 33, 64])
def test_fully_cached_prompt_hits_floor_formula(bs: int, length: int) -> None:
    mgr = KVCacheManager(num_blocks=200, block_size=bs, max_model_len=512)
    prompt = list(range(length))
    assert admit(mgr, make_request("a", prompt, bs)) == 0
    assert admit(mgr, make_request("b", prompt, bs)) == (length - 1) // bs * bs


@settings(max_examples=60, deadline=None)
@given(
    common=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    tail_a=st.lists(st.integers(4, 5), min_size=0, max_size=20),
    tail_b=st.lists(st.integers(6, 7), min_size=1, max_size=20),
    bs=st.sampled_from([1, 2, 4, 8]),
)
def test_shared_prefix_hits(common: list[int], tail_a: list[int], tail_b: list[int], bs: int) -> None:
    mgr = KVCacheManager(num_blocks=64, block_size=bs, max_model_len=256)
    a, b = common + tail_a, common + tail_b
    admit(mgr, make_request("a", a, bs))
    expected = min(len(common) // bs, (len(b) - 1) // bs, len(a) // bs) * bs
    assert admit(mgr, make_request("b", b, bs)) == expected


def test_salt_and_lora_isolate_the_cache() -> None:
    bs, prompt = 4, list(range(20))
    mgr = KVCacheManager(num_blocks=64, block_size=bs, max_model_len=64)
    admit(mgr, make_request("salted", prompt, bs, cache_salt="s1"))
    assert admit(mgr, make_request("plain", prompt, bs)) == 0
    assert admit(mgr, make_request("other-salt", prompt, bs, cache_salt="s2")) == 0
    assert admit(mgr, make_request("same-salt", prompt, bs, cache_salt="s1")) == 16
    assert admit(mgr, make_request("lora", prompt, bs, lora_name="x")) == 0
    assert admit(mgr, make_request("lora2", prompt, bs, lora_name="x")) == 16


def test_prompt_logprobs_skip_reading_and_stats() -> None:
    bs, prompt = 4, list(range(12))
    mgr = KVCacheManager(num_blocks=32, block_size=bs, max_model_len=64)
    admit(mgr, make_request("a", prompt, bs))
    assert admit(mgr, make_request("b", prompt, bs, prompt_logprobs=1)) == 0
    assert admit(mgr, make_request("c", prompt, bs)) == 8
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert mgr.make_prefix_cache_stats().requests == 0
    assert KVCacheManager(4, 4, 16, log_stats=False).make_prefix_cache_stats() is None


def test_allocation_failure_changes_nothing() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=6, block_size=bs, max_model_len=64)  # 5 usable blocks
    a = make_request("a", list(range(12)), bs)
    admit(mgr, a)
    mgr.free(a)  # 3 cached, evictable blocks
    b = make_request("b", list(range(13)), bs)
    admit(mgr, b, num_new_tokens=1)  # hits 12 tokens (3 blocks), 1 new block
    c = make_request("c", list(range(12)) + [50] * 9, bs)  # shares 3 blocks, needs 3 more: only 1 free
    hits, n_hit = mgr.get_computed_blocks(c)
    assert n_hit == 12
    before = pool_snapshot(mgr, ["a", "b", "c"])
    assert mgr.allocate_slots(c, 9, n_hit, hits) is None
    assert pool_snapshot(mgr, ["a", "b", "c"]) == before
    assert mgr.allocate_slots(b, 4 * 5) is None
    assert pool_snapshot(mgr, ["a", "b", "c"]) == before


def test_evictable_hits_count_against_free_blocks() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=4, block_size=bs, max_model_len=64)  # 3 usable
    a = make_request("a", list(range(8)), bs)
    admit(mgr, a)
    mgr.free(a)
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5], bs)
    hits, n_hit = mgr.get_computed_blocks(b)
    assert n_hit == 8
    # 2 evictable hits + 2 new blocks = 4 > 3 free.
    assert mgr.allocate_slots(b, 5, n_hit, hits) is None
    assert mgr.allocate_slots(b, 4, n_hit, hits) is not None
    assert mgr.num_free_blocks == 0


def test_all_blocks_free_after_all_requests_freed() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=40, block_size=bs, max_model_len=128)
    reqs = [make_request(f"r{i}", list(range(i, i + 10 + i)), bs) for i in range(5)]
    for r in reqs:
        admit(mgr, r)
        _decode(mgr, r, 6)
    assert mgr.usage > 0
    for r in reversed(reqs):
        mgr.free(r)
        mgr.free(r)  # idempotent
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 39
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)


def test_generated_tokens_are_cached_and_rehit_after_preemption() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64)
    r = make_request("r", list(range(10)), bs)
    admit(mgr, r)
    _decode(mgr, r, 3)  # 13 tokens, 12 computed -> blocks 0..2 full and cached
    assert r.num_tokens == 13 and mgr.block_pool.num_cached_blocks == 3
    mgr.free(r)
    r.num_computed_tokens, r.num_preemptions = 0, 1
    assert admit(mgr, r) == 12
    stats = mgr.make_prefix_cache_stats()
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 13, 12)


@pytest.mark.parametrize("caching", [True, False])
def test_decode_steps_allocate_and_cache_only_at_block_edges(caching: bool) -> None:
    """A decode step whose slot fits in the held blocks and fills no block returns no blocks and changes nothing (the
    fast path); the step that fills a block caches it, the step past it allocates one block."""
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64, enable_caching=caching)
    r = make_request("r", list(range(5)), bs)
    admit(mgr, r)  # 5 tokens: blocks 0 (full) and 1
    for step in range(10):
        r.append_output_token_ids(9)  # token 6 + step; its slot is position 5 + step
        before = pool_snapshot(mgr, ["r"])
        blocks = mgr.allocate_slots(r, 1)
        position = r.num_computed_tokens
        r.num_computed_tokens += 1
        assert blocks is not None and len(blocks) == (1 if position % bs == 0 else 0), step
        if position % bs == 0:
            assert mgr.get_block_ids("r")[-1] == blocks[0].block_id
        elif (position + 1) % bs != 0:
            assert pool_snapshot(mgr, ["r"]) == before, step
        assert mgr.block_pool.num_cached_blocks == (min(r.num_computed_tokens, r.num_tokens) // bs if caching else 0)
    with pytest.raises(ValueError, match="num_new_tokens.*-1"):
        mgr.allocate_slots(r, -1)


def test_reverse_free_order_evicts_chain_tail_first() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=9, block_size=bs, max_model_len=64)  # 8 usable
    r = make_request("r", list(range(14)), bs)  # 4 blocks, 3 full
    admit(mgr, r)
    ids = mgr.get_block_ids("r")
    mgr.free(r)
    queue = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue[-4:] == ids[::-1]
    # A filler takes the 4 never-used blocks, the unhashed partial block and the cached tail block (index 2).
    filler = make_request("f", [99] * 24, bs)
    admit(mgr, filler)
    assert set(mgr.get_block_ids("f")) == set(range(5, 9)) | set(ids[2:])
    mgr.free(filler)
    r.num_computed_tokens, r.num_preemptions = 0, 1
    assert admit(mgr, r, num_new_tokens=1) == 8


def test_lru_order_across_requests() -> None:
    bs = 2
    mgr = KVCacheManager(num_blocks=5, block_size=bs, max_model_len=64)  # 4 usable
    a, b = make_request("a", [1, 1, 1], bs), make_request("b", [2, 2, 2], bs)
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)  # a's blocks are older -> evicted first
    admit(mgr, make_request("c", [3, 3, 3, 3], bs))
    assert admit(mgr, make_request("b2", [2, 2, 2], bs), num_new_tokens=1) == 2
    mgr.free(make_request("c", [], bs))
    assert mgr.get_computed_blocks(make_request("a2", [1, 1, 1], bs)) == ([], 0)


def test_lookahead_slots_are_allocated_but_never_cached() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64)
    r = make_request("r", list(range(6)), bs)
    new = mgr.allocate_slots(r, 6, num_lookahead_tokens=5)
    assert len(new) == 3 and mgr.block_pool.num_cached_blocks == 1
    clamped = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=8)
    assert len(clamped.allocate_slots(make_request("x", list(range(6)), bs), 6, num_lookahead_tokens=5)) == 2


def test_reset_prefix_cache_only_when_idle() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64)
    a = make_request("a", list(range(9)), bs)
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.block_pool.num_cached_blocks == 0
    assert admit(mgr, make_request("b", list(range(9)), bs)) == 0
    assert mgr.make_prefix_cache_stats().reset is True


def test_common_prefix_blocks_and_block_ids() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=32, block_size=bs, max_model_len=64)
    reqs = [make_request(f"r{i}", list(range(8)) + [100 + i] * 5, bs) for i in range(3)]
    for r in reqs:
        admit(mgr, r)
    shared = mgr.get_block_ids("r0")[:2]
    assert all(mgr.get_block_ids(r.request_id)[:2] == shared for r in reqs)
    assert mgr.get_num_common_prefix_blocks(reqs[2], 3) == 2
    assert mgr.get_num_common_prefix_blocks(reqs[2], 4) == 0
    assert mgr.get_block_ids("unknown") == []


def test_take_new_block_ids_reports_each_allocation_once() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64)
    a = make_request("a", list(range(9)), bs)
    admit(mgr, a)
    assert mgr.take_new_block_ids() == mgr.get_block_ids("a")
    b = make_request("b", list(range(9)), bs)
    admit(mgr, b)  # 2 hit blocks are not new
    assert mgr.take_new_block_ids() == mgr.get_block_ids("b")[2:]
    assert mgr.take_new_block_ids() == []


def test_caching_disabled() -> None:
    bs = 4
    mgr = KVCacheManager(num_blocks=16, block_size=bs, max_model_len=64, enable_caching=False)
    plain = Request("a", list(range(9)), SamplingParams())
    admit(mgr, plain)
    assert mgr.block_pool.num_cached_blocks == 0
    assert mgr.get_computed_blocks(Request("b", list(range(9)), SamplingParams())) == ([], 0)
    with pytest.raises(ValueError, match="disabled"):
        mgr.allocate_slots(Request("c", [1], SamplingParams()), 1, 4, [mgr.block_pool.blocks[1]])


def test_validation_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="num_blocks.*1"):
        KVCacheManager(num_blocks=1, block_size=4, max_model_len=8)
    with pytest.raises(ValueError, match="block_size.*0"):
        KVCacheManager(num_blocks=4, block_size=0, max_model_len=8)
    mgr = KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    r = make_request("r", list(range(9)), 4)
    with pytest.raises(ValueError, match="num_new_tokens.*-1"):
        mgr.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens=4"):
        mgr.allocate_slots(r, 1, 4, [])
    with pytest.raises(ValueError, match="block hashes"):
        mgr.get_computed_blocks(Request("nohash", list(range(9)), SamplingParams()))
    with pytest.raises(ValueError, match="block hashes"):
        mgr.allocate_slots(make_request("wrong-bs", list(range(9)), 2), 9)
    assert mgr.num_free_blocks == 7 and mgr.get_block_ids("wrong-bs") == []
    admit(mgr, r)
    other = make_request("o", list(range(9)), 4)
    hits, n = mgr.get_computed_blocks(other)
    with pytest.raises(ValueError, match="already holds"):
        mgr.allocate_slots(r, 1, n, hits)
