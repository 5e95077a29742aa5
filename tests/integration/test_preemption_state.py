"""What a request keeps across preemption (recompute): its seeded sample stream and the prompt logprobs already
returned; and a min_tokens that does not fit the context ends the request at max_model_len instead of hanging."""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams
from tests.integration.helpers import random_prompts


def _make(model_dir: str, **kw) -> LLM:
    return LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 512, 14, 28, seed=21)


def _tight(model_dir: str) -> LLM:
    return _make(model_dir, num_gpu_blocks_override=9, block_size=16, enable_prefix_caching=False)


def test_seeded_sampling_survives_preemption(tiny_llama_dir, prompts):
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(3)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = [o.outputs[0].token_ids for o in _make(tiny_llama_dir).generate(requests, params, use_tqdm=False)]
    llm = _tight(tiny_llama_dir)
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert got == expected


def test_prompt_logprobs_are_returned_once_across_preemption(tiny_llama_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = _make(tiny_llama_dir).generate(requests, params, use_tqdm=False)
    llm = _tight(tiny_llama_dir)
    got = llm.generate(requests, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    for p, want, out in zip(prompts, expected, got):
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        assert [e.keys() for e in out.prompt_logprobs[1:]] == [e.keys() for e in want.prompt_logprobs[1:]]
        for a, b in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_min_tokens_beyond_the_context_stops_at_max_model_len(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [504] * 60}, SamplingParams(max_tokens=10, min_tokens=10))
    finished = []
    for _ in range(20):  # bounded: before the fix the request never finished
        finished += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [o.outputs[0].finish_reason for o in finished] == ["length"]
    assert len(finished[0].outputs[0].token_ids) == 4


def test_min_tokens_holds_eos_back_even_with_ignore_eos(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True)
    eos = min(llm.llm_engine.config.model_config.eos_token_ids)
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    tokens = llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in tokens[:3] and tokens[3:] == [eos, eos]
