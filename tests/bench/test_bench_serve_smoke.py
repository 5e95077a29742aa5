"""Smoke runs of ``ascent bench serve`` / ``startup`` against a canned OpenAI streaming server (FastAPI, loopback):
JSON schema and sanity (counts, totals, ITL counts, failures), never timing thresholds; plus the metric formulas."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ascent.benchmarks.serve import RequestResult, arrival_offsets, calculate_metrics, parse_metric_list, \
    parse_percentiles
from ascent.benchmarks.serve_cli import engine_cli_flags, register_serve_bench_parsers
from ascent.benchmarks.startup import free_port, parse_startup_timings

MODEL_ID = "fake-model"
REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_TIMINGS = {"import_s": 0.5, "load_weights_s": 1.25, "kv_alloc_s": 0.125, "engine_init_s": 1.5}
STAT_KEYS = ("mean", "median", "std", "p99")


def make_fake_app(fail_every: int = 0) -> Any:
    """OpenAI-style server: streams ``max_tokens`` one-token ``text_completion`` chunks (finish_reason on the last,
    as vLLM does), then a usage chunk when asked, then ``[DONE]``. Every ``fail_every``-th request gets HTTP 400."""
    app = FastAPI()
    app.state.bodies = []

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        app.state.bodies.append(body)
        if fail_every and len(app.state.bodies) % fail_every == 0:
            return JSONResponse({"error": {"message": "canned failure", "type": "BadRequestError", "code": 400}},
                                status_code=400)
        return StreamingResponse(_stream(body), media_type="text/event-stream")

    return app


async def _stream(body: dict) -> AsyncIterator[str]:
    n = int(body["max_tokens"])
    for i in range(n):
        await asyncio.sleep(0.001)
        choice = {"index": 0, "text": f"t{i}", "logprobs": None, "finish_reason": "length" if i == n - 1 else None}
        yield "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID,
                                     "choices": [choice]}) + "\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "total_tokens": len(body["prompt"]) + n}
        yield "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL_ID,
                                     "choices": [], "usage": usage}) + "\n\n"
    yield "data: [DONE]\n\n"


def run_fake_server_from_argv() -> None:
    """Entry point of the fake server subprocess: ``--host H --port P`` (other flags ignored)."""
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    print("INFO ascent.core.async_llm: startup timings: " + json.dumps(FAKE_TIMINGS), flush=True)
    uvicorn.run(make_fake_app(), host=args.host, port=args.port, log_level="warning")


def _fake_server_cmd() -> str:
    code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); "
            "from tests.bench.test_bench_serve_smoke import run_fake_server_from_argv; run_fake_server_from_argv()")
    return shlex.join([sys.executable, "-c", code])


@pytest.fixture()
def fake_server(request) -> Iterator[tuple[str, Any]]:
    import uvicorn

    app = make_fake_app(fail_every=getattr(request, "param", 0))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ascent")
    bench = parser.add_subparsers(dest="command").add_parser("bench")
    register_serve_bench_parsers(bench.add_subparsers(dest="bench_command"))
    return parser.parse_args(["bench", *argv])


def _check_stats(data: dict, metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")) -> None:
    for metric in metrics:
        for stat in STAT_KEYS:
            value = data[f"{stat}_{metric}_ms"]
            assert isinstance(value, float) and value >= 0, (stat, metric)
        assert data[f"median_{metric}_ms"] <= data[f"p99_{metric}_ms"] + 1e-9


def test_bench_serve_smoke(fake_server, tmp_path: Path) -> None:
    base_url, app = fake_server
    out = tmp_path / "serve.json"
    args = _parse(["serve", "--base-url", base_url, "--num-prompts", "6", "--input-len", "8", "--output-len", "5",
                   "--max-concurrency", "2", "--random-vocab-size", "100", "--metric-percentiles", "50,99",
                   "--output-json", str(out)])
    returned = args.func(args)
    data = json.loads(out.read_text())
    assert data["completed"] == returned["completed"] == 6 and data["failed"] == 0 and data["errors"] == []
    assert data["total_input_tokens"] == 6 * 8 and data["total_output_tokens"] == 6 * 5
    assert data["input_lens"] == [8] * 6 and data["output_lens"] == [5] * 6
    assert [len(itl) for itl in data["itls"]] == [4] * 6
    assert data["model_id"] == MODEL_ID and data["max_concurrency"] == 2 and data["request_rate"] == "inf"
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput"):
        assert data[key] > 0
    assert data["total_token_throughput"] == pytest.approx(data["request_throughput"] * (8 + 5))
    _check_stats(data)
    assert all(f"p50_{m}_ms" in data for m in ("ttft", "tpot", "itl", "e2el"))
    assert data["ratio_vs_offline"] is None and data["engine_flags"] is None
    assert "torch_version" in data["env"] and isinstance(data["env"]["load_warning"], bool)
    bodies = app.state.bodies
    assert len(bodies) == 6 + 1  # one warmup request
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 5 and b["model"] == MODEL_ID for b in bodies)
    assert all(len(b["prompt"]) == 8 and all(0 <= t < 100 for t in b["prompt"]) for b in bodies)


@pytest.mark.parametrize("fake_server", [3], indirect=True)
def test_bench_serve_counts_failures(fake_server, tmp_path: Path) -> None:
    base_url, _ = fake_server
    args = _parse(["serve", "--base-url", base_url, "--model", MODEL_ID, "--num-prompts", "6", "--input-len", "4",
                   "--output-len", "3", "--request-rate", "200", "--random-vocab-size", "50", "--num-warmups", "0",
                   "--percentile-metrics", "ttft,e2el", "--save-result", "--result-dir", str(tmp_path)])
    data = args.func(args)
    assert data["completed"] == 4 and data["failed"] == 2
    assert len(data["errors"]) == 2 and all("HTTP 400" in e for e in data["errors"])
    assert data["total_output_tokens"] == 4 * 3 and data["total_input_tokens"] == 4 * 4
    assert "mean_tpot_ms" not in data and "p99_e2el_ms" in data
    saved = list(tmp_path.glob("ascent-serve-200.0qps-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["completed"] == 4


def test_bench_serve_launches_server(tmp_path: Path) -> None:
    args = _parse(["serve", "--launch-server", "--server-cmd", _fake_server_cmd(), "--max-num-seqs", "4",
                   "--num-prompts", "3", "--input-len", "4", "--output-len", "2", "--random-vocab-size", "20",
                   "--server-timeout", "120"])
    data = args.func(args)
    assert data["completed"] == 3 and data["total_output_tokens"] == 6
    assert data["engine_flags"] == ["--max-num-seqs", "4"]
    assert data["base_url"].startswith("http://127.0.0.1:")


def test_bench_startup_with_fake_server(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    args = _parse(["startup", "--server-cmd", _fake_server_cmd(), "--server-timeout", "120",
                   "--output-json", str(out)])
    returned = args.func(args)
    data = json.loads(out.read_text())
    assert data["num_iters"] == 1 and len(data["iterations"]) == 1
    assert 0 < data["time_to_health_s"] <= data["time_to_first_token_s"]
    assert data["first_request_s"] == pytest.approx(data["time_to_first_token_s"] - data["time_to_health_s"])
    for key, value in FAKE_TIMINGS.items():
        assert data[key] == returned[key] == value
    assert data["startup_timings"] == FAKE_TIMINGS and data["warmup_s"] is None
    assert data["other_s"] == pytest.approx(data["time_to_health_s"] - 0.5 - 1.5)
    assert "--host" in data["command"] and "torch_version" in data["env"]


def test_calculate_metrics_formulas() -> None:
    results = [RequestResult(prompt_len=4, success=True, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
               RequestResult(prompt_len=6, success=True, output_tokens=1, ttft=0.3, latency=0.3, itl=[]),
               RequestResult(prompt_len=5, error="boom")]
    data = calculate_metrics(results, duration=2.0, selected=["ttft", "tpot", "itl", "e2el"], percentiles=[50.0])
    assert data["completed"] == 2 and data["failed"] == 1 and data["errors"] == ["boom"]
    assert data["total_input_tokens"] == 10 and data["total_output_tokens"] == 4
    assert data["request_throughput"] == 1.0 and data["output_throughput"] == 2.0
    assert data["mean_tpot_ms"] == pytest.approx(200.0)  # (0.5 - 0.1) / (3 - 1); 1-token requests have no TPOT
    assert data["mean_ttft_ms"] == pytest.approx(200.0) and data["p50_e2el_ms"] == pytest.approx(400.0)
    assert data["mean_itl_ms"] == pytest.approx(200.0) and data["std_itl_ms"] == pytest.approx(0.0)


def test_arrivals_and_argument_parsing() -> None:
    assert arrival_offsets(4, float("inf"), 1.0, 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 100.0, 1.0, 0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / 1999 == pytest.approx(0.01, rel=0.1)
    assert parse_metric_list("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="unknown"):
        parse_metric_list("ttft,goodput")
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0")
    assert engine_cli_flags({"max_num_seqs": 16, "enforce_eager": False, "enable_prefix_caching": True}) == [
        "--max-num-seqs", "16", "--no-enforce-eager", "--enable-prefix-caching"]
    assert parse_startup_timings('INFO x: startup timings: {"import_s": 1.5}') == {"import_s": 1.5}
    assert parse_startup_timings("INFO unrelated line") is None


def test_offline_options_need_launch_server() -> None:
    args = _parse(["serve", "--base-url", "http://127.0.0.1:9", "--compare-offline", "--random-vocab-size", "10"])
    with pytest.raises(ValueError, match="launch-server"):
        args.func(args)
