"""Engine-core cases found by an audit: a priority preemption of a request already scheduled in the step must not
leave its uncomputed blocks in the prefix cache; a prompt larger than the whole KV cache is a ValueError; an n > 1
request whose child id is taken is rejected whole; an explicit AsyncLLM.abort ends the consumer's stream."""

from __future__ import annotations

import asyncio

import pytest

from ascent import LLM, SamplingParams
from ascent.args import EngineArgs
from ascent.core.async_llm import AsyncLLM


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(model=model_dir, dtype="float32", max_model_len=256, disable_log_stats=True, **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_priority_preemption_of_a_scheduled_request_keeps_prefix_cache_clean(tiny_llama_dir):
    low = [(11 * j) % 450 + 3 for j in range(100)]
    expected = _llm(tiny_llama_dir).generate({"prompt_token_ids": low}, _greedy(8), use_tqdm=False)[0]
    llm = _llm(tiny_llama_dir, num_gpu_blocks_override=9, block_size=16, enable_prefix_caching=True,
               scheduling_policy="priority", max_num_batched_tokens=64, max_num_seqs=64,
               long_prefill_token_threshold=32)
    engine = llm.llm_engine
    engine.add_request("low", {"prompt_token_ids": low}, _greedy(8), priority=5)  # admitted first
    engine.step()
    engine.add_request("high", {"prompt_token_ids": [7] * 40}, _greedy(4), priority=0)
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert engine.engine_core.scheduler.num_preemptions_total > 0
    assert done["low"] == expected.outputs[0].token_ids


def test_prompt_larger_than_the_kv_cache_is_rejected(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, num_gpu_blocks_override=5, block_size=16)
    with pytest.raises(ValueError, match="does not fit the KV cache: it holds 64 tokens"):
        llm.llm_engine.add_request("big", {"prompt_token_ids": list(range(3, 103))}, _greedy(2))
    assert not llm.llm_engine.has_unfinished_requests()  # (it used to wait for blocks forever)
    out = llm.generate({"prompt_token_ids": list(range(3, 43))}, _greedy(2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_n_request_with_a_taken_child_id_leaves_nothing_behind(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    engine.add_request("1_a", "hello", _greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "hello", SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("1_a", "again", _greedy(3))
    finished = []
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["1_a"] and not engine.output_processor.parent_requests
    mgr = engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1


def test_explicit_abort_ends_the_stream(tiny_llama_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                                                  disable_log_stats=True))

    async def main() -> list:
        outs = []
        async def consume():
            async for out in engine.generate("hello", _greedy(200), "r"):
                outs.append(out)
                if len(outs) == 1:
                    await engine.abort("r")
        await asyncio.wait_for(consume(), timeout=60)
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
