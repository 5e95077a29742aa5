"""BlockPool against an independent OrderedDict LRU model (hypothesis state machine) plus direct unit checks."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ascent.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock

HASHES = [bytes([i]) * 32 for i in range(4)]


@dataclass
class _FakeRequest:
    block_hashes: list[bytes]
    request_id: str = "fake"


class PoolVsLRUModel(RuleBasedStateMachine):
    """Model: ``free`` is an OrderedDict in eviction order, ``ref`` the ref counts, ``hash_of`` the cached hashes."""

    @initialize(num_blocks=st.integers(2, 10))
    def init(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.pool = BlockPool(num_blocks)
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.ref = {i: 0 for i in range(1, num_blocks)}
        self.hash_of: dict[int, bytes] = {}

    def _blocks(self, ids: list[int]) -> list[KVCacheBlock]:
        return [self.pool.blocks[i] for i in ids]

    def _held(self) -> list[int]:
        return [i for i, r in self.ref.items() if r > 0]

    @rule(k=st.integers(0, 12))
    def get_new_blocks(self, k: int) -> None:
        if k > len(self.free):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(k)
            return
        got = self.pool.get_new_blocks(k)
        expected = [self.free.popitem(last=False)[0] for _ in range(k)]
        assert [b.block_id for b in got] == expected
        for i in expected:
            self.hash_of.pop(i, None)
            self.ref[i] = 1

    @precondition(lambda self: any(r > 0 for r in self.ref.values()) or self.hash_of)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        candidates = sorted(set(self._held()) | set(self.hash_of))
        ids = data.draw(st.lists(st.sampled_from(candidates), max_size=4))
        self.pool.touch(self._blocks(ids) + [self.pool.null_block])
        for i in ids:
            if self.ref[i] == 0:
                del self.free[i]
            self.ref[i] += 1

    @precondition(lambda self: any(r > 0 for r in self.ref.values()))
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        ids = data.draw(st.permutations(self._held()))
        ids = ids[: data.draw(st.integers(1, len(ids)))]
        self.pool.free_blocks(self._blocks(ids))
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free[i] = None

    @precondition(lambda self: len(self.free) > 0)
    @rule(data=st.data())
    def double_free_is_rejected(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from(list(self.free)))
        held = self._held()
        with pytest.raises(ValueError, match=str(victim)):
            self.pool.free_blocks(self._blocks(held[:1] + [victim]))

    @precondition(lambda self: any(r > 0 and i not in self.hash_of for i, r in self.ref.items()))
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, h: bytes) -> None:
        i = data.draw(st.sampled_from([i for i in self._held() if i not in self.hash_of]))
        self.pool.cache_full_blocks(_FakeRequest([h]), [self.pool.blocks[i]], 0, 1, group_id=0)
        self.hash_of[i] = h

    @rule(h=st.sampled_from(HASHES))
    def lookup(self, h: bytes) -> None:
        owners = {i for i, x in self.hash_of.items() if x == h}
        got = self.pool.get_cached_block(h, [0])
        if owners:
            assert got is not None and got[0].block_id in owners
        else:
            assert got is None
        assert self.pool.get_cached_block(h, [1]) is None

    @rule()
    def reset_prefix_cache(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == all(r == 0 for r in self.ref.values())
        if ok:
            self.hash_of.clear()

    @invariant()
    def pool_matches_model(self) -> None:
        queue = self.pool.free_block_queue.get_all_free_blocks()
        assert [b.block_id for b in queue] == list(self.free)
        assert self.pool.num_free_blocks == len(self.free)
        for i in range(1, self.n):
            assert self.pool.blocks[i].ref_cnt == self.ref[i]
            assert self.pool.blocks[i].block_hash == self.hash_of.get(i)
        assert self.pool.num_cached_blocks == len(self.hash_of)
        assert self.pool.usage == pytest.approx(1 - len(self.free) / (self.n - 1))

    @invariant()
    def null_block_untouched(self) -> None:
        null = self.pool.null_block
        assert null.block_id == 0 and null.is_null
        assert null.ref_cnt == 0 and null.block_hash is None
        assert null.prev_free is None and null.next_free is None


PoolVsLRUModel.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestPoolVsLRUModel = PoolVsLRUModel.TestCase


def test_initial_free_queue_is_in_id_order_without_null_block() -> None:
    pool = BlockPool(6)
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [1, 2, 3, 4, 5]
    assert pool.usage == 0.0


def test_eviction_removes_cache_entry_when_block_is_reused() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(_FakeRequest([HASHES[0], HASHES[1]]), [a, b], 0, 2)
    pool.free_blocks([b, a])
    assert pool.get_cached_block(HASHES[1], [0])[0] is b
    (reused,) = pool.get_new_blocks(1)
    assert reused is b and b.block_hash is None
    assert pool.get_cached_block(HASHES[1], [0]) is None
    assert pool.get_cached_block(HASHES[0], [0])[0] is a


def test_duplicate_hashes_are_kept_and_both_findable() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(_FakeRequest([HASHES[2]]), [a], 0, 1)
    pool.cache_full_blocks(_FakeRequest([HASHES[2]]), [b], 0, 1)
    assert pool.num_cached_blocks == 2
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # block 3, then a (evicted)
    assert pool.get_cached_block(HASHES[2], [0])[0] is b


def test_free_of_null_block_is_ignored_and_pool_validation() -> None:
    pool = BlockPool(2)
    pool.free_blocks([pool.null_block])
    assert pool.num_free_blocks == 1 and pool.null_block.ref_cnt == 0
    with pytest.raises(ValueError, match="1"):
        BlockPool(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_cache_full_blocks_requires_hashes() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="1 block hashes"):
        pool.cache_full_blocks(_FakeRequest([HASHES[0]]), blocks, 0, 2)


def test_free_queue_remove_from_middle_and_errors() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3]
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    with pytest.raises(ValueError):
        q.append(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q.popleft_n(4)] == [0, 1, 3, 2]
    with pytest.raises(ValueError):
        q.popleft()
