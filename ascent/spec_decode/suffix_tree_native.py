"""The suffix tree of suffix decoding backed by C++ (``layers/cpu_kernels/suffix_tree_cpu.cpp``).

:class:`NativeSuffixTree` has :class:`~ascent.spec_decode.suffix_tree.SuffixTree`'s interface and results (the
tests run both against a brute-force index and against each other); it exists because the Python tree costs tens of
microseconds per indexed token (every token walks up to ``max_depth`` active suffixes), which made the suffix
proposer a visible share of a decode step once prompts are long or many requests run. Sequence ids may be any
hashable; the C++ side numbers them. :func:`suffix_tree_factory` picks the native tree when its extension is available
(``ASCENT_NATIVE_SUFFIX_TREE=0`` or a failed build: the Python tree).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ascent.spec_decode.suffix_tree import Draft, SuffixTree


class NativeSuffixTree:
    """Depth-bounded, path-compressed suffix trie over several sequences with occurrence counts (C++ storage)."""

    def __init__(self, max_depth: int, ops: Any) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} is invalid: must be >= 1")
        self.max_depth = max_depth
        self._tree = ops.SuffixTree(max_depth)
        self._numbers: dict[Hashable, int] = {}
        self._ids: dict[int, Hashable] = {}
        self._next = itertools.count()

    def _number(self, seq_id: Hashable) -> int:
        number = self._numbers.get(seq_id)
        if number is None:
            number = next(self._next)
            self._numbers[seq_id] = number
            self._ids[number] = seq_id
        return number

    @property
    def sequences(self) -> dict[Hashable, list[int]]:
        return {self._ids[n]: self._tree.sequence(n) for n in self._tree.seq_ids()}

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created on first use)."""
        if len(tokens):
            self._tree.extend(self._number(seq_id), [int(t) for t in tokens])

    def extend_many(self, seq_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        """``extend`` for each ``(seq_ids[i], token_lists[i])``, in order, in one native call."""
        self._tree.extend_many([self._number(s) for s in seq_ids], [[int(t) for t in toks] for toks in token_lists])

    def append(self, seq_id: Hashable, token: int) -> None:
        self._tree.append(self._number(seq_id), int(token))

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id`` (unknown ids are ignored)."""
        number = self._numbers.pop(seq_id, None)
        if number is not None:
            del self._ids[number]
            self._tree.remove(number)

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of ``pattern`` (1 <= len <= max_depth) in the stored sequences; 0 when longer or absent."""
        return self._tree.count([int(t) for t in pattern])

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, seq_id: Hashable | None = None) -> Draft:
        """Best chain draft continuing ``context`` (:meth:`SuffixTree.speculate`)."""
        return self._speculate([int(t) for t in context], max_spec_tokens, max_spec_factor, max_spec_offset,
                               min_token_prob, seq_id)

    def _speculate(self, ctx: list[int], max_spec_tokens: int, max_spec_factor: float, max_spec_offset: float,
                   min_token_prob: float, seq_id: Hashable | None) -> Draft:
        number = self._numbers.get(seq_id) if seq_id is not None else None
        tokens, probs, score, match_len = self._tree.speculate(
            ctx, int(max_spec_tokens), float(max_spec_factor), float(max_spec_offset), float(min_token_prob),
            number is not None, -1 if number is None else number)
        return Draft(token_ids=tokens, probs=probs, score=score, match_len=match_len)

    def check_integrity(self) -> None:
        """Raise when a structural invariant is broken (for tests)."""
        self._tree.check_integrity()


def suffix_tree_factory() -> Callable[[int], SuffixTree | NativeSuffixTree]:
    """``factory(max_depth)`` making native suffix trees when the extension is available, else Python ones (same
    results); decided once, here, so every tree of a cache is of one kind."""
    from ascent.layers.cpu_kernels import suffix_tree_ops

    ops = suffix_tree_ops()
    return SuffixTree if ops is None else functools.partial(NativeSuffixTree, ops=ops)
