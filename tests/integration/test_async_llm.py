"""AsyncLLM: concurrent streams equal offline generation; early exit aborts and frees KV; errors stay per request."""

from __future__ import annotations

import asyncio

import pytest

from ascent import LLM, SamplingParams
from ascent.args import EngineArgs
from ascent.core.async_llm import AsyncLLM
from ascent.outputs import RequestOutputKind
from tests.integration.helpers import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=128))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params, req_id):
    text, tokens = "", []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, req_id):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
    return tokens, text, out


def test_concurrent_streams_equal_offline(engine, tiny_llama_dir):
    prompts = random_prompts(8, 512, 3, 30, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, params, f"c{i}") for i, p in enumerate(prompts)])

    results = asyncio.run(main())
    offline = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, disable_log_stats=True)
    ref = offline.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for (tokens, text, last), r in zip(results, ref):
        assert tokens == list(r.outputs[0].token_ids)
        assert text == r.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_early_exit_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        gen = engine.generate({"prompt_token_ids": list(range(3, 40))}, params, "early")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(200):
            if engine.kv_cache_usage() == 0.0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_bad_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate({"prompt_token_ids": [5] * 500}, SamplingParams(), "too-long"):
                pass
        delta = SamplingParams(temperature=0.0, max_tokens=4, output_kind=RequestOutputKind.DELTA)
        tokens, _, _ = await _collect(engine, [5, 6, 7], delta, "ok")
        return tokens

    assert len(asyncio.run(main())) == 4
    assert engine.is_ready and not engine.errored
