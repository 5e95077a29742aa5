"""SuffixTree / SuffixCache vs a brute-force substring index over the stored sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ascent.layers.cpu_kernels import suffix_tree_ops
from ascent.spec_decode.suffix_tree import SuffixCache, SuffixTree
from ascent.spec_decode.suffix_tree_native import NativeSuffixTree
from tests.unit.spec_decode.reference import BruteSuffixIndex

TOKENS = st.integers(0, 3)


def native_tree(depth: int) -> NativeSuffixTree:
    ops = suffix_tree_ops()
    assert ops is not None, "the native suffix tree did not build"
    return NativeSuffixTree(depth, ops)


# Every test below runs on both trees: the Python one and the C++ one must give the same results.
IMPLS = {"python": SuffixTree, "native": native_tree}
impls = pytest.mark.parametrize("impl", sorted(IMPLS))


class TreeVsBruteForce(RuleBasedStateMachine):
    """Random extend/remove on a few sequences; counts and drafts must equal the brute-force index."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, list[int]] = {}

    make = staticmethod(SuffixTree)

    @initialize(depth=st.integers(1, 6))
    def make_tree(self, depth):
        self.depth = depth
        self.tree = self.make(depth)

    @rule(seq_id=st.integers(0, 3), tokens=st.lists(TOKENS, max_size=8))
    def extend(self, seq_id, tokens):
        self.tree.extend(seq_id, tokens)
        if tokens or seq_id in self.seqs:
            self.seqs.setdefault(seq_id, []).extend(tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def remove(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.tree.remove(seq_id)
        del self.seqs[seq_id]

    @rule(ctx=st.lists(TOKENS, max_size=7), max_tokens=st.integers(0, 6),
          factor=st.sampled_from([0.5, 1.0, 2.0]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
    def speculate(self, ctx, max_tokens, factor, min_prob):
        ref = BruteSuffixIndex(list(self.seqs.values()), self.depth)
        d = self.tree.speculate(ctx, max_tokens, factor, 0.0, min_prob)
        assert (d.token_ids, d.score, d.match_len) == ref.speculate(ctx, max_tokens, factor, 0.0, min_prob)
        assert len(d.probs) == len(d.token_ids) and all(p >= min_prob for p in d.probs)

    @invariant()
    def counts_match(self):
        self.tree.check_integrity()
        ref = BruteSuffixIndex(list(self.seqs.values()), self.depth)
        for s, c in ref.counts.items():
            assert self.tree.count(s) == c, (s, c)
        for probe in ([0], [1, 2], [3, 3, 3], [0, 1, 2, 3]):
            assert self.tree.count(probe) == ref.count(probe)
        assert {k: v for k, v in self.tree.sequences.items() if v} == self.seqs


class NativeTreeVsBruteForce(TreeVsBruteForce):
    make = staticmethod(native_tree)


TestTreeVsBruteForce = TreeVsBruteForce.TestCase
TestTreeVsBruteForce.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestNativeTreeVsBruteForce = NativeTreeVsBruteForce.TestCase
TestNativeTreeVsBruteForce.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), max_size=25), min_size=1, max_size=4), depth=st.integers(1, 7),
       ctx=st.lists(st.integers(0, 2), max_size=10), max_tokens=st.integers(0, 8))
@impls
def test_build_and_speculate_match_brute_force(impl, seqs, depth, ctx, max_tokens):
    tree = IMPLS[impl](depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    tree.check_integrity()
    ref = BruteSuffixIndex(seqs, depth)
    assert all(tree.count(s) == c for s, c in ref.counts.items())
    d = tree.speculate(ctx, max_tokens)
    assert (d.token_ids, d.score, d.match_len) == ref.speculate(ctx, max_tokens)


@impls
def test_depth_bound_limits_counts_and_drafts(impl):
    tree = IMPLS[impl](3)
    tree.extend("a", [1, 2, 3, 4, 5, 6])
    tree.check_integrity()
    assert tree.count([1, 2, 3]) == 1 and tree.count([1, 2, 3, 4]) == 0
    # match_len + draft length never exceeds the depth: [1] matched -> at most 2 more tokens
    d = tree.speculate([9, 1], max_spec_tokens=10, max_spec_factor=10.0)
    assert d.token_ids == [2, 3] and d.match_len == 1


@impls
def test_counts_and_probabilities_from_frequencies(impl):
    tree = IMPLS[impl](8)
    for i, s in enumerate([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6]]):
        tree.extend(i, s)
    assert tree.count([1]) == 4 and tree.count([1, 2]) == 3 and tree.count([1, 2, 3]) == 2
    d = tree.speculate([0, 1], max_spec_tokens=5, max_spec_factor=5.0, min_token_prob=0.0)
    assert d.token_ids == [2, 3] and d.probs == [0.75, 0.75 * (2 / 3)] and d.match_len == 1


@impls
def test_min_token_prob_cuts_the_chain(impl):
    tree = IMPLS[impl](8)
    for i, s in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 6]]):
        tree.extend(i, s)
    # after [1]: 2 has prob 1.0; then four-way split at 0.25 each (tie -> smallest id 3)
    assert tree.speculate([0, 1], 5, 5.0, min_token_prob=0.3).token_ids == [2]
    assert tree.speculate([0, 1], 5, 5.0, min_token_prob=0.25).token_ids == [2, 3]


@impls
def test_spec_factor_and_offset_cap_the_draft_length(impl):
    tree = IMPLS[impl](16)
    tree.extend(0, list(range(10)))
    # context ends in [3, 4]: match lengths 1 and 2 both continue with 5, 6, 7, ...
    assert tree.speculate([3, 4], 8, max_spec_factor=1.0).token_ids == [5]  # m=1 only (m < len(ctx))
    assert tree.speculate([2, 3, 4], 8, max_spec_factor=1.0).token_ids == [5, 6]
    assert tree.speculate([2, 3, 4], 8, max_spec_factor=2.0).token_ids == [5, 6, 7, 8]
    assert tree.speculate([2, 3, 4], 8, max_spec_factor=2.0, max_spec_offset=1.0).token_ids == [5, 6, 7, 8, 9]
    assert tree.speculate([2, 3, 4], 3, max_spec_factor=2.0).token_ids == [5, 6, 7]
    assert tree.speculate([2, 3, 4], 8, max_spec_factor=0.0).token_ids == []


@impls
def test_remove_repoints_shared_nodes(impl):
    tree = IMPLS[impl](6)
    tree.extend("a", [1, 2, 3, 4])
    tree.extend("b", [1, 2, 3, 5])
    tree.remove("a")
    tree.check_integrity()
    assert tree.count([1, 2, 3]) == 1 and tree.count([1, 2, 3, 4]) == 0 and tree.count([2, 3, 5]) == 1
    tree.extend("b", [1, 2, 3, 5])
    tree.check_integrity()
    assert tree.count([1, 2, 3, 5]) == 2
    tree.remove("nope")  # unknown ids are ignored


def _cache_with_responses(impl: str, max_cached: int, eviction: str = "lru") -> SuffixCache:
    cache = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=8, max_cached_requests=max_cached, eviction=eviction)
    for r in ("r0", "r1", "r2"):
        cache.start_request(r, [100])
        cache.add_active_response(r, [10, 11, 12])
        cache.stop_request(r)
    return cache


@impls
def test_global_cache_bound_evicts_least_recently_updated(impl):
    cache = _cache_with_responses(impl, max_cached=2)
    assert cache.cached_requests == ["r1", "r2"]
    assert cache.global_tree.count([10, 11]) == 2
    cache.start_request("r3", [1])
    assert cache.cached_requests == ["r2", "r3"] and cache.global_tree.count([10, 11]) == 1


@impls
def test_lru_keeps_a_long_running_request_that_fifo_would_evict(impl):
    for eviction, survivor in (("lru", "old"), ("fifo", "new2")):
        cache = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=8, max_cached_requests=2, eviction=eviction)
        cache.start_request("old", [1])
        cache.start_request("new1", [1])
        cache.add_active_response("old", [7, 7])
        cache.start_request("new2", [1])
        assert survivor in cache.cached_requests and len(cache.cached_requests) == 2, eviction
        assert cache.global_tree.count([7, 7]) == (1 if eviction == "lru" else 0)


@impls
def test_disabled_global_tree_and_restart_replaces_response(impl):
    cache = _cache_with_responses(impl, max_cached=0)
    assert cache.cached_requests == [] and cache.global_tree.count([10]) == 0
    cache = _cache_with_responses(impl, max_cached=10)
    cache.start_request("r0", [5])  # same id again: its old response leaves the global tree
    assert cache.global_tree.count([10, 11]) == 2


@impls
def test_speculate_prefers_higher_score_tree_and_local_on_ties(impl):
    cache = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=8, max_cached_requests=10)
    for i in range(3):  # three past responses: "1 2 -> 3 4"
        cache.start_request(f"past{i}", [0])
        cache.add_active_response(f"past{i}", [1, 2, 3, 4])
        cache.stop_request(f"past{i}")
    cache.start_request("q", [1, 2, 9, 9, 1, 2, 8])  # own prompt: "1 2" -> 9 or 8 (0.5 each)
    draft = cache.speculate("q", [5, 1, 2], max_spec_tokens=4, max_spec_factor=2.0, min_token_prob=0.1)
    assert draft.token_ids == [3, 4]  # global: prob 1.0 path beats the local 0.5 branch


@impls
def test_equal_scores_keep_the_prompt_tree_draft(impl):
    cache = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=8, max_cached_requests=10)
    cache.start_request("past", [0])
    cache.add_active_response("past", [5, 2, 3])
    cache.stop_request("past")
    cache.start_request("u", [6, 2, 7])  # both trees: "2" -> one token with prob 1.0
    assert cache.speculate("u", [9, 2], 4).token_ids == [7]
    cache.start_request("w", [6, 2, 7, 2, 8])  # local now splits 0.5/0.5 -> the global draft scores higher
    assert cache.speculate("w", [9, 2], 4).token_ids == [3]


@impls
def test_cache_lifecycle_errors(impl):
    cache = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=4, max_cached_requests=4)
    cache.start_request("a", [1])
    with pytest.raises(ValueError, match="'a' is already active"):
        cache.start_request("a", [1])
    with pytest.raises(ValueError, match="'b' is not active"):
        cache.add_active_response("b", [1])
    with pytest.raises(ValueError, match="'b' is not active"):
        cache.speculate("b", [1], 2)
    with pytest.raises(ValueError, match="'b' is not cached"):
        cache.evict_cached_response("b")
    with pytest.raises(ValueError, match="eviction='lfu'"):
        SuffixCache(tree_factory=IMPLS[impl], eviction="lfu")
    with pytest.raises(ValueError, match="max_depth=0"):
        IMPLS[impl](0)


@impls
def test_prompt_trees_are_indexed_lazily_with_the_same_drafts(impl):
    lazy, eager = SuffixCache(tree_factory=IMPLS[impl], max_tree_depth=4), IMPLS[impl](4)
    prompt, outputs = [1, 2, 3, 1, 2], [[3, 1], [2, 3, 1]]
    lazy.start_request("r", prompt)
    eager.extend(0, prompt)
    for out in outputs:
        lazy.add_active_response("r", out)
        eager.extend(0, out)
        assert lazy._local["r"].sequences == {}  # nothing indexed before a draft is asked for
    assert lazy.global_tree.sequences == {"r": [3, 1, 2, 3, 1]}  # responses reach the global tree at once
    ctx = prompt + outputs[0] + outputs[1]
    assert lazy.speculate("r", ctx, 3, 4.0, 0.0, 0.0).token_ids == eager.speculate(ctx[-4:], 3, 4.0, 0.0, 0.0).token_ids
    assert lazy.local_tree("r").sequences == {0: ctx}
    lazy.add_active_response("r", [2])
    lazy.stop_request("r")  # queued tokens of a stopped request are dropped with its tree
    assert lazy._unindexed == {} and lazy.global_tree.sequences == {"r": [3, 1, 2, 3, 1, 2]}


@settings(max_examples=150, deadline=None)
@given(seqs=st.lists(st.lists(TOKENS, min_size=1, max_size=30), min_size=2, max_size=4), depth=st.integers(1, 6),
       max_tokens=st.integers(1, 5), factor=st.sampled_from([0.5, 1.0, 2.0]), drop=st.integers(0, 3))
@impls
def test_tail_match_points_equal_walks_from_the_root(impl, seqs, depth, max_tokens, factor, drop):
    tree = IMPLS[impl](depth)
    for i in range(max(map(len, seqs))):  # interleaved appends, as concurrent requests grow
        for s, seq in enumerate(seqs):
            if i < len(seq):
                tree.append(s, seq[i])
    tree.remove(drop % len(seqs))  # another sequence's eviction must leave the tracked suffix ends valid
    for s, seq in enumerate(seqs):
        if s == drop % len(seqs):
            continue
        for n in range(1, min(depth, len(seq)) + 1):
            ctx = seq[-n:]
            fast = tree.speculate(ctx, max_tokens, factor, 0.0, 0.2, seq_id=s)
            slow = tree.speculate(ctx, max_tokens, factor, 0.0, 0.2)
            assert (fast.token_ids, fast.probs, fast.score, fast.match_len) == \
                (slow.token_ids, slow.probs, slow.score, slow.match_len)
