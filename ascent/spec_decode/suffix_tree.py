"""Suffix trees for suffix decoding (arXiv 2411.04975), following arctic-inference's ``SuffixTree`` semantics.

``SuffixTree`` stores a set of token sequences (``seq_id -> tokens``) as a suffix trie truncated to ``max_depth``:
every suffix of every sequence is inserted up to ``max_depth`` tokens. ``count(s)`` is the number of occurrences of
the string ``s`` (``len(s) <= max_depth``) across the stored sequences. Nodes are path-compressed: a node covers a run
of ``length`` tokens read from ``ref[ref_idx:]`` (a stored sequence or a private copy), all with the same count.
Invariants (checked by ``check_integrity``): every suffix ends exactly at a node end; a non-root node's count exceeds
each child's; a node's children start with distinct tokens.

``SuffixCache`` holds one tree per active request (its prompt + output) and a global tree of responses of active and
past requests, bounded by ``max_cached_requests`` with least-recently-updated eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class _Node:
    __slots__ = ("token", "count", "length", "ref", "ref_idx", "parent", "children")

    def __init__(self, token: int, count: int, length: int, ref: list[int], ref_idx: int,
                 parent: _Node | None) -> None:
        self.token = token
        self.count = count
        self.length = length
        self.ref = ref
        self.ref_idx = ref_idx
        self.parent = parent
        self.children: dict[int, _Node] = {}

    def label(self) -> list[int]:
        return self.ref[self.ref_idx: self.ref_idx + self.length]

    def point_at(self, seq: list[int], end: int) -> None:
        """Read this node's tokens from ``seq``, where they end at index ``end``."""
        self.ref, self.ref_idx = seq, end - self.length

    def drop_first_token(self) -> None:
        self.length -= 1
        self.ref_idx += 1
        self.token = self.ref[self.ref_idx]

    def best_child(self) -> _Node | None:
        """Highest count; ties -> smallest token id."""
        best = None
        for child in self.children.values():
            if best is None or child.count > best.count or (child.count == best.count and child.token < best.token):
                best = child
        return best


@dataclass
class Draft:
    """A chain draft: ``token_ids[i]`` has estimated probability ``probs[i]``; ``score = sum(probs)``;
    ``match_len`` = length of the context suffix it continues."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Depth-bounded, path-compressed suffix trie over several sequences with occurrence counts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} is invalid: must be >= 1")
        self.max_depth = max_depth
        self._root = _Node(-1, 0, 0, [], 0, None)
        self._seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[_Node]] = {}  # per sequence: the nodes its last <= D suffixes end at

    @property
    def sequences(self) -> dict[Hashable, list[int]]:
        return self._seqs

    # ---------------------------------------------------------------------------------------------- insert
    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created on first use)."""
        for t in tokens:
            self.append(seq_id, int(t))

    def extend_many(self, seq_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        """``extend`` for each ``(seq_ids[i], token_lists[i])``, in order."""
        for seq_id, tokens in zip(seq_ids, token_lists, strict=True):
            self.extend(seq_id, tokens)

    def append(self, seq_id: Hashable, token: int) -> None:
        """Append one token: a new suffix starts at the root, every active suffix grows by ``token`` and the oldest
        one stops once it is ``max_depth`` long."""
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        active.append(self._root)
        self._root.count += 1
        if len(active) > self.max_depth:
            active.pop(0)
        seq.append(token)
        end = len(seq)
        root, grow = self._root, self._grow
        for i, node in enumerate(active):  # the two commonest cases of _grow inline (same effect)
            child = node.children.get(token)
            if child is None:
                if node is not root and node.count == 1:  # a unique suffix's leaf: lengthen it
                    node.length += 1
                    node.ref, node.ref_idx = seq, end - node.length
                    continue
            elif child.length == 1 and (node is root or node.count != child.count + 1):  # one more occurrence
                child.count += 1
                child.ref, child.ref_idx = seq, end - 1
                active[i] = child
                continue
            active[i] = grow(node, child, token, seq, end)

    def _grow(self, node: _Node, child: _Node | None, token: int, seq: list[int], end: int) -> _Node:
        """Extend the suffix ending at ``node`` by ``token`` (now at ``seq[end - 1]``; ``child``: ``node``'s child
        starting with it, if any); returns its new end node."""
        root = self._root
        if child is None:
            if node is not root and node.count == 1:  # only this suffix reaches the leaf: lengthen it
                node.length += 1
                node.point_at(seq, end)
                return node
            new = _Node(token, 1, 1, seq, end - 1, node)
            node.children[token] = new
            return new
        if node is not root and node.count == child.count + 1:  # this suffix is the only one ending at node
            if child.length == 1:
                return self._fuse_into_child(node, child, seq, end)
            node.length += 1
            node.point_at(seq, end)
            del node.children[token]
            child.drop_first_token()
            node.children[child.token] = child
            return node
        if child.length == 1:
            child.count += 1
            child.point_at(seq, end)
            return child
        mid = _Node(token, child.count + 1, 1, seq, end - 1, node)
        child.drop_first_token()
        child.parent = mid
        mid.children[child.token] = child
        node.children[token] = mid
        return mid

    @staticmethod
    def _fuse_into_child(node: _Node, child: _Node, seq: list[int], end: int) -> _Node:
        parent = node.parent
        assert parent is not None
        child.token = node.token
        child.count += 1
        child.length = node.length + 1
        child.point_at(seq, end)
        child.parent = parent
        parent.children[child.token] = child
        return child

    # ---------------------------------------------------------------------------------------------- remove
    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id`` (unknown ids are ignored): decrement every node on each of its suffix paths,
        drop nodes that reach zero and re-merge nodes left with one equal-count child."""
        seq = self._seqs.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            self._remove_suffix(seq, start)

    def _remove_suffix(self, seq: list[int], start: int) -> None:
        node = self._root
        node.count -= 1
        idx = start
        while idx < len(seq):
            child = node.children.get(seq[idx])
            if child is None:
                break
            child.count -= 1
            if child.count == 0:
                del node.children[child.token]
                break
            if child.ref is seq:
                child.ref, child.ref_idx = child.label(), 0
            idx += child.length
            node = child
        if node is not self._root and len(node.children) == 1:
            only = next(iter(node.children.values()))
            if only.count == node.count:
                self._merge_with_child(node, only)

    @staticmethod
    def _merge_with_child(node: _Node, child: _Node) -> None:
        parent = node.parent
        assert parent is not None
        child.ref, child.ref_idx = node.label() + child.label(), 0
        child.length += node.length
        child.token = node.token
        child.parent = parent
        parent.children[child.token] = child

    # ---------------------------------------------------------------------------------------------- query
    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Walk ``pattern`` from the root: (node, tokens consumed in it) or None when it does not occur."""
        node, idx = self._root, 0
        for t in pattern:
            if idx >= node.length:
                nxt = node.children.get(t)
                if nxt is None:
                    return None
                node, idx = nxt, 0
            if node.ref[node.ref_idx + idx] != t:
                return None
            idx += 1
        return node, idx

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (1 <= len <= max_depth) in the stored sequences; 0 when longer or absent."""
        hit = self._match([int(t) for t in pattern]) if 0 < len(pattern) <= self.max_depth else None
        return 0 if hit is None else hit[0].count

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, seq_id: Hashable | None = None) -> Draft:
        """Best chain draft continuing ``context``.

        For each match length ``m = 1 .. len(context) - 1`` (stopping at the first suffix that does not occur), walk
        from the match point along the highest-count child, ``prob *= child.count / node.count`` at each branch,
        emitting tokens while ``prob >= min_token_prob`` and fewer than
        ``min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))``; keep the best score (ties ->
        the longer match). ``seq_id``: a stored sequence whose tail may equal ``context``; when it does, the match
        points are that sequence's tracked suffix ends (every suffix ends at a node end), not walks from the root,
        with the same result.
        """
        return self._speculate([int(t) for t in context], max_spec_tokens, max_spec_factor, max_spec_offset,
                               min_token_prob, seq_id)

    def _speculate(self, ctx: list[int], max_spec_tokens: int, max_spec_factor: float, max_spec_offset: float,
                   min_token_prob: float, seq_id: Hashable | None) -> Draft:
        """:meth:`speculate` for a context that already is a list of Python ints."""
        ends = self._tail_suffix_ends(ctx, seq_id)
        best: tuple[list[int], list[float], float] = ([], [], 0.0)
        best_m = 0
        for m in range(1, len(ctx)):
            if ends is not None:
                node, idx = ends[-m], ends[-m].length
            else:
                hit = self._match(ctx[len(ctx) - m:])
                if hit is None:
                    break
                node, idx = hit
            if idx >= node.length and not node.children:  # nothing ever followed this suffix: an empty draft
                if best[2] <= 0.0:
                    best, best_m = ([], [], 0.0), m
                continue
            cap = max(0, min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6)))
            draft = self._walk(node, idx, cap, min_token_prob)
            if draft[2] >= best[2]:
                best, best_m = draft, m
        return Draft(token_ids=best[0], probs=best[1], score=best[2], match_len=best_m)

    def _tail_suffix_ends(self, ctx: list[int], seq_id: Hashable | None) -> list[_Node] | None:
        """The end nodes of sequence ``seq_id``'s last suffixes (``[-m]``: length ``m``) when its tail is ``ctx``."""
        if seq_id is None or not ctx:
            return None
        seq = self._seqs.get(seq_id)
        if seq is None or len(seq) < len(ctx) or seq[len(seq) - len(ctx):] != ctx:
            return None
        ends = self._active.get(seq_id)
        return ends if ends is not None and len(ends) >= len(ctx) - 1 else None

    @staticmethod
    def _walk(node: _Node, idx: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], list[float], float]:
        """(tokens, their probabilities, score) of the chain from ``idx`` tokens into ``node``."""
        tokens: list[int] = []
        probs: list[float] = []
        score = 0.0
        prob = 1.0
        while len(tokens) < max_tokens and prob >= min_token_prob:
            if idx < node.length:
                tokens.append(node.ref[node.ref_idx + idx])
                probs.append(prob)
                score += prob
                idx += 1
                continue
            child = node.best_child()
            if child is None:
                break
            prob *= child.count / node.count
            node, idx = child, 0
        return tokens, probs, score

    # ---------------------------------------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Assert the structural invariants (for tests): parent links, labels, counts and depth."""
        stack = [(self._root, 0)]
        while stack:
            node, depth = stack.pop()
            assert depth <= self.max_depth, depth
            total = 0
            for tok, child in node.children.items():
                assert child.parent is node and child.token == tok and child.length >= 1
                assert child.label()[0] == tok and len(child.label()) == child.length
                assert 0 < child.count and (node is self._root or child.count < node.count)
                total += child.count
                stack.append((child, depth + child.length))
            assert total <= node.count, (total, node.count)


class SuffixCache:
    """Per-request prompt trees plus one global response tree (arctic-inference's ``SuffixDecodingCache`` API).

    A prompt tree is indexed lazily: prompt and generated tokens are queued and inserted at the request's next
    ``speculate`` (or ``local_tree``), so a request that never drafts (plain decoding chosen by dynamic
    speculation) never pays for its tree; drafts are the same as with eager insertion.

    ``max_cached_requests``: responses kept in the global tree (0 disables it, negative = unbounded); when over,
    the least recently started/updated response is evicted (``eviction="fifo"``: the oldest started, as in Arctic).
    ``tree_factory(max_depth)`` makes the trees (default: the native tree when built, see
    :func:`~ascent.spec_decode.suffix_tree_native.suffix_tree_factory`).
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, eviction: str = "lru",
                 tree_factory: Callable[[int], Any] | None = None) -> None:
        if eviction not in ("lru", "fifo"):
            raise ValueError(f"eviction={eviction!r} is invalid: must be 'lru' or 'fifo'")
        if tree_factory is None:
            from ascent.spec_decode.suffix_tree_native import suffix_tree_factory

            tree_factory = suffix_tree_factory()
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.eviction = eviction
        self._new_tree = tree_factory
        self._global = tree_factory(max_tree_depth)
        self._local: dict[Hashable, Any] = {}
        self._unindexed: dict[Hashable, list[int]] = {}  # per request: tokens not yet in its prompt tree
        self._cached: OrderedDict[Hashable, None] = OrderedDict()  # eviction order, oldest first

    @property
    def active_requests(self) -> set[Hashable]:
        return set(self._local)

    @property
    def cached_requests(self) -> list[Hashable]:
        """Requests with a response in the global tree, next to be evicted first."""
        return list(self._cached)

    @property
    def global_tree(self) -> Any:
        return self._global

    def local_tree(self, req_id: Hashable) -> Any:
        tree = self._local[req_id]
        pending = self._unindexed.pop(req_id, None)
        if pending:
            tree.extend(0, pending)
        return tree

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        """Start the request's prompt tree (indexed lazily); reserve its global slot (replacing a cached response with
        the same id)."""
        if req_id in self._local:
            raise ValueError(f"request {req_id!r} is already active")
        self._local[req_id] = self._new_tree(self.max_tree_depth)
        self._unindexed[req_id] = [int(t) for t in prompt_token_ids]
        if self.max_cached_requests == 0:
            return
        if req_id in self._cached:
            self.evict_cached_response(req_id)
        self._cached[req_id] = None
        while 0 < self.max_cached_requests < len(self._cached):
            self.evict_cached_response(next(iter(self._cached)))

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        """Append generated tokens to the request's prompt tree and (while cached) its global response."""
        self.add_active_responses([req_id], [token_ids])

    def add_active_responses(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        """``add_active_response`` for each request (one decode step; the global tree in one call). Every request must
        be active; nothing changes when one is not."""
        inactive = [r for r in req_ids if r not in self._local]
        if inactive:
            raise ValueError(f"request {inactive[0]!r} is not active")
        cached, cached_tokens = [], []
        for req_id, tokens in zip(req_ids, token_lists, strict=True):
            if not len(tokens):
                continue
            self._unindexed.setdefault(req_id, []).extend(int(t) for t in tokens)
            if req_id in self._cached:
                cached.append(req_id)
                cached_tokens.append(tokens)
                if self.eviction == "lru":
                    self._cached.move_to_end(req_id)
        if cached:
            self._global.extend_many(cached, cached_tokens)

    def stop_request(self, req_id: Hashable) -> None:
        """Drop the prompt tree; the response stays cached until evicted."""
        if req_id not in self._local:
            raise ValueError(f"request {req_id!r} is not active")
        del self._local[req_id]
        self._unindexed.pop(req_id, None)

    def evict_cached_response(self, req_id: Hashable) -> None:
        if req_id not in self._cached:
            raise ValueError(f"request {req_id!r} is not cached")
        del self._cached[req_id]
        self._global.remove(req_id)

    def speculate(self, req_id: Hashable, pattern: Sequence[int] | np.ndarray, max_spec_tokens: int,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1) -> Draft:
        """The better (higher score; tie -> prompt tree) of the prompt-tree and global-tree drafts for the last
        ``max_tree_depth`` tokens of ``pattern``."""
        if req_id not in self._local:
            raise ValueError(f"request {req_id!r} is not active")
        ctx = [int(t) for t in pattern[-self.max_tree_depth:]]
        args = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob)
        best = self.local_tree(req_id)._speculate(ctx, *args, seq_id=0)  # ctx is converted once, here
        other = self._global._speculate(ctx, *args, seq_id=req_id)
        return other if other.score > best.score else best
