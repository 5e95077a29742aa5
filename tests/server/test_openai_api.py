"""The OpenAI-compatible server through the official ``openai`` client: routes, streaming format, sampling fields,
logprobs against transformers, and concurrent requests against offline ``LLM.generate``."""

from __future__ import annotations

import re

import asyncio
import json
import os

import httpx
import openai
import pytest
import torch

import ascent
from ascent import LLM, SamplingParams
from tests.integration.helpers import hf_greedy, hf_logprobs
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf_model(server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)


def _sse_events(server, path: str, body: dict) -> list[str]:
    """Raw ``data:`` payloads of one streaming request (checks the event framing on the way)."""
    with httpx.stream("POST", server.api_url + path, json=body, timeout=60.0) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


# ---------------------------------------------------------------------------------------------------- service routes
def test_health_models_version(server):
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(server.base_url + "/version").json() == {"version": ascent.__version__}
    metrics = httpx.get(server.base_url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    with openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0) as client:
        models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"


def test_tokenize_detokenize_round_trip(server):
    text = "The quick brown fox jumps over the lazy dog."
    tok = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(server.base_url + "/detokenize", json={"model": MODEL_NAME, "tokens": tok["tokens"]})
    assert detok.status_code == 200 and detok.json()["prompt"] == text
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = httpx.post(server.base_url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_profile_routes_write_a_trace(server, client):
    assert httpx.post(server.base_url + "/start_profile", timeout=60).status_code == 200
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    stop = httpx.post(server.base_url + "/stop_profile", timeout=120)
    assert stop.status_code == 200
    assert os.path.isfile(stop.json()["trace"]) and stop.json()["trace"].startswith(server.trace_dir)
    again = httpx.post(server.base_url + "/stop_profile", timeout=60)
    assert again.status_code == 400 and again.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------------- completions
def test_completion_non_stream_usage_and_ids(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=7, extra_body=NO_EOS,
                                     **GREEDY)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == MODEL_NAME
    assert isinstance(resp.created, int)
    (choice,) = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7 and resp.usage.prompt_tokens > 0


def test_completion_stream_matches_non_stream(server, client):
    body = {"model": MODEL_NAME, "prompt": "Paged attention", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    full = client.completions.create(model=MODEL_NAME, prompt="Paged attention", max_tokens=9, extra_body=NO_EOS,
                                     **GREEDY)
    events = _sse_events(server, "/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["id"].startswith("cmpl-")
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0].get("finish_reason") is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                                  "total_tokens"})


def test_completion_batched_prompts_and_n(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=["Hello world", "Numbers 0123"], n=3, max_tokens=5,
                                     temperature=1.0, seed=3, extra_body=NO_EOS)
    assert sorted(c.index for c in resp.choices) == list(range(6))
    assert resp.usage.completion_tokens == 30
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=1) for p in ("Hello world",
                                                                                             "Numbers 0123")]
    assert resp.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_completion_stream_batched_prompts_and_n(server):
    body = {"model": MODEL_NAME, "prompt": ["Hello world", "Numbers 0123"], "n": 2, "max_tokens": 4, "seed": 5,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [json.loads(e) for e in _sse_events(server, "/completions", body)[:-1]]
    finished = sorted(c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0].get("finish_reason"))
    assert finished == [0, 1, 2, 3] and chunks[-1]["usage"]["completion_tokens"] == 16


def test_completion_stop_string(client):
    base = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, extra_body=NO_EOS,
                                     **GREEDY).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    assert stop.strip(), "the stop string must be visible text"
    cut = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, stop=[stop],
                                    extra_body=NO_EOS, **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.find(stop)]
    kept = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, stop=stop,
                                     extra_body={**NO_EOS, "include_stop_str_in_output": True}, **GREEDY)
    assert kept.choices[0].text == base[:base.find(stop) + len(stop)]


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body=NO_EOS).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_completion_logprobs_match_transformers(client, hf_model, hf_tokenizer):
    prompt = [5, 17, 42, 99, 123, 7]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, logprobs=3, extra_body=NO_EOS,
                                     **GREEDY)
    lp = resp.choices[0].logprobs
    tokens = hf_greedy(hf_model, [prompt], 6)[0]
    ref = hf_logprobs(hf_model, prompt, tokens)
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in tokens]
    for i, token_id in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i, token_id]), abs=1e-3)
        top_ref = sorted(ref[i].topk(3).values.tolist(), reverse=True)
        assert sorted(lp.top_logprobs[i].values(), reverse=True)[:3] == pytest.approx(top_ref, abs=1e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_echo(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=3, echo=True,
                                     extra_body=NO_EOS, **GREEDY)
    plain = client.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=3, extra_body=NO_EOS,
                                      **GREEDY)
    assert resp.choices[0].text == "Hello world" + plain.choices[0].text


# ---------------------------------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


def test_chat_non_stream(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6,
                                          extra_body=NO_EOS, **GREEDY)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL_NAME
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 6 and resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    legacy = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY,
                                            extra_body={**NO_EOS, "chat_template_kwargs": {"unused_variable": 1}})
    assert legacy.choices[0].message.content == choice.message.content


def test_chat_stream_format(server, client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, n=2, seed=11,
                                          temperature=0.8, extra_body=NO_EOS)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "n": 2, "seed": 11, "temperature": 0.8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = _sse_events(server, "/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in m["delta"] for m in mine[1:])
        assert mine[-1]["finish_reason"] == "length"
        assert all(m.get("finish_reason") is None for m in mine[:-1])
        assert "".join(m["delta"].get("content", "") for m in mine) == full.choices[index].message.content


def test_chat_stream_with_openai_client(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, stream=True,
                                            extra_body=NO_EOS, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_chat_logprobs_match_transformers(server, client, hf_model, hf_tokenizer):
    prompt = httpx.post(server.base_url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                          top_logprobs=2, extra_body=NO_EOS, **GREEDY)
    assert resp.usage.prompt_tokens == len(prompt)
    content = resp.choices[0].logprobs.content
    tokens = hf_greedy(hf_model, [prompt], 5)[0]
    ref = hf_logprobs(hf_model, prompt, tokens)
    assert [c.token for c in content] == [hf_tokenizer.decode([t]) for t in tokens]
    for i, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-3)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref[i].topk(2).values.tolist(), abs=1e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the best


# ---------------------------------------------------------------------------------------------------- concurrency
def test_concurrent_greedy_requests_equal_offline(server):
    words = ["quick", "brown", "fox", "lazy", "dog", "blocks", "tokens", "model"]
    prompts = [f"The {words[i % 8]} {words[(i * 3) % 8]} number {i}" for i in range(16)]

    async def one(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
        kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, extra_body=NO_EOS, **GREEDY)
        if not stream:
            return (await client.completions.create(**kwargs)).choices[0].text
        return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kwargs)])

    async def all_requests() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", timeout=120, max_retries=0) as c:
            return await asyncio.wait_for(
                asyncio.gather(*[one(c, p, i % 2 == 1) for i, p in enumerate(prompts)]), timeout=300)

    served = asyncio.run(all_requests())
    llm = LLM(model=server.model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes="16M",
              disable_log_stats=True)
    offline = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert served == [o.outputs[0].text for o in offline]


# ---------------------------------------------------------------------------------------------------- ascent serve
def test_serve_args_accept_positional_or_flag_model():
    import argparse

    from ascent.entrypoints.openai.api_server import add_serve_args, resolve_model_arg

    parser = add_serve_args(argparse.ArgumentParser())
    positional = parser.parse_args(["/models/a", "--port", "9000", "--served-model-name", "x", "y"])
    assert resolve_model_arg(positional) == "/models/a" and positional.served_model_name == ["x", "y"]
    assert resolve_model_arg(parser.parse_args(["--model", "/models/b"])) == "/models/b"
    defaults = parser.parse_args([])
    assert resolve_model_arg(defaults) is None and (defaults.host, defaults.port) == ("127.0.0.1", 8000)
    with pytest.raises(ValueError, match="twice"):
        resolve_model_arg(parser.parse_args(["/models/a", "--model", "/models/b"]))


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_run_server_serves_until_signal(tiny_llama_dir, tmp_path, stop_signal):
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    code = ("import argparse, logging, sys; logging.basicConfig(level=logging.INFO); "
            "from ascent.entrypoints.openai.api_server import add_serve_args, run_server; "
            "sys.exit(run_server(add_serve_args(argparse.ArgumentParser()).parse_args(sys.argv[1:])))")
    args = [tiny_llama_dir, "--port", str(port), "--served-model-name", "first", "second", "--dtype", "float32",
            "--max-model-len", "128", "--kv-cache-memory-bytes", "8M", "--num-threads", "1",
            "--uvicorn-log-level", "warning", "--trace-dir", str(tmp_path), "--chat-template", str(template)]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(base):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.1)
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["first", "second"]
        resp = httpx.post(base + "/v1/completions", json={"model": "second", "prompt": "Hi", "max_tokens": 2},
                          timeout=60)
        assert resp.status_code == 200 and resp.json()["model"] == "second"
        ids = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == "[user]hi"
        proc.send_signal(getattr(signal, stop_signal))
        assert proc.wait(timeout=60) == 0
        frozen = re.search(r"froze (\d+) start-up objects", proc.stdout.read().decode())
        assert frozen is not None and int(frozen.group(1)) > 10_000  # the start-up heap left the collector's walks
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()


def test_freeze_startup_heap_keeps_collecting_later_garbage():
    import gc
    import weakref

    from ascent.entrypoints.openai.api_server import freeze_startup_heap

    class Node:
        """Holds a reference to itself below: garbage only a collection frees."""

    try:
        assert freeze_startup_heap() > 0 and gc.get_freeze_count() > 0  # (frozen objects still die by refcount)
        cycle = Node()
        cycle.self = cycle
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
