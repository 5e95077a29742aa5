"""Engine end to end against HF transformers on tiny random Llama / Qwen3 / Qwen2 directories (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ascent import LLM, SamplingParams
from tests.integration.helpers import hf_greedy, hf_logprobs, random_prompts, token_ids

MAX_NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def model_dir(request, tiny_llama_dir, tiny_qwen3_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen2": tiny_qwen2_dir}[request.param]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, dtype="float32", max_model_len=256, max_num_seqs=16, disable_log_stats=True)


def test_greedy_tokens_equal_hf(llm, hf_model):
    prompts = random_prompts(6, 512, 3, 40, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ours = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert ours == hf_greedy(hf_model, prompts, MAX_NEW)


def test_logprobs_match_hf(llm, hf_model):
    prompts = random_prompts(3, 512, 5, 20, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf_logprobs(hf_model, prompt, list(comp.token_ids))
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert tok in entry
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[step, tid].item()) <= 1e-4 * max(1.0, abs(ref[step, tid].item()))
            top5 = torch.topk(ref[step], 5).indices.tolist()
            assert set(top5) <= set(entry)
        assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))


def test_prompt_logprobs_match_hf(llm, hf_model):
    prompt = random_prompts(1, 512, 30, 30, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
