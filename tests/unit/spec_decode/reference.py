"""Brute-force references for the model-free proposers, written from the rules (not from our implementation).

- n-gram: try n = max..min; the first n whose last-n tokens occur at some start s with s + n <= L - 1 wins, with the
  smallest such s; draft = the following tokens.
- suffix: occurrence counts of every substring of length <= depth over the stored sequences; greedy walk along the
  most frequent next token (ties -> smallest id), probability = product of count ratios.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def ngram_draft(ctx: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    ctx = list(ctx)
    length = len(ctx)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = ctx[length - n:]
        for s in range(0, length - n):
            if ctx[s: s + n] == suffix:
                return ctx[s + n: s + n + k]
    return []


class BruteSuffixIndex:
    """Substring counts of a set of sequences, truncated to ``depth``."""

    def __init__(self, seqs: Sequence[Sequence[int]], depth: int) -> None:
        self.depth = depth
        self.counts: Counter[tuple[int, ...]] = Counter()
        for seq in seqs:
            seq = list(seq)
            for i in range(len(seq)):
                for j in range(i + 1, min(len(seq), i + depth) + 1):
                    self.counts[tuple(seq[i:j])] += 1
        self.children: dict[tuple[int, ...], dict[int, int]] = {}
        for s, c in self.counts.items():
            self.children.setdefault(s[:-1], {})[s[-1]] = c

    def count(self, s: Sequence[int]) -> int:
        return self.counts.get(tuple(s), 0)

    def walk(self, s: tuple[int, ...], max_tokens: int, min_prob: float) -> tuple[list[int], list[float], float]:
        tokens: list[int] = []
        probs: list[float] = []
        score = 0.0
        prob = 1.0
        cur = s
        while len(tokens) < max_tokens:
            nxt = self.children.get(cur, {})
            if not nxt:
                break
            tok = min(nxt, key=lambda t: (-nxt[t], t))
            prob *= nxt[tok] / self.counts[cur]
            if prob < min_prob:
                break
            tokens.append(tok)
            probs.append(prob)
            score += prob
            cur = cur + (tok,)
        return tokens, probs, score

    def speculate(self, ctx: Sequence[int], max_spec_tokens: int, factor: float = 1.0, offset: float = 0.0,
                  min_prob: float = 0.1) -> tuple[list[int], float, int]:
        """(tokens, score, match_len) of the best draft; ties in score -> longer match."""
        ctx = tuple(ctx)
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for m in range(1, len(ctx)):
            s = ctx[len(ctx) - m:]
            if self.count(s) == 0:
                break
            cap = max(0, min(max_spec_tokens, int(m * factor + offset + 1e-6)))
            tokens, _, score = self.walk(s, cap, min_prob)
            if score >= best[1]:
                best = (tokens, score, m)
        return best
