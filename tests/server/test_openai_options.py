"""vLLM request fields of the OpenAI server: the ones it applies (prompt_logprobs, allowed_token_ids, bad_words,
truncate_prompt_tokens, echo without generation, clamped logit_bias), the ones it rejects with a 400 (out-of-range
seed, streamed prompt_logprobs, priority under fcfs, structured output, tool calls), and the chunk format."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

CHAT = [{"role": "user", "content": "Hello there"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.api_url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def _ok(server, path: str, body: dict) -> dict:
    resp = _post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _tokenize(server, text: str) -> list[int]:
    return httpx.post(server.base_url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


@pytest.mark.parametrize("path,body,needle", [
    ("/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("/completions", {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/completions", {"prompt": "hi", "prompt_logprobs": 21}, "max allowed: 20"),
    ("/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "max allowed: 20"),
    ("/completions", {"prompt": "hi", "priority": 5}, "Priority scheduling is not enabled"),
    ("/completions", {"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ("/completions", {"prompt": "hi", "guided_json": {"type": "object"}}, "guided_json"),
    ("/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                           "tool_choice": "required"}, "tool"),
    ("/chat/completions", {"messages": CHAT, "bad_words": "no"}, "bad_words"),
])
def test_unsupported_or_out_of_range_fields_are_400(server, path, body, needle):
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]
    if "seed" in body:  # a field's own check names the field
        assert resp.json()["error"]["param"] == "seed"
    assert _ok(server, "/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1})["choices"]


def test_prompt_logprobs_are_returned(server):
    prompt_ids = _tokenize(server, "The quick brown fox")
    out = _ok(server, "/completions", {"prompt": "The quick brown fox", "max_tokens": 1, "prompt_logprobs": 2})
    entries = out["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token_id, entry in zip(prompt_ids[1:], entries[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # the prompt token and the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 and v["decoded_token"] is not None for v in entry.values())
    chat = _ok(server, "/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert _ok(server, "/completions", {"prompt": "hi", "max_tokens": 1})["choices"][0]["prompt_logprobs"] is None


def _word_tokens(server, word: str) -> tuple[list[int], list[int]]:
    def ids(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["tokens"]
    return ids(word), ids(" " + word)


def test_allowed_token_ids_and_bad_words_reach_the_sampler(server):
    # a word whose bare and spaced forms are single, different tokens: bad_words bans both (vLLM's rule)
    word = next(w for w in ("the", "and", "of", "to", "in", "is", "it", "a")
                if (lambda a, b: len(a) == len(b) == 1 and a != b)(*_word_tokens(server, w)))
    (bare,), (spaced,) = _word_tokens(server, word)
    other = _word_tokens(server, "dog")[1][-1]
    base = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    only = _ok(server, "/completions", {**base, "allowed_token_ids": [spaced]})["choices"][0]
    assert only["text"] == (" " + word) * 4
    banned = _ok(server, "/completions", {**base, "allowed_token_ids": [bare, spaced, other], "bad_words": [word]})
    assert banned["choices"][0]["text"] == " dog" * 4


def test_logit_bias_is_clamped_to_100(server):
    base = {"prompt": "hi", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    forced = _ok(server, "/completions", {**base, "logit_bias": {"30": 100}})["choices"][0]["text"]
    raw = json.dumps({"model": MODEL_NAME, **base}).rstrip("}") + ', "logit_bias": {"30": 1e999}}'
    resp = httpx.post(server.api_url + "/completions", content=raw, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == forced


def test_truncate_prompt_tokens_keeps_the_tail(server):
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN + 20))
    out = _ok(server, "/completions", {"prompt": long_prompt, "max_tokens": 2, "truncate_prompt_tokens": 10})
    assert out["usage"]["prompt_tokens"] == 10


def test_echo_without_generation_scores_the_prompt(server):
    out = _ok(server, "/completions", {"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = out["choices"][0]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == out["usage"]["prompt_tokens"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert out["usage"]["completion_tokens"] == 0


def test_chat_top_logprobs_zero_needs_no_logprobs_flag(server):
    out = _ok(server, "/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 0})
    assert out["choices"][0]["logprobs"] is None


def test_stream_chunks_carry_null_finish_reason(server):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.api_url + "/chat/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert all("finish_reason" in c for c in choices)
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length" and events[0]["object"] == "chat.completion.chunk"
    assert events[0]["usage"]["completion_tokens"] == 0  # the role chunk, with continuous usage


def test_ignored_fields_are_logged(server, caplog):
    with caplog.at_level(logging.WARNING, logger="ascent.entrypoints.openai.protocol"):
        _ok(server, "/completions", {"prompt": "hi", "max_tokens": 1, "no_such_field": 1})
    assert any("no_such_field" in r.getMessage() for r in caplog.records)


def test_generation_config_fills_unset_sampling_fields():
    from ascent.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    params = CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(100, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.3, 5, 1.0, 7)
    params = CompletionRequest(prompt="x", temperature=0.9, max_tokens=20).to_sampling_params(100, defaults)
    assert (params.temperature, params.max_tokens) == (0.9, 20)
    chat = ChatCompletionRequest(messages=CHAT).to_sampling_params(4, defaults)
    assert chat.max_tokens == 4  # the room left in the context caps the default
