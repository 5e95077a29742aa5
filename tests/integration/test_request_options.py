"""vLLM request options checked and applied by the engine: max_logprobs, priority under fcfs, seed range,
truncate_prompt_tokens and bad_words (unit checks of the bad-words mask with it)."""

from __future__ import annotations

import pytest
import torch

from ascent import LLM, SamplingParams
from ascent.sample.penalties import apply_bad_words


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True)


def _greedy(llm, prompt, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(logprobs=21), "sample logprobs of 21, which is greater than max allowed: 20"),
    (dict(logprobs=-1), "sample logprobs of"),
    (dict(prompt_logprobs=-1), "prompt logprobs of"),
])
def test_logprobs_above_max_logprobs_are_rejected(llm, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        llm.generate("hi", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(_greedy(llm, "hi", logprobs=20).outputs[0].logprobs[0]) >= 20


def test_max_logprobs_minus_one_allows_the_whole_vocabulary(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64, disable_log_stats=True, max_logprobs=-1)
    out = llm.generate("hi", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == llm.llm_engine.config.model_config.vocab_size
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model=tiny_llama_dir, max_logprobs=-2)


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="Got priority 5 but Priority scheduling is not enabled"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[0, 5], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, "7"])
def test_seed_outside_what_a_generator_takes_is_rejected(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_extreme_seeds_sample(llm):
    for seed in (2**64 - 1, -(2**63)):
        out = llm.generate("hi", SamplingParams(seed=seed, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = list(range(5, 75))  # longer than max_model_len=64
    out = _greedy(llm, {"prompt_token_ids": prompt}, truncate_prompt_tokens=10)
    assert out.prompt_token_ids == prompt[-10:]
    assert out.outputs[0].token_ids == _greedy(llm, {"prompt_token_ids": prompt[-10:]}).outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_apply_bad_words_masks_a_last_token_after_its_prefix():
    logits = torch.zeros(3, 10)
    apply_bad_words(logits, {0: [[4]], 1: [[2, 3, 7]], 2: [[2, 3, 8]]}, [[1], [5, 2, 3], [3, 2]])
    assert logits[0, 4] == float("-inf")
    assert logits[1, 7] == float("-inf")
    assert torch.isinf(logits).sum() == 2  # row 2's output does not end with [2, 3]


def _one_token_word(llm, token_id: int) -> str | None:
    tok = llm.get_tokenizer()
    word = tok.decode([token_id])
    return word if word.strip() and tok.encode(word.lstrip(), add_special_tokens=False) == [token_id] else None


def test_bad_words_are_never_generated(llm):
    base = _greedy(llm, "The quick brown fox").outputs[0].token_ids
    banned = [t for t in base if _one_token_word(llm, t)]
    assert banned, "no greedy token decodes to a word that encodes back to itself"
    word = _one_token_word(llm, banned[0])
    out = _greedy(llm, "The quick brown fox", bad_words=[word]).outputs[0].token_ids
    assert banned[0] not in out and out != base
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", " "])
