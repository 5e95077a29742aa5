"""Speculative decoding end to end: greedy output with every proposer equals plain greedy output.

An oracle proposer (the true greedy continuation) must get every draft accepted; a random proposer must break nothing;
the same holds under preemption and prefix caching.
"""

from __future__ import annotations

import numpy as np
import pytest

from ascent import LLM, SamplingParams
from ascent.spec_decode.base import Proposer
from tests.integration.helpers import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rep = [11, 12, 13, 14, 15, 16] * 5  # repetitive: n-gram / suffix matches exist
    return [rep, rep[:17] + [40, 41] + rep[:9]] + random_prompts(3, 512, 4, 30, seed=41)


def _run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _make(model_dir: str, spec: dict | None = None, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=256, disable_log_stats=True)
    args.update(kw)
    return LLM(model=model_dir, speculative_config=spec, **args)


def _spec_stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_stats_total


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return _run(_make(tiny_llama_dir), _prompts())


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    {"method": "suffix", "num_speculative_tokens": 4},
])
def test_model_free_proposers_keep_greedy_output(tiny_llama_dir, plain, spec):
    llm = _make(tiny_llama_dir, spec)
    assert _run(llm, _prompts()) == plain
    assert _run(llm, _prompts()) == plain  # suffix: the global tree now knows these responses
    stats = _spec_stats(llm)
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    mgr = llm.llm_engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1


class _OracleProposer(Proposer):
    """Proposes the known greedy continuation (test-only)."""

    def __init__(self, config, max_model_len, prompts, continuations) -> None:
        super().__init__(config, max_model_len)
        self.truth = {tuple(p): c for p, c in zip(prompts, continuations)}

    def propose(self, req_ids, token_ids, max_num_tokens):
        k = self.config.num_speculative_tokens
        out = np.full((len(req_ids), k), -1, dtype=np.int64)
        for i, toks in enumerate(token_ids):
            toks = list(toks)
            for prompt, cont in self.truth.items():
                if tuple(toks[: len(prompt)]) == prompt:
                    done = len(toks) - len(prompt)
                    nxt = cont[done : done + min(k, max_num_tokens[i])]
                    out[i, : len(nxt)] = nxt
        return out


class _RandomProposer(Proposer):
    def propose(self, req_ids, token_ids, max_num_tokens):
        rng = np.random.default_rng(len(token_ids[0]) if token_ids else 0)
        k = self.config.num_speculative_tokens
        out = rng.integers(3, 512, size=(len(req_ids), k))
        for i, m in enumerate(max_num_tokens):
            out[i, m:] = -1
        return out


def _swap_proposer(llm: LLM, proposer: Proposer) -> None:
    llm.llm_engine.engine_core.worker.model_runner.spec.proposer = proposer


def test_oracle_proposer_gets_every_draft_accepted(tiny_llama_dir, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _make(tiny_llama_dir, spec)
    runner = llm.llm_engine.engine_core.worker.model_runner
    _swap_proposer(llm, _OracleProposer(runner.spec.config, 256, _prompts(), plain))
    assert _run(llm, _prompts()) == plain
    stats = _spec_stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_random_proposer_breaks_nothing_even_under_preemption(tiny_llama_dir, plain):
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = _make(tiny_llama_dir, spec, num_gpu_blocks_override=8, enable_prefix_caching=True)
    runner = llm.llm_engine.engine_core.worker.model_runner
    _swap_proposer(llm, _RandomProposer(runner.spec.config, 256))
    assert _run(llm, _prompts()) == plain
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert _spec_stats(llm).num_draft_tokens > 0
    mgr = llm.llm_engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1


def test_spec_decode_logprobs_and_stop(tiny_llama_dir, plain):
    llm = _make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": _prompts()[0]}, params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == plain[0][:10] and len(out.logprobs) == 10
    assert all(t in e for t, e in zip(out.token_ids, out.logprobs))
    stop_at = plain[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate({"prompt_token_ids": _prompts()[0]}, params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == plain[0][: plain[0].index(stop_at) + 1]


def test_bad_speculative_config_is_a_value_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="warp"):
        _make(tiny_llama_dir, {"method": "warp", "num_speculative_tokens": 2})


def test_min_tokens_with_drafts(tiny_llama_dir):
    """EOS is forced by logit_bias; min_tokens must still hold at every draft position."""
    llm = _make(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3})
    eos = min(llm.llm_engine.config.model_config.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, logit_bias={eos: 100.0})
    out = llm.generate({"prompt_token_ids": [eos, 5, eos, 5, eos, 5]}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and eos not in out.token_ids[:6]
