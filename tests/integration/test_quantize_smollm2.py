"""``ascent quantize`` on the default SmolLM2-135M-Instruct (GGUF -> bf16 HF directory, compressed-tensors W8A16 and
W8A8 dynamic), reloaded by the engine: greedy chat answers stay close to the bf16 model's and read as English."""

from __future__ import annotations

import re

import pytest

from ascent import LLM, SamplingParams
from ascent.quantization.export import export_float_model
from ascent.quantization.export.source import load_float_model

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain what a cache is in one paragraph.",
    "Write a short poem about the sea.",
]
MAX_TOKENS = 32
# Teacher-forced greedy agreement with the bf16 engine (the fraction of the bf16 greedy answer tokens that are also the
# quantized model's top-1 when fed the same prefix), measured here over 4 prompts x 32 tokens: bf16 against itself
# 0.95 (batched prefill vs decode rounding), W8A16 0.92, W8A8 dynamic 0.85 (for comparison, not tested here: W8A8
# static 0.55, W4A16 g64 0.57, W4A8 0.47). Free-running greedy prefix agreement is much lower (0.54 / 0.13) because
# one early flip changes the whole continuation, so it is not used.
AGREEMENT_FLOOR = {"w8a16": 0.85, "w8a8_dynamic": 0.75}
WORD = re.compile(r"[A-Za-z]+")


def chat(llm: LLM) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Greedy chat answers: (prompt token ids, output token ids, output texts)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    return ([list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs],
            [o.outputs[0].text for o in outs])


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Fraction of ``answers`` tokens that are ``llm``'s top-1 given the prompt and the preceding answer tokens."""
    requests = [{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)]
    results = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)
    hits = total = 0
    for result, prompt, answer in zip(results, prompts, answers):
        for token, entry in zip(answer, result.prompt_logprobs[len(prompt):]):
            total += 1
            hits += int(entry[token].rank == 1)
    return hits / total


def is_coherent(text: str) -> bool:
    """Non-empty, mostly ASCII, and mostly made of alphabetic words."""
    if not text.strip():
        return False
    ascii_fraction = sum(c.isascii() for c in text) / len(text)
    tokens = text.split()
    wordy = sum(bool(WORD.search(t)) for t in tokens) / max(len(tokens), 1)
    return ascii_fraction >= 0.9 and wordy >= 0.6


@pytest.fixture(scope="module")
def baseline() -> tuple[list[list[int]], list[list[int]], list[str]]:
    return chat(LLM(model=None, dtype="bfloat16", max_model_len=512, disable_log_stats=True))


@pytest.fixture(scope="module")
def float_model():
    return load_float_model(None, "bfloat16")


# ~70 s per scheme on a loaded 2-core box: part of the default run (the suite stays well inside its budget)
@pytest.mark.parametrize("scheme", ["w8a16", "w8a8_dynamic"])
def test_quantized_smollm2_generates_like_bf16(tmp_path, baseline, float_model, scheme):
    out = tmp_path / scheme
    export_float_model(float_model, scheme, "compressed-tensors", out)
    llm = LLM(model=str(out), dtype="bfloat16", max_model_len=512, disable_log_stats=True)
    prompts, answers, base_texts = baseline
    assert all(is_coherent(t) for t in base_texts), base_texts
    texts = chat(llm)[2]
    assert all(is_coherent(t) for t in texts), texts
    agreement = teacher_forced_agreement(llm, prompts, answers)
    assert agreement >= AGREEMENT_FLOOR[scheme], (agreement, texts, base_texts)
