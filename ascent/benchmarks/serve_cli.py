"""``ascent bench serve`` (B3) and ``ascent bench startup`` (B6): argparse wiring with vLLM's flag names.

``register_serve_bench_parsers(commands)`` adds both sub-commands to the ``bench`` sub-parsers; each sets ``func``.
Engine flags given here are passed to the launched ``ascent serve`` (and to the offline engine of
``--compare-offline`` / ``--measure-prefill``), so server and offline runs share one configuration.
"""

from __future__ import annotations

import argparse
from typing import Any

from ascent.benchmarks.cli import positive_int as _positive_int
from ascent.benchmarks.cli import size_arg as _size

ENGINE_FIELDS = ("model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_memory_bytes", "num_threads", "enable_prefix_caching", "enforce_eager")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number (or 'inf')")
    return value


def _add_server_args(parser: argparse.ArgumentParser, model_help: str) -> None:
    group = parser.add_argument_group("launched server / engine flags")
    group.add_argument("--model", default=None, help=model_help)
    group.add_argument("--dtype", default=None, help="engine dtype (default: the engine's)")
    group.add_argument("--max-model-len", type=_positive_int, default=None, help="engine context length")
    group.add_argument("--max-num-seqs", type=_positive_int, default=None, help="engine max running sequences")
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, help="engine token budget")
    group.add_argument("--kv-cache-memory-bytes", type=_size, default=None, help="KV cache bytes (512M, 2GiB)")
    group.add_argument("--num-threads", type=_positive_int, default=None, help="engine torch threads")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="engine prefix caching (default: the engine's)")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                       help="engine eager mode (default: the engine's)")
    group.add_argument("--server-args", default=None, help="extra arguments for the server command (one string)")
    group.add_argument("--server-cmd", default=None,
                       help="command that starts the server (default: this interpreter's 'ascent serve')")
    group.add_argument("--server-timeout", type=_positive_float, default=600.0,
                       help="seconds to wait for /health 200 (and for the first token)")
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given (``EngineArgs`` field names)."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}


def engine_cli_flags(kwargs: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 16, "enforce_eager": False}`` -> ``["--max-num-seqs", "16", "--no-enforce-eager"]``."""
    flags: list[str] = []
    for name, value in kwargs.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags.extend([f"--{flag}", str(value)])
    return flags


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench serve`` (vLLM names where vLLM has them)."""
    _add_server_args(parser, "model name sent in requests (default: first of GET /v1/models); with "
                             "--launch-server, the model path given to 'ascent serve'")
    parser.add_argument("--base-url", default=None, help="server base URL (overrides --host/--port)")
    parser.add_argument("--port", type=int, default=8000, help="server port")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions route")
    parser.add_argument("--launch-server", action="store_true", help="start 'ascent serve' on a free port")
    parser.add_argument("--dataset-name", default="random", choices=("random",), help="prompt source")
    parser.add_argument("--num-prompts", type=_positive_int, default=64, help="number of requests")
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=_positive_int, default=128,
                        help="prompt tokens")
    parser.add_argument("--output-len", "--random-output-len", dest="output_len", type=_positive_int, default=64,
                        help="generated tokens per request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--random-vocab-size", type=int, default=None,
                        help="prompt ids drawn from [0, N) (default: the tokenizer's size)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer used to size the random prompt ids")
    parser.add_argument("--request-rate", type=_positive_float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--burstiness", type=_positive_float, default=1.0, help="gamma shape of the arrivals")
    parser.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on in-flight requests")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly --output-len tokens")
    parser.add_argument("--num-warmups", type=int, default=1, help="untimed requests before the run")
    parser.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="metrics reported with percentiles (ttft,tpot,itl,e2el)")
    parser.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99")
    parser.add_argument("--save-result", action="store_true", help="save the JSON under --result-dir")
    parser.add_argument("--result-dir", default=None, help="folder of --save-result (default: .)")
    parser.add_argument("--result-filename", default=None, help="file name of --save-result")
    parser.add_argument("--compare-offline", action="store_true",
                        help="with --launch-server: run the same workload offline and report ratio_vs_offline")
    parser.add_argument("--measure-prefill", action="store_true",
                        help="with --launch-server: time 1-token generations offline (prefill_time_ms)")
    parser.add_argument("--prefill-samples", type=_positive_int, default=5, help="prompts timed for prefill")


def add_startup_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench startup``."""
    _add_server_args(parser, "model given to 'ascent serve' (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name of the first request (default: first of GET /v1/models)")
    parser.add_argument("--num-iters", type=_positive_int, default=1, help="cold starts to measure")


def _run_serve(args: argparse.Namespace) -> dict[str, Any]:
    from ascent.benchmarks.serve import run_serve_bench

    kwargs = engine_kwargs(args)
    return run_serve_bench(args, kwargs, engine_cli_flags(kwargs))


def _run_startup(args: argparse.Namespace) -> dict[str, Any]:
    from ascent.benchmarks.startup import run_startup

    return run_startup(args, engine_cli_flags(engine_kwargs(args)))


def register_serve_bench_parsers(bench_subparsers: Any) -> None:
    """Add ``serve`` and ``startup`` to the ``bench`` sub-parsers (each sets ``func``)."""
    serve = bench_subparsers.add_parser("serve", help="B3 online serving load generator (OpenAI /v1/completions)",
                                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_bench_args(serve)
    serve.set_defaults(func=_run_serve)
    startup = bench_subparsers.add_parser("startup", help="B6 cold start: process -> /health -> first token",
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_startup_bench_args(startup)
    startup.set_defaults(func=_run_startup)
