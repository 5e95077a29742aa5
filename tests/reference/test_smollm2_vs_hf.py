"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF): ascent's greedy tokens and logprobs equal transformers'
on the same file (transformers dequantizes the GGUF itself: an independent loader, tokenizer and forward)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ascent import LLM, SamplingParams
from ascent.default_model import default_model_path
from tests.integration.helpers import hf_greedy, hf_logprobs

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "What is 12 times 7?",
    "Explain what a KV cache is in one sentence.",
    "List three colors:",
    "def fibonacci(n):",
    "Translate 'good morning' to Spanish.",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    torch.set_num_threads(int(os.environ.get("ASCENT_TEST_THREADS", "2")))
    d, f = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    d, f = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=8, disable_log_stats=True)


def test_engine_releases_the_gguf_reader_after_loading(llm):
    """The reader start-up shares between config, tokenizer and weights is dropped once the weights are loaded: it
    holds ~500k Python objects for this vocabulary."""
    from ascent.loader.gguf import _cached_reader

    assert llm.llm_engine.engine_core.worker.model_runner.model is not None
    assert _cached_reader.cache_info().currsize == 0


def _chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def test_greedy_equals_transformers(llm, hf_model, hf_tokenizer):
    prompts = [_chat_ids(hf_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    assert ours == hf_greedy(hf_model, prompts, NEW_TOKENS)
    # logits within tolerance: the engine's logprob of each chosen token vs transformers' teacher-forced logprob
    for prompt, out in zip(prompts[:3], outs[:3]):
        comp = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt, list(comp.token_ids))
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert entry[tok].logprob == pytest.approx(ref[step, tok].item(), abs=2e-3)


def test_text_prompt_tokenizes_like_transformers(llm, hf_tokenizer):
    """String prompts go through ascent's own GGUF tokenizer; the text round trip must equal transformers'."""
    text = PROMPTS[3]
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert out.outputs[0].text == hf_tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_uses_the_gguf_template(llm, hf_tokenizer):
    out = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=4),
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == _chat_ids(hf_tokenizer, PROMPTS[0])
