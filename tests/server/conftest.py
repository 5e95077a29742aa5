"""A loopback OpenAI-compatible server over the tiny llama model, started once per test session in a thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import uvicorn

from ascent.args import EngineArgs
from ascent.core.async_llm import AsyncLLM
from ascent.entrypoints.openai.api_server import build_app

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 60.0


@dataclass
class ServerHandle:
    base_url: str  # http://127.0.0.1:<port>
    engine: AsyncLLM
    model_dir: str
    trace_dir: str
    uvicorn_server: uvicorn.Server

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


@pytest.fixture(scope="session")
def server(tiny_llama_dir, tmp_path_factory) -> ServerHandle:
    torch.set_num_threads(1)
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=tiny_llama_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes="16M",
        disable_log_stats=True))
    trace_dir = str(tmp_path_factory.mktemp("traces"))
    app = build_app(engine, [MODEL_NAME], None, trace_dir=trace_dir)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.shutdown()
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield ServerHandle(f"http://127.0.0.1:{port}", engine, tiny_llama_dir, trace_dir, uv)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        sock.close()


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.api_url, api_key="unused", timeout=60.0, max_retries=0) as c:
        yield c


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
