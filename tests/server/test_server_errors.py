"""Bad input gets an OpenAI-style 400/404 and never disturbs other requests; a client that disconnects aborts its
request and every KV block it held is freed."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, wait_until

GOOD = {"model": MODEL_NAME, "prompt": "Hello world", "max_tokens": 4, "temperature": 0.0}


def _assert_error(resp: httpx.Response, status: int, err_type: str) -> str:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == err_type and error["code"] == status and error["message"]
    return error["message"]


def _assert_still_serving(server) -> None:
    resp = httpx.post(server.api_url + "/completions", json=GOOD, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")


class EngineGate:
    """A stat observer that, while closed, holds the engine thread after its current step (so a test can act while
    a request is known to be unfinished)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()
        self.generated_tokens = 0
        self.finished_requests = 0

    def __call__(self, _scheduler_stats, iteration_stats) -> None:
        if iteration_stats is not None:
            self.generated_tokens += iteration_stats.num_generation_tokens
            self.finished_requests += len(iteration_stats.finished_requests)
        running = getattr(_scheduler_stats, "num_running_reqs", 0)
        if not self._open.is_set() and running > 0:  # hold only while a request is really in flight
            self.held.set()
            self._open.wait(timeout=60)

    def close(self) -> None:
        self.held.clear()
        self.generated_tokens = self.finished_requests = 0
        self._open.clear()

    def open(self) -> None:
        self._open.set()


@pytest.fixture(scope="module")
def gate(server):
    g = EngineGate()
    server.engine.add_stat_observer(g)
    yield g
    g.open()


# ---------------------------------------------------------------------------------------------------- bad requests
def test_malformed_json_is_400(server):
    resp = httpx.post(server.api_url + "/completions", content=b'{"prompt": "hi",', timeout=30,
                      headers={"content-type": "application/json"})
    assert "JSON" in _assert_error(resp, 400, "BadRequestError")
    _assert_still_serving(server)


@pytest.mark.parametrize("path,body,needle", [
    ("/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/completions", {"prompt": "hi", "top_p": 2}, "top_p"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ("/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/completions", {"prompt": 123}, "prompt"),
    ("/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream"),
    ("/completions", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias"),
    ("/completions", {"prompt": []}, "prompt"),
    ("/completions", {"prompt": [3, 100000]}, "vocabulary"),
    ("/completions", {"max_tokens": 3}, "prompt"),
    ("/chat/completions", {"messages": "hi"}, "messages"),
    ("/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "/etc/hosts"},
     "chat_template"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                           "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
])
def test_invalid_parameters_are_400(server, path, body, needle):
    resp = httpx.post(server.api_url + path, json={"model": MODEL_NAME, **body}, timeout=30)
    assert needle in _assert_error(resp, 400, "BadRequestError")
    _assert_still_serving(server)


def test_prompt_longer_than_max_model_len(server, client):
    too_long = list(range(3, 3 + MAX_MODEL_LEN + 10))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt=too_long, max_tokens=4)
    assert "maximum context length" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                       messages=[{"role": "user", "content": "fox " * MAX_MODEL_LEN}])
    with pytest.raises(openai.BadRequestError) as err:  # fits alone, but not with the requested output
        client.completions.create(model=MODEL_NAME, prompt=too_long[:MAX_MODEL_LEN - 8], max_tokens=20)
    assert "max_tokens" in err.value.body["message"]
    _assert_still_serving(server)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in err.value.body["message"] and err.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    _assert_error(httpx.post(server.base_url + "/tokenize", json={"model": "x", "prompt": "a"}), 404, "NotFoundError")
    _assert_error(httpx.get(server.base_url + "/no/such/route"), 404, "NotFoundError")
    _assert_still_serving(server)


def test_bad_requests_do_not_disturb_concurrent_good_ones(server):
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN))

    async def good(client: openai.AsyncOpenAI) -> str | None:
        stream = await client.completions.create(model=MODEL_NAME, prompt="The lazy dog", max_tokens=16,
                                                 stream=True, extra_body={"ignore_eos": True})
        return [c.choices[0].finish_reason async for c in stream if c.choices][-1]

    async def bad(client: openai.AsyncOpenAI) -> int:
        try:
            await client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4)
        except openai.BadRequestError as exc:
            return exc.status_code
        return 200

    async def main():
        async with openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", timeout=120, max_retries=0) as c:
            return await asyncio.wait_for(asyncio.gather(*[good(c) if i % 2 else bad(c) for i in range(8)]), 300)

    results = asyncio.run(main())
    assert results[0::2] == [400] * 4 and results[1::2] == ["length"] * 4
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)


# ---------------------------------------------------------------------------------------------------- disconnects
def _await_handlers_done(server) -> bool:
    return wait_until(lambda: not server.uvicorn_server.server_state.tasks, timeout_s=30)


def test_stream_disconnect_aborts_and_frees_kv(server, gate):
    body = {**GOOD, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.api_url + "/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["text"] is not None
        gate.close()  # hold the engine with the request unfinished, then hang up
        assert gate.held.wait(timeout=30)
        assert server.engine.kv_cache_usage() > 0.0
    try:
        assert _await_handlers_done(server)
    finally:
        gate.open()
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)
    assert gate.finished_requests == 0 and gate.generated_tokens < 200
    _assert_still_serving(server)


def test_non_stream_disconnect_aborts_and_frees_kv(server, gate):
    body = json.dumps({**GOOD, "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    # let earlier requests' final steps (and their stat-observer calls) drain before counting from zero
    assert wait_until(lambda: not server.engine.engine.has_unfinished_requests())
    time.sleep(0.3)
    gate.close()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            assert gate.held.wait(timeout=30)  # the request is running in the engine
            assert server.engine.kv_cache_usage() > 0.0
        except AssertionError:
            gate.open()
            raise
    try:
        assert _await_handlers_done(server)
    finally:
        gate.open()
    assert wait_until(lambda: server.engine.kv_cache_usage() == 0.0)
    assert gate.finished_requests == 0 and gate.generated_tokens < 200
    _assert_still_serving(server)
