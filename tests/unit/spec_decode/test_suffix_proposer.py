"""SuffixDecodingProposer: lifecycle, caps, and acceptance on a replay of similar requests (greedy simulation)."""

from __future__ import annotations

import numpy as np
import pytest

from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.suffix import SuffixDecodingProposer
from tests.unit.spec_decode.reference import BruteSuffixIndex


def _proposer(k: int = 8, max_model_len: int = 4096, **kw) -> SuffixDecodingProposer:
    cfg = SpeculativeConfig.from_json({"method": "suffix", "num_speculative_tokens": k, **kw})
    return SuffixDecodingProposer(cfg, max_model_len)


def _run_request(p: SuffixDecodingProposer, req_id: str, prompt: list[int], response: list[int]) -> tuple[int, int]:
    """Greedy-verification replay: drafts are accepted while they equal the true continuation, then one bonus token
    is committed. Returns (accepted, drafted)."""
    p.add_request(req_id, prompt)
    tokens = list(prompt)
    pos, accepted, drafted = 0, 0, 0
    while pos < len(response):
        row = p.propose([req_id], [np.array(tokens, dtype=np.int64)], [p.k])[0]
        draft = [int(t) for t in row if t >= 0]
        n = 0
        while n < len(draft) and pos + n < len(response) and draft[n] == response[pos + n]:
            n += 1
        new = response[pos: pos + n + 1]
        accepted, drafted = accepted + n, drafted + len(draft)
        tokens += new
        pos += len(new)
        p.update_request(req_id, new)
    p.remove_request(req_id)
    return accepted, drafted


def test_acceptance_grows_over_similar_requests():
    """vllm-ascend's e2e check: 10 similar chats with the global tree; the last request's acceptance rate > 0.6
    and above the first's."""
    rng = np.random.default_rng(0)
    template = rng.integers(0, 500, size=120).tolist()
    p = _proposer(k=8)
    rates = []
    for i in range(10):
        response = list(template)
        for j in rng.choice(len(response), size=4, replace=False):
            response[j] = int(rng.integers(500, 1000))
        prompt = rng.integers(1000, 2000, size=30).tolist()
        accepted, drafted = _run_request(p, f"chat{i}", prompt, response)
        rates.append(accepted / max(drafted, 1))
    assert rates[-1] > 0.6 and rates[-1] > rates[0], rates


def test_prompt_tree_drafts_copy_from_prompt():
    p = _proposer(k=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    p.add_request("a", prompt)
    out = p.propose(["a"], [np.array(prompt + [5, 6, 7])], [4])
    assert out.tolist() == [[8, 9, 10, -1]]  # match len 3 -> at most 3 tokens (spec factor 1.0)


def test_caps_max_num_tokens_and_max_model_len():
    p = _proposer(k=4, max_model_len=20, suffix_decoding_max_spec_factor=4.0)
    prompt = list(range(10))
    p.add_request("a", prompt)
    ctx = np.array(prompt + [0, 1, 2])  # L = 13: max_model_len - L - 1 = 6 > k
    assert p.propose(["a"], [ctx], [4]).tolist() == [[3, 4, 5, 6]]
    assert p.propose(["a"], [ctx], [2]).tolist() == [[3, 4, -1, -1]]
    assert p.propose(["a"], [ctx], [0]).tolist() == [[-1] * 4]
    long_ctx = np.array(prompt + [0, 1, 2, 3, 4, 5, 6, 1])  # L = 18: only 1 token fits
    assert p.propose(["a"], [long_ctx], [4]).tolist() == [[2, -1, -1, -1]]
    assert p.propose(["a"], [np.array(prompt + [0] * 9 + [1])], [4]).tolist() == [[-1] * 4]  # L = 20


def test_update_request_teaches_the_global_tree_and_remove_frees():
    p = _proposer(k=4, suffix_decoding_max_spec_factor=4.0)
    p.add_request("a", [1])
    p.update_request("a", [40, 41, 42, 43])
    p.remove_request("a")
    p.remove_request("a")  # idempotent
    assert p.cache.active_requests == set()
    p.add_request("b", [2])
    out = p.propose(["b"], [np.array([2, 9, 40])], [4])
    assert out.tolist() == [[41, 42, 43, -1]]
    with pytest.raises(ValueError, match="req_id='zzz'"):
        p.propose(["zzz"], [np.array([1, 2])], [4])
    with pytest.raises(ValueError, match="equal lengths"):
        p.propose(["b"], [], [4])


def test_readd_after_preemption_rebuilds_state():
    p = _proposer(k=4)
    p.add_request("a", [1, 2, 3])
    p.update_request("a", [7, 8])
    p.add_request("a", [1, 2, 3])  # preempted and re-admitted
    p.update_request("a", [7, 8])
    assert p.cache.global_tree.count([7, 8]) == 1 and p.cache.local_tree("a").count([3, 7, 8]) == 1


def test_drafts_match_brute_force_over_both_trees():
    rng = np.random.default_rng(1)
    p = _proposer(k=6, suffix_decoding_max_tree_depth=6, suffix_decoding_min_token_prob=0.2)
    responses = [rng.integers(0, 4, size=15).tolist() for _ in range(3)]
    for i, r in enumerate(responses):
        p.add_request(f"p{i}", [9])
        p.update_request(f"p{i}", r)
        p.remove_request(f"p{i}")
    prompt = rng.integers(0, 4, size=12).tolist()
    p.add_request("q", prompt)
    local, glob = BruteSuffixIndex([prompt], 6), BruteSuffixIndex(responses, 6)
    for _ in range(20):
        ctx = rng.integers(0, 4, size=int(rng.integers(1, 9))).tolist()
        row = [int(t) for t in p.propose(["q"], [np.array(ctx)], [6])[0] if t >= 0]
        lt, ls, _ = local.speculate(ctx[-6:], 6, 1.0, 0.0, 0.2)
        gt, gs, _ = glob.speculate(ctx[-6:], 6, 1.0, 0.0, 0.2)
        assert row == (gt if gs > ls else lt)
        assert p.last_drafts[0].token_ids == row
