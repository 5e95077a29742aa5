"""Scheduling invariances: outputs must not depend on batching, prefix caching, chunking or preemption."""

from __future__ import annotations

import random

import pytest

from ascent import LLM, SamplingParams
from tests.integration.helpers import random_prompts, token_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = random_prompts(5, 512, 2, 30, seed=5)
    # shared-prefix prompts exercise prefix caching (prefix spans several 16-token blocks)
    prompts += [shared + [rng.randrange(3, 512) for _ in range(k)] for k in (1, 5, 17)]
    prompts.append(list(shared))
    return prompts


def _make(model_dir: str, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=256, max_num_seqs=8, disable_log_stats=True)
    args.update(kw)
    return LLM(model=model_dir, **args)


def _run(llm: LLM, prompts, params=GREEDY):
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def _assert_all_blocks_free(llm: LLM) -> None:
    mgr = llm.llm_engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1
    assert mgr.usage == 0.0


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = _make(tiny_llama_dir, enable_prefix_caching=False)
    prompts = _prompts()
    one_by_one = [_run(llm, [p])[0] for p in prompts]
    return prompts, one_by_one


def test_batched_equals_one_at_a_time(tiny_llama_dir, reference):
    prompts, expected = reference
    llm = _make(tiny_llama_dir, enable_prefix_caching=False)
    assert _run(llm, prompts) == expected
    _assert_all_blocks_free(llm)


def test_prefix_caching_on_equals_off(tiny_llama_dir, reference):
    prompts, expected = reference
    llm = _make(tiny_llama_dir, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert token_ids(first) == expected and token_ids(again) == expected
    # second pass: every prompt's full blocks are cached: hit = floor((L-1)/bs)*bs
    for p, out in zip(prompts, again):
        assert out.num_cached_tokens == (len(p) - 1) // 16 * 16
    _assert_all_blocks_free(llm)


def test_chunked_prefill_equals_unchunked(tiny_llama_dir, reference):
    prompts, expected = reference
    # max_num_seqs <= the budget (vLLM's rule); no step could schedule more sequences than tokens anyway
    llm = _make(tiny_llama_dir, max_num_batched_tokens=7, max_num_seqs=7, enable_prefix_caching=True)
    assert _run(llm, prompts) == expected
    llm2 = _make(tiny_llama_dir, max_num_batched_tokens=13, long_prefill_token_threshold=5)
    assert _run(llm2, prompts) == expected
    _assert_all_blocks_free(llm)


def test_preemption_equals_no_preemption(tiny_llama_dir, reference):
    prompts, expected = reference
    llm = _make(tiny_llama_dir, num_gpu_blocks_override=10, block_size=16, enable_prefix_caching=True)
    assert _run(llm, prompts) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    _assert_all_blocks_free(llm)


def test_priority_policy_runs_urgent_first(tiny_llama_dir):
    llm = _make(tiny_llama_dir, max_num_seqs=1, scheduling_policy="priority")
    prompts = random_prompts(3, 512, 4, 8, seed=11)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, (p, prio) in enumerate(zip(prompts, [5, 0, 3])):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["r1", "r2", "r0"]


def test_abort_frees_every_block(tiny_llama_dir):
    llm = _make(tiny_llama_dir)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(4, 512, 20, 40, seed=3)):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    for _ in range(3):
        engine.step()
    assert engine.engine_core.kv_cache_manager.usage > 0
    engine.abort_request(["a0", "a1", "a2", "a3"])
    assert not engine.has_unfinished_requests()
    _assert_all_blocks_free(llm)
    # the engine keeps serving after aborts
    assert len(_run(llm, [[5, 6, 7]])[0]) == 20


def test_seeded_sampling_independent_of_batch(tiny_llama_dir):
    llm = _make(tiny_llama_dir)
    target = [11, 12, 13, 14]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = _run(llm, [target], seeded)[0]
    others = random_prompts(5, 512, 3, 30, seed=9)
    params = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 2 + [seeded] + [
        SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)] * 3
    mixed = _run(llm, others[:2] + [target] + others[2:], params)
    assert mixed[2] == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=4321, ignore_eos=True)
    assert _run(llm, [target], other_seed)[0] != alone
