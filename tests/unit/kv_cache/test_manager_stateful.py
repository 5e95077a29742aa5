"""Random request streams through KVCacheManager, checked against a simulated KV store and ref-count invariants.

The simulation writes each scheduled token into its slot (``block_id * bs + pos % bs``) of a dict-backed "KV
cache"; every prefix hit must then point at blocks that really hold the request's tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ascent.core.kv_cache.manager import KVCacheManager
from ascent.core.request import Request
from tests.unit.kv_cache.helpers import make_request, pool_snapshot

MAX_MODEL_LEN = 48
MAX_TOKENS = 40
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [5, 5]]


class ManagerStream(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 24), bs=st.sampled_from([1, 2, 4]))
    def init(self, num_blocks: int, bs: int) -> None:
        self.bs = bs
        self.n = num_blocks
        self.mgr = KVCacheManager(num_blocks, bs, MAX_MODEL_LEN)
        self.kv: dict[int, int] = {}
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.counter = 0

    # --- simulation helpers ----------------------------------------------------------------------------------------
    def _write(self, req: Request, start: int, end: int) -> None:
        ids = self.mgr.get_block_ids(req.request_id)
        for pos in range(start, end):
            self.kv[ids[pos // self.bs] * self.bs + pos % self.bs] = req.all_token_ids[pos]

    def _advance(self, req: Request, n: int) -> None:
        self._write(req, req.num_computed_tokens, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids(req.num_tokens % 3)

    def _preempt(self, req: Request) -> None:
        self.mgr.free(req)
        del self.running[req.request_id]
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.append(req)

    # --- rules -----------------------------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 2), max_size=12))
    def add_request(self, prefix: list[int], tail: list[int]) -> None:
        self.counter += 1
        self.waiting.append(make_request(f"r{self.counter}", prefix + tail, self.bs))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit == len(hits) * self.bs and num_hit <= req.num_tokens - 1
        for i, block in enumerate(hits):
            stored = [self.kv.get(block.block_id * self.bs + o) for o in range(self.bs)]
            assert stored == req.all_token_ids[i * self.bs : (i + 1) * self.bs]
        n = data.draw(st.integers(1, req.num_tokens - num_hit))
        before = pool_snapshot(self.mgr, [req.request_id, *self.running])
        if self.mgr.allocate_slots(req, n, num_hit, hits) is None:
            assert pool_snapshot(self.mgr, [req.request_id, *self.running]) == before
            return
        self.waiting.remove(req)
        self.running[req.request_id] = req
        req.num_computed_tokens = num_hit
        self._advance(req, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_tokens >= MAX_TOKENS:
            self.mgr.free(req)
            del self.running[req.request_id]
            return
        n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        lookahead = data.draw(st.integers(0, 2))
        if self.mgr.allocate_slots(req, n, num_lookahead_tokens=lookahead) is None:
            self._preempt(req)
            return
        self._advance(req, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), finish=st.booleans())
    def release(self, data: st.DataObject, finish: bool) -> None:
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if finish:
            self.mgr.free(req)
            del self.running[req.request_id]
        else:
            self._preempt(req)

    # --- invariants ------------------------------------------------------------------------------------------------
    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders: dict[int, int] = {}
        for rid, req in self.running.items():
            ids = self.mgr.get_block_ids(rid)
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
            assert 0 not in ids
            assert len(ids) * self.bs >= req.num_computed_tokens
            for b in ids:
                holders[b] = holders.get(b, 0) + 1
        for req in self.waiting:
            assert self.mgr.get_block_ids(req.request_id) == []
        assert len(holders) <= self.n - 1
        pool = self.mgr.block_pool
        assert sum(b.ref_cnt for b in pool.blocks) == sum(holders.values())
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0)
        assert self.mgr.num_free_blocks == self.n - 1 - len(holders)
        assert self.mgr.usage == pytest.approx(len(holders) / (self.n - 1))

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for req in list(self.running.values()):
            self.mgr.free(req)
        assert self.mgr.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks)


ManagerStream.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestManagerStream = ManagerStream.TestCase
