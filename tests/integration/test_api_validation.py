"""Bad input through the offline API: a ValueError naming the value, nothing leaks, the engine keeps working."""

from __future__ import annotations

import pytest

from ascent import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
    (dict(logprobs=-5), "logprobs"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_rejected(llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[100000]), use_tqdm=False)
    with pytest.raises(ValueError, match="out-of-vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 99999]}, use_tqdm=False)


def test_over_long_and_empty_prompts_rejected_without_leaks(llm):
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7] * 64}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    mgr = engine.engine_core.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks - 1
    out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_unknown_engine_argument(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_sequences"):
        LLM(model=tiny_llama_dir, max_num_sequences=3)


def test_n_and_stop_strings_and_min_tokens(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    out = llm.generate("hello", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
    greedy = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    text = greedy[0].outputs[0].text
    assert len(text) > 3
    stop = text[2:4]
    cut = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.index(stop)]
    eos = llm.llm_engine.config.model_config.eos_token_ids
    forced = SamplingParams(temperature=0, max_tokens=5, min_tokens=5, logit_bias={min(eos): 100.0})
    comp = llm.generate("hello", forced, use_tqdm=False)[0].outputs[0]
    assert len(comp.token_ids) == 5 and not (set(comp.token_ids) & eos)
    stops = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, logit_bias={min(eos): 100.0}),
                         use_tqdm=False)[0].outputs[0]
    assert stops.finish_reason == "stop" and len(stops.token_ids) == 1


def test_stop_token_ids_and_eos_union(llm):
    base = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ids = list(base[0].outputs[0].token_ids)
    target = ids[2]
    first = ids.index(target)
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[target]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert list(out.token_ids) == ids[: first + 1]
    # the model's EOS set = tokenizer EOS ∪ generation_config eos_token_id (the fixture writes [2])
    assert 2 in llm.llm_engine.config.model_config.eos_token_ids
