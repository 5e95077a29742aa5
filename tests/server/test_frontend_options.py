"""``ascent serve`` frontend behaviour with vLLM's flags and fields: API keys, CORS, /ping, JSON-only bodies,
request ids, response role and chat echo, add_special_tokens, /tokenize options, message content forms, forced
usage chunks and request logging. Apps built here share the session server's engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ascent.entrypoints.openai.api_server import build_app
from ascent.entrypoints.openai.serving_tokens import FrontendOptions
from tests.server.conftest import MODEL_NAME

HI = [{"role": "user", "content": "Hi"}]
PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]


def _client(server, **kwargs) -> TestClient:
    return TestClient(build_app(server.engine, [MODEL_NAME], None, metrics_app=object(), **kwargs))


def _chat(client: TestClient, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True, **body})


def test_api_key_guards_the_v1_routes_only(server):
    client = _client(server, api_keys=["k1", "k2"])
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models").json() == {"error": "Unauthorized"}
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_cors_allows_every_origin_by_default(server):
    client = _client(server)
    got = client.get("/v1/models", headers={"Origin": "http://example.com"})
    assert got.headers["access-control-allow-origin"] == "*"
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200
    only = _client(server, allowed_origins=["http://a.example"])
    assert "access-control-allow-origin" not in only.get("/v1/models", headers={"Origin": "http://b.example"}).headers


def test_bodies_must_be_json(server):
    client = _client(server)
    form = client.post("/v1/completions", content="prompt=hi",
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "application/json" in form.json()["error"]["message"]
    bad = client.post("/v1/completions", content="{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None


def test_request_ids_come_from_the_header_or_the_body(server):
    client = _client(server)
    assert _chat(client, messages=HI, request_id="abc").json()["id"] == "chatcmpl-abc"
    assert _chat(client, messages=HI, request_id="abc").json()["id"] != _chat(client, messages=HI).json()["id"]
    got = client.post("/v1/completions", headers={"X-Request-Id": "hdr"}, json={
        "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "request_id": "body"})
    assert got.json()["id"] == "cmpl-hdr"
    assert client.post("/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": 2}).json()["model"] \
        == MODEL_NAME  # an empty model name means the default one, as vLLM


def test_response_role_and_chat_echo(server):
    client = _client(server, options=FrontendOptions(response_role="bot"))
    assert _chat(client, messages=HI).json()["choices"][0]["message"]["role"] == "bot"
    plain = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True).json()
    echoed = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True,
                   echo=True).json()
    message = echoed["choices"][0]["message"]
    assert message["role"] == "assistant"  # the continued message's role
    assert message["content"] == "Hel" + plain["choices"][0]["message"]["content"]
    assert _chat(client, messages=HI, echo=True).json()["choices"][0]["message"]["content"] == \
        _chat(client, messages=HI).json()["choices"][0]["message"]["content"]  # last role is not the reply's
    events = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True, echo=True,
                   stream=True).text.split("\n\n")
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events if e.startswith("data: {")]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == "Hel"
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_add_special_tokens_reaches_the_tokenizer(server, monkeypatch):
    app = build_app(server.engine, [MODEL_NAME], None, metrics_app=object())
    seen = []
    for handler in (app.state.completion, app.state.chat):
        original = handler.encode
        monkeypatch.setattr(handler, "encode", lambda text, add_special_tokens=True, f=original: seen.append(
            add_special_tokens) or f(text, add_special_tokens))
    client = TestClient(app)
    for body in ({}, {"add_special_tokens": False}):
        client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, **body})
    for body in ({}, {"add_special_tokens": True}):
        _chat(client, messages=HI, **body)
    assert seen == [True, False, False, True]  # vLLM's defaults: completions True, chat False


def test_tokenize_options_and_message_content_forms(server):
    client = _client(server)
    tok = lambda **b: client.post("/tokenize", json={"model": MODEL_NAME, **b}).json()  # noqa: E731
    open_end = tok(messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    closed = tok(messages=PREFILL, add_generation_prompt=False)
    assert open_end["count"] < closed["count"]
    chat = _chat(client, messages=PREFILL, add_generation_prompt=False, continue_final_message=True).json()
    assert chat["usage"]["prompt_tokens"] == open_end["count"]
    strs = tok(prompt="Hello world", return_token_strs=True)
    assert len(strs["token_strs"]) == strs["count"] and strs["token_strs"][0] == "Hello"
    assert client.post("/tokenize", json={"model": MODEL_NAME, "messages": PREFILL,
                                          "continue_final_message": True}).status_code == 400
    forms = [[{"role": "user", "content": None}], [{"role": "user"}],
             [{"role": "user", "content": ["Hi", {"type": "input_text", "text": "there"}]}]]
    for messages in forms:
        assert _chat(client, messages=messages).status_code == 200, messages
    assert tok(messages=forms[2])["count"] == tok(messages=[{"role": "user", "content": "Hi\nthere"}])["count"]


def test_forced_usage_and_request_logging(server, caplog):
    client = _client(server, options=FrontendOptions(force_include_usage=True, log_requests=True, max_log_len=3))
    with caplog.at_level("INFO", logger="ascent.entrypoints.openai.serving_tokens"):
        events = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello world", "max_tokens": 2,
                                                      "stream": True, "request_id": "logged"}).text.split("\n\n")
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert "Received request cmpl-logged: prompt: 'Hel'" in caplog.text


def test_serve_parses_vllms_frontend_flags():
    import argparse

    from ascent.entrypoints.openai.api_server import add_serve_args, frontend_options

    args = add_serve_args(argparse.ArgumentParser()).parse_args([
        "--api-key", "k", "--allowed-origins", "http://a", "--root-path", "/p", "--uds", "/tmp/s.sock",
        "--response-role", "bot", "--enable-log-requests", "--max-log-len", "5", "--enable-force-include-usage",
        "--disable-uvicorn-access-log", "--chat-template-content-format", "openai"])
    assert (args.api_key, args.allowed_origins, args.root_path, args.uds) == (["k"], ["http://a"], "/p", "/tmp/s.sock")
    assert frontend_options(args) == FrontendOptions("bot", True, 5, True) and args.disable_uvicorn_access_log
    with pytest.raises(ValueError, match="max_log_len=-1"):
        frontend_options(add_serve_args(argparse.ArgumentParser()).parse_args(["--max-log-len", "-1"]))


def test_prompt_tokens_details_report_cached_prompt_tokens(server):
    client = _client(server, options=FrontendOptions(prompt_tokens_details=True))
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 3
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    client.post("/v1/completions", json=body)  # fills the prefix cache
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # at least one full block was a hit
    events = client.post("/v1/completions", json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}).text.split("\n\n")
    final = [json.loads(e[6:]) for e in events if e.startswith("data: {")][-1]
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    plain = _client(server).post("/v1/completions", json=body).json()["usage"]
    assert plain["prompt_tokens_details"] is None


def test_tokens_as_token_ids_in_logprobs(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "logprobs": 1, "temperature": 0}
    client = _client(server)
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    ids = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    tokens = ids["choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens) and len(tokens) == len(plain["tokens"])
    server_default = _client(server, options=FrontendOptions(return_tokens_as_token_ids=True))
    chat = _chat(server_default, messages=HI, logprobs=True, top_logprobs=1).json()["choices"][0]["logprobs"]
    entry = chat["content"][0]
    assert entry["token"].startswith("token_id:") and entry["top_logprobs"][0]["token"].startswith("token_id:")
    assert entry["bytes"] == list(entry["token"].encode())
    off = _chat(server_default, messages=HI, logprobs=True, return_tokens_as_token_ids=False).json()
    assert not off["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
