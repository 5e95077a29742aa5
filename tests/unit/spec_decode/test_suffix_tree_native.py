"""The C++ suffix tree against the Python one: the same drafts (tokens, probabilities, scores, match lengths), counts
and sequences under random interleaved appends and removals, and the choice between them."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ascent.spec_decode.suffix_tree import SuffixCache, SuffixTree
from ascent.spec_decode.suffix_tree_native import NativeSuffixTree, suffix_tree_factory
from tests.unit.spec_decode.test_suffix_tree import native_tree

TOKENS = st.integers(0, 5)
SEQ_IDS = st.sampled_from([0, 1, "r", ("t", 2)])  # any hashable id


class NativeVsPython(RuleBasedStateMachine):
    """Every operation on both trees; every query must agree exactly."""

    @initialize(depth=st.integers(1, 9))
    def make_trees(self, depth):
        self.ref, self.fast = SuffixTree(depth), native_tree(depth)

    @rule(seq_id=SEQ_IDS, tokens=st.lists(TOKENS, max_size=12))
    def extend(self, seq_id, tokens):
        self.ref.extend(seq_id, tokens)
        self.fast.extend(seq_id, tokens)

    @rule(items=st.lists(st.tuples(SEQ_IDS, st.lists(TOKENS, max_size=4)), max_size=4))
    def extend_many(self, items):  # the native batch call against the Python tree's one-by-one extends
        seq_ids, token_lists = [s for s, _ in items], [t for _, t in items]
        self.ref.extend_many(seq_ids, token_lists)
        self.fast.extend_many(seq_ids, token_lists)

    @rule(seq_id=SEQ_IDS, token=TOKENS)
    def append(self, seq_id, token):
        self.ref.append(seq_id, token)
        self.fast.append(seq_id, token)

    @precondition(lambda self: self.ref.sequences)
    @rule(data=st.data())
    def remove(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.ref.sequences, key=repr)))
        self.ref.remove(seq_id)
        self.fast.remove(seq_id)

    @rule(ctx=st.lists(TOKENS, max_size=10), max_tokens=st.integers(0, 9), factor=st.sampled_from([0.5, 1.0, 3.0]),
          offset=st.sampled_from([-1.0, 0.0, 1.5]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
    def speculate(self, ctx, max_tokens, factor, offset, min_prob):
        for seq_id in (None, *self.ref.sequences):
            tail = ctx if seq_id is None else (self.ref.sequences[seq_id][-len(ctx):] if ctx else [])
            a = self.ref.speculate(tail, max_tokens, factor, offset, min_prob, seq_id=seq_id)
            b = self.fast.speculate(tail, max_tokens, factor, offset, min_prob, seq_id=seq_id)
            assert a == b, (seq_id, tail, a, b)

    @invariant()
    def same_state(self):
        self.fast.check_integrity()
        assert self.fast.sequences == self.ref.sequences
        for seq in self.ref.sequences.values():
            for start in range(len(seq)):
                pattern = seq[start: start + self.ref.max_depth + 1]
                assert self.fast.count(pattern) == self.ref.count(pattern), pattern


TestNativeVsPython = NativeVsPython.TestCase
TestNativeVsPython.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_a_long_realistic_stream_gives_identical_drafts():
    """Thousands of tokens over a small vocabulary, request churn in a bounded global cache, as in serving."""
    import random

    rng = random.Random(0)
    caches = [SuffixCache(max_tree_depth=24, max_cached_requests=6, tree_factory=f)
              for f in (SuffixTree, native_tree)]
    phrases = [[rng.randrange(50) for _ in range(rng.randint(3, 12))] for _ in range(20)]
    for r in range(20):
        prompt = [t for _ in range(8) for t in rng.choice(phrases)]
        for cache in caches:
            cache.start_request(r, prompt)
        ctx = list(prompt)
        for _ in range(30):
            drafts = [cache.speculate(r, ctx, 16, 1.0, 0.0, 0.1) for cache in caches]
            assert drafts[0] == drafts[1]
            new = rng.choice(phrases)[: rng.randint(1, 4)]
            ctx += new
            for cache in caches:
                cache.add_active_response(r, new)
        for cache in caches:
            cache.stop_request(r)
    assert caches[0].global_tree.sequences == caches[1].global_tree.sequences


def test_trees_are_native_unless_switched_off_and_one_kind_per_cache(monkeypatch):
    assert isinstance(suffix_tree_factory()(4), NativeSuffixTree)
    cache = SuffixCache(max_tree_depth=4)
    assert isinstance(cache.global_tree, NativeSuffixTree)
    monkeypatch.setenv("ASCENT_NATIVE_SUFFIX_TREE", "0")
    assert type(suffix_tree_factory()(4)) is SuffixTree
    assert type(SuffixCache(max_tree_depth=4).global_tree) is SuffixTree
    cache.start_request("r", [1, 2])  # a cache keeps the kind it was built with
    assert isinstance(cache.local_tree("r"), NativeSuffixTree)


def test_a_step_of_responses_at_once_equals_one_request_at_a_time():
    """``add_active_responses`` (one global-tree call per step) against per-request ``add_active_response``, with
    concurrent requests, eviction and empty updates: the same drafts, sequences and eviction order, both tree kinds."""
    import random

    for factory in (SuffixTree, native_tree):
        rng = random.Random(1)
        one, batched = (SuffixCache(max_tree_depth=8, max_cached_requests=5, tree_factory=factory) for _ in range(2))
        live: dict[int, list[int]] = {}
        for step in range(120):
            if len(live) < 4 or rng.random() < 0.05:
                req_id, prompt = step, [rng.randrange(6) for _ in range(rng.randint(1, 6))]
                for cache in (one, batched):
                    cache.start_request(req_id, prompt)
                live[req_id] = list(prompt)
            ids = list(live)
            new = [[rng.randrange(6) for _ in range(rng.choice([0, 1, 1, 3]))] for _ in ids]
            for req_id, tokens in zip(ids, new):
                if tokens:
                    one.add_active_response(req_id, tokens)
                live[req_id] += tokens
            batched.add_active_responses(ids, new)
            for req_id in ids:
                assert one.speculate(req_id, live[req_id], 6) == batched.speculate(req_id, live[req_id], 6)
            if rng.random() < 0.1:
                done = rng.choice(ids)
                for cache in (one, batched):
                    cache.stop_request(done)
                del live[done]
        assert one.cached_requests == batched.cached_requests
        assert one.global_tree.sequences == batched.global_tree.sequences
        before = batched.global_tree.sequences
        with pytest.raises(ValueError, match="'gone' is not active"):
            batched.add_active_responses([*live, "gone"], [[1]] * len(live) + [[1]])
        assert batched.global_tree.sequences == before  # nothing changed
