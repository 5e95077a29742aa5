"""Shared helpers for engine-level tests: HF reference generation and prompt sets."""

from __future__ import annotations

import random

import torch


def random_prompts(num: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy continuation by transformers (argmax each step with its KV cache), one prompt at a time, no EOS
    handling — exactly what ``SamplingParams(temperature=0, ignore_eos=True)`` asks of the engine."""
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = hf_model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        outs.append(tokens)
    return outs


def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at the positions that produced each output token: [len(output), V] float64."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
