"""B3 online serving (``ascent bench serve``): a load generator for any OpenAI-compatible ``/v1/completions``.

Random token-id prompts are streamed (``stream=True``, ``ignore_eos``, exact ``max_tokens``) with Poisson (gamma,
``--burstiness``) arrivals at ``--request-rate`` under a ``--max-concurrency`` cap. Metrics follow ``vllm bench serve``:
TTFT = first content chunk, ITL = gaps between later chunks, TPOT = (E2EL - TTFT) / (output_tokens - 1), E2EL = last
chunk; output tokens come from the final ``usage`` chunk (else the content-chunk count). Result keys are vLLM's.
With ``--launch-server`` the bench starts ``ascent serve`` itself, and can then measure the same workload offline
(``--compare-offline``) and the prefill time of one prompt (``--measure-prefill``) after the server has stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ascent.benchmarks.common import collect_env, write_json
from ascent.benchmarks.datasets import BenchRequest, sample_requests

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    """What the client observed for one request (times in seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class LoadSpec:
    """How to send the workload."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0


# ------------------------------------------------------------------------------------------------ workload
def build_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                   seed: int) -> list[BenchRequest]:
    """Random token-id prompts; lengths uniform in ``[len * (1 - r), len * (1 + r)]`` (r = 0: fixed)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio={range_ratio!r} must lie in [0, 1)")

    def span(n: int) -> tuple[int, int]:
        return max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))

    return sample_requests(num_prompts, span(input_len), span(output_len), vocab_size, seed)


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start): all 0 for an infinite rate, else gamma intervals with mean 1/rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate={request_rate!r} and burstiness={burstiness!r} must be positive")
    if not np.isfinite(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ------------------------------------------------------------------------------------------------ client
def _payload(spec: LoadSpec, request: BenchRequest) -> dict[str, Any]:
    return {"model": spec.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": spec.temperature, "ignore_eos": spec.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}


def _consume_event(body: str, result: RequestResult, state: dict[str, Any], start: float) -> None:
    data = json.loads(body)
    if "error" in data:
        raise RuntimeError(f"stream error: {data['error']}")
    now = time.perf_counter()
    if data.get("choices"):
        if state["last"] is None:
            result.ttft = now - start
        else:
            result.itl.append(now - state["last"])
        state["last"] = now
        if data["choices"][0].get("text"):
            state["chunks"] += 1
    usage = data.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        state["usage_tokens"] = int(usage["completion_tokens"])


async def send_request(client: httpx.AsyncClient, spec: LoadSpec, request: BenchRequest) -> RequestResult:
    """Stream one completion and time its chunks; failures are recorded, never raised."""
    result = RequestResult(prompt_len=request.input_len)
    state: dict[str, Any] = {"last": None, "chunks": 0, "usage_tokens": None}
    start = time.perf_counter()
    try:
        async with client.stream("POST", spec.base_url + spec.endpoint, json=_payload(spec, request)) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')}")
            async for line in resp.aiter_lines():
                body = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if body == "[DONE]":
                    break
                if body:
                    _consume_event(body, result, state, start)
        if state["last"] is None:
            raise RuntimeError("the stream carried no completion chunk")
        result.latency = state["last"] - start
        usage_tokens = state["usage_tokens"]
        result.output_tokens = usage_tokens if usage_tokens is not None else state["chunks"]
        result.success = True
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(spec: LoadSpec, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send every request per the arrival schedule and concurrency cap; returns results (input order) and wall s."""
    offsets = arrival_offsets(len(requests), spec.request_rate, spec.burstiness, spec.seed)
    cap = spec.max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(cap)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(offset: float, request: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with semaphore:
                return await send_request(client, spec, request)

        results = await asyncio.gather(*(one(o, r) for o, r in zip(offsets, requests)))
        duration = time.perf_counter() - start
    return list(results), duration


async def fetch_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first ``id`` of ``GET /v1/models``."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(base_url + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


# ------------------------------------------------------------------------------------------------ metrics
def parse_metric_list(text: str) -> list[str]:
    """``"ttft,tpot"`` -> ``["ttft", "tpot"]``; unknown names raise ValueError."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise ValueError(f"percentile_metrics={text!r}: unknown {unknown}; choose from {list(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each must lie in (0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"metric_percentiles={text!r} must be comma-separated numbers") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"metric_percentiles={text!r} must be numbers in (0, 100]")
    return values


def _percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _series(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }


def calculate_metrics(results: list[RequestResult], duration: float, selected: list[str],
                      percentiles: list[float]) -> dict[str, Any]:
    """vLLM ``bench serve`` result keys (times in ms; statistics of an empty series are 0 like vLLM's)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    series = _series(results)
    for name in selected:
        values_ms = np.asarray(series[name], dtype=np.float64) * 1000.0
        empty = values_ms.size == 0
        out[f"mean_{name}_ms"] = 0.0 if empty else float(values_ms.mean())
        out[f"median_{name}_ms"] = 0.0 if empty else float(np.median(values_ms))
        out[f"std_{name}_ms"] = 0.0 if empty else float(values_ms.std())
        for p in percentiles:
            out[f"p{_percentile_label(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(values_ms, p))
    out.update({
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results if not r.success],
    })
    return out


# ------------------------------------------------------------------------------------------------ orchestration
def run_benchmark(spec: LoadSpec, requests: list[BenchRequest], warmups: list[BenchRequest],
                  selected: list[str], percentiles: list[float]) -> dict[str, Any]:
    """Warm up (results dropped; a failed warmup aborts with its error), then run and measure the workload."""
    async def main() -> tuple[list[RequestResult], float]:
        for request in warmups:
            async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s)) as client:
                warm = await send_request(client, spec, request)
            if not warm.success:
                raise RuntimeError(f"warmup request failed: {warm.error}")
        return await run_load(spec, requests)

    results, duration = asyncio.run(main())
    return calculate_metrics(results, duration, selected, percentiles)


def result_metadata(spec: LoadSpec, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's run-description keys."""
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "endpoint_type": "openai",
        "base_url": spec.base_url, "model_id": spec.model, "num_prompts": args.num_prompts,
        "request_rate": spec.request_rate if np.isfinite(spec.request_rate) else "inf",
        "burstiness": spec.burstiness, "max_concurrency": spec.max_concurrency, "input_len": args.input_len,
        "output_len": args.output_len, "random_range_ratio": args.random_range_ratio, "seed": args.seed,
        "temperature": spec.temperature, "ignore_eos": spec.ignore_eos,
    }


def save_result(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Write to ``--output-json`` and/or ``--save-result`` (``--result-dir``/``--result-filename``)."""
    paths = []
    if args.output_json:
        paths.append(str(write_json(args.output_json, result)))
    if args.save_result:
        concurrency = f"-concurrency{result['max_concurrency']}" if result["max_concurrency"] else ""
        name = args.result_filename or (f"ascent-serve-{result['request_rate']}qps{concurrency}-"
                                        f"{result['date']}.json")
        paths.append(str(write_json(Path(args.result_dir or ".") / name, result)))
    return paths


def format_summary(result: dict[str, Any], selected: list[str], percentiles: list[float]) -> str:
    """The vLLM-style result table."""
    def row(label: str, value: Any) -> str:
        return f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}"

    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             row("Successful requests:", result["completed"]), row("Failed requests:", result["failed"]),
             row("Maximum request concurrency:", result["max_concurrency"] or "none"),
             row("Benchmark duration (s):", result["duration"]),
             row("Total input tokens:", result["total_input_tokens"]),
             row("Total generated tokens:", result["total_output_tokens"]),
             row("Request throughput (req/s):", result["request_throughput"]),
             row("Output token throughput (tok/s):", result["output_throughput"]),
             row("Total Token throughput (tok/s):", result["total_token_throughput"])]
    for name in selected:
        lines.append("{s:{c}^50}".format(s=METRIC_TITLES[name], c="-"))
        short = name.upper()
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            label = _percentile_label(p)
            lines.append(row(f"P{label} {short} (ms):", result[f"p{label}_{name}_ms"]))
    for key in ("offline_output_throughput", "ratio_vs_offline", "prefill_time_ms", "ttft_minus_prefill_ms"):
        if result.get(key) is not None:
            lines.append(row(f"{key}:", float(result[key])))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_env(args: argparse.Namespace) -> dict[str, Any]:
    """The environment record (dtype is the launched server's when known)."""
    return collect_env(args.dtype or "unknown", args.num_threads)


def resolve_vocab_size(args: argparse.Namespace, model_path: str | None) -> int:
    """``--random-vocab-size``, else the size of the tokenizer of ``--tokenizer`` / the model."""
    if args.random_vocab_size is not None:
        if args.random_vocab_size < 2:
            raise ValueError(f"random_vocab_size={args.random_vocab_size!r} must be at least 2")
        return int(args.random_vocab_size)
    from ascent.tokenizer import get_tokenizer

    try:
        return len(get_tokenizer(model_path, args.tokenizer))
    except ValueError as exc:
        raise ValueError(f"cannot size the random prompts' vocabulary ({exc}); pass --random-vocab-size N or "
                         "--tokenizer PATH") from None


def offline_measurements(args: argparse.Namespace, engine_kwargs: dict[str, Any], spec: LoadSpec,
                         requests: list[BenchRequest], warmups: list[BenchRequest], vocab: int) -> dict[str, Any]:
    """The same engine in this process (the server has stopped): prefill time and/or offline output throughput.

    Offline ``max_num_seqs`` is capped at the bench's concurrency so both see the same largest batch.
    """
    from ascent import LLM
    from ascent.args import EngineArgs
    from ascent.benchmarks.common import Timer
    from ascent.benchmarks.throughput import engine_generate

    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model", None)
    cap = spec.max_concurrency or len(requests)
    kwargs["max_num_seqs"] = min(int(kwargs.get("max_num_seqs") or EngineArgs.max_num_seqs), cap)
    kwargs["disable_log_stats"] = True
    llm = LLM(model=model, **kwargs)
    out: dict[str, Any] = {"offline_max_num_seqs": kwargs["max_num_seqs"]}
    engine_generate(llm, warmups, spec.temperature)
    if args.measure_prefill:
        times = []
        for request in build_requests(args.prefill_samples, args.input_len, 1, 0.0, vocab, args.seed + 2):
            with Timer() as timer:
                engine_generate(llm, [request], spec.temperature)
            times.append(timer.elapsed * 1000.0)
        out["prefill_time_ms"] = float(np.median(times))
        out["prefill_times_ms"] = times
    if args.compare_offline:
        with Timer() as timer:
            produced = engine_generate(llm, requests, spec.temperature)
        out["offline_duration"] = timer.elapsed
        out["offline_output_throughput"] = produced / timer.elapsed
    return out


def _add_offline_ratios(result: dict[str, Any]) -> None:
    offline = result.get("offline_output_throughput")
    result["ratio_vs_offline"] = result["output_throughput"] / offline if offline else None
    prefill = result.get("prefill_time_ms")
    ttft = result.get("median_ttft_ms")
    result["ttft_minus_prefill_ms"] = ttft - prefill if prefill is not None and ttft is not None else None


def _load_spec(args: argparse.Namespace, base_url: str, model: str) -> LoadSpec:
    return LoadSpec(base_url=base_url.rstrip("/"), model=model, endpoint=args.endpoint,
                    request_rate=float(args.request_rate), burstiness=args.burstiness,
                    max_concurrency=args.max_concurrency, temperature=args.temperature,
                    ignore_eos=args.ignore_eos, seed=args.seed, timeout_s=args.request_timeout)


def _start_server(args: argparse.Namespace, engine_flags: list[str]) -> Any:
    from ascent.benchmarks.startup import ServerProcess, free_port, serve_command

    port = free_port(args.host)
    server = ServerProcess(serve_command(engine_flags, args.host, port, args.server_cmd, args.server_args),
                           args.host, port).start()
    try:
        server.wait_healthy(args.server_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def run_serve_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any], engine_flags: list[str]) -> dict[str, Any]:
    """Run B3; returns the result dict (also saved per ``--output-json`` / ``--save-result`` and printed)."""
    selected = parse_metric_list(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    if (args.compare_offline or args.measure_prefill) and not args.launch_server:
        raise ValueError("--compare-offline and --measure-prefill need --launch-server (same engine flags)")
    if args.num_warmups < 0:
        raise ValueError(f"num_warmups={args.num_warmups!r} must be >= 0")
    model_path = engine_kwargs.get("model") if args.launch_server else args.model
    vocab = resolve_vocab_size(args, model_path)
    requests = build_requests(args.num_prompts, args.input_len, args.output_len, args.random_range_ratio, vocab,
                              args.seed)
    warmups = build_requests(max(args.num_warmups, 1), args.input_len, args.output_len, 0.0, vocab, args.seed + 1)
    server = _start_server(args, engine_flags) if args.launch_server else None
    try:
        base_url = server.base_url if server else (args.base_url or f"http://{args.host}:{args.port}")
        model = args.model if args.model and not server else asyncio.run(fetch_model_id(base_url))
        spec = _load_spec(args, base_url, model)
        result = run_benchmark(spec, requests, warmups[:args.num_warmups], selected, percentiles)
    finally:
        if server is not None:
            server.stop()
    result = {**result_metadata(spec, args), **result}
    if args.compare_offline or args.measure_prefill:
        result.update(offline_measurements(args, engine_kwargs, spec, requests, warmups, vocab))
    _add_offline_ratios(result)
    result["engine_flags"] = engine_flags if args.launch_server else None
    result["env"] = result_env(args)
    save_result(result, args)
    print(format_summary(result, selected, percentiles))
    return result
