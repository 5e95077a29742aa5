"""B2 latency (gpt-fast protocol): a fixed batch of short prompts, greedy decode of ``output_len`` tokens, timed per
iteration; reports vLLM's latency keys, decode tok/s, the achieved weight bandwidth (W x steps/s, gpt-fast's metric)
against the measured GEMV bandwidth, and the HF peer on the same weights, dtype, batch and thread count.

Prefix caching is off so every iteration pays its prefill, as the HF peer does.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ascent.benchmarks.common import Timer, collect_env, dtype_name, percentiles, pin_threads, safe_ratio, write_json
from ascent.benchmarks.datasets import sample_requests
from ascent.benchmarks.hf_peer import load_peer_model, peer_latencies
from ascent.benchmarks.roofline import (StreamProbe, calibrate, merge_calibrations, paired_bandwidth_fractions,
                                        roofline_report, with_stream_readings)
from ascent.benchmarks.throughput import build_llm, engine_generate, prompt_vocab_size, roofline_sizes


def _validate(args: argparse.Namespace) -> None:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)!r} must be at least 1")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup={args.num_iters_warmup!r} must be >= 0")


def latency_metrics(latencies: list[float], batch_size: int, output_len: int,
                    weight_bytes: int | None) -> dict[str, Any]:
    """vLLM latency keys plus decode tok/s and the achieved weight bandwidth (one weight read per step)."""
    avg = float(np.mean(latencies))
    steps_per_second = output_len / avg
    return {
        "avg_latency": avg,
        "latencies": [float(x) for x in latencies],
        "percentiles": percentiles(latencies),
        "decode_tokens_per_second": batch_size * steps_per_second,
        "achieved_weight_bandwidth_gbps": weight_bytes * steps_per_second / 1e9 if weight_bytes else None,
    }


def _fraction_of_ceiling(metrics: dict[str, Any], report: dict[str, Any]) -> float | None:
    """Decode tok/s over the roofline ceiling of this batch (specs/anchors §2.3: B / max(bytes / BW, FLOPs / F) at
    the mean context, weights + KV bytes against the GEMV bandwidth, FLOPs against the GEMM rate); the measured time
    includes the prefill, so the fraction is a lower bound."""
    ceiling = report["ceilings"]["ceiling_tok_s"] if report["ceilings"] else None
    return safe_ratio(metrics["decode_tokens_per_second"], ceiling)


def engine_latencies(llm: Any, requests: list, num_iters: int, num_iters_warmup: int,
                     probe: StreamProbe | None = None) -> list[float]:
    """Wall times (s) of ``num_iters`` greedy generates of the whole batch after the warmup iterations; with a
    ``probe``, the stream bandwidth is read before the first timed iteration and after each one."""
    for _ in range(num_iters_warmup):
        engine_generate(llm, requests, 0.0)
    if probe is not None:
        probe.read_gbps()
    latencies = []
    for _ in range(num_iters):
        with Timer() as timer:
            engine_generate(llm, requests, 0.0)
        latencies.append(timer.elapsed)
        if probe is not None:
            probe.read_gbps()
    return latencies


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Run B2; returns the result dict (also written to ``--output-json`` and summarised on stdout)."""
    _validate(args)
    threads = pin_threads(args.num_threads)
    llm = build_llm(args, args.input_len + args.output_len, enable_prefix_caching=False)
    mc = llm.llm_engine.config.model_config
    sizes = roofline_sizes(args)
    calibration = calibrate(mc.torch_dtype, sizes)
    requests = sample_requests(args.batch_size, (args.input_len, args.input_len), (args.output_len, args.output_len),
                               prompt_vocab_size(llm), args.seed)
    probe = StreamProbe(sizes.stream_bytes)
    latencies = engine_latencies(llm, requests, args.num_iters, args.num_iters_warmup, probe)
    calibration = merge_calibrations(calibration, calibrate(mc.torch_dtype, sizes))
    calibration = with_stream_readings(calibration, probe.readings)
    report = roofline_report(mc.hf_config, mc.torch_dtype, calibration, args.batch_size,
                             args.input_len + args.output_len / 2.0)
    weight_bytes = report["ceilings"]["weight_bytes_per_step"] if report["ceilings"] else None
    ours = latency_metrics(latencies, args.batch_size, args.output_len, weight_bytes)
    probe_readings = probe.readings
    paired = (paired_bandwidth_fractions(weight_bytes, args.output_len, latencies, probe_readings)
              if weight_bytes else None)
    del probe  # frees the stream buffer before the peer loads
    peer = None
    if not args.no_peer:
        pin_threads(threads)
        peer_model = load_peer_model(mc.model, mc.torch_dtype)
        prompts = [r.prompt_token_ids for r in requests]
        peer = latency_metrics(peer_latencies(peer_model, prompts, args.output_len, args.num_iters,
                                              args.num_iters_warmup), args.batch_size, args.output_len, weight_bytes)
        del peer_model
    gemv = calibration["bandwidth_gbps"]
    result: dict[str, Any] = {
        **ours,
        "benchmark": "latency",
        "model": mc.model,
        "dtype": dtype_name(mc.torch_dtype),
        "config": {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                   "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "temperature": 0.0,
                   "ignore_eos": True, "enable_prefix_caching": False, "seed": args.seed, "num_threads": threads},
        "weight_bytes_per_step": weight_bytes,
        "fraction_of_bandwidth_roofline": safe_ratio(ours["achieved_weight_bandwidth_gbps"], gemv),
        "fraction_of_decode_ceiling": _fraction_of_ceiling(ours, report),
        "paired_stream_gbps": probe_readings,
        "paired_bandwidth_fractions": paired,
        "paired_fraction_of_bandwidth_roofline": float(np.median(paired)) if paired else None,
        "peer": peer,
        "ratio_vs_peer": safe_ratio(ours["decode_tokens_per_second"],
                                    peer["decode_tokens_per_second"] if peer else None),
        "roofline": report,
        "startup": dict(getattr(llm.llm_engine, "timings", {}) or {}),
        "env": collect_env(mc.torch_dtype, threads),
    }
    if peer:
        peer["fraction_of_bandwidth_roofline"] = safe_ratio(peer["achieved_weight_bandwidth_gbps"], gemv)
        peer["fraction_of_decode_ceiling"] = _fraction_of_ceiling(peer, report)
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def format_summary(result: dict[str, Any]) -> str:
    """Human-readable summary of a latency result."""
    cfg, peer, pct = result["config"], result["peer"], result["percentiles"]
    lines = [
        f"latency  model={result['model']}  dtype={result['dtype']}  threads={cfg['num_threads']}  "
        f"batch={cfg['batch_size']}  input={cfg['input_len']}  output={cfg['output_len']}",
        f"  ascent: avg {_fmt(result['avg_latency'], '.4f')} s  p50 {_fmt(pct['50'], '.4f')} s  "
        f"p99 {_fmt(pct['99'], '.4f')} s  {_fmt(result['decode_tokens_per_second'])} tok/s  "
        f"{_fmt(result['achieved_weight_bandwidth_gbps'])} GB/s = "
        f"{_fmt(result['fraction_of_bandwidth_roofline'], '.3f')} of bandwidth "
        f"{_fmt(result['roofline']['calibration']['bandwidth_gbps'])} GB/s (best of stream / GEMV)",
    ]
    ceilings = result["roofline"]["ceilings"]
    if ceilings:
        bound = "bandwidth" if ceilings["bandwidth_ceiling_tok_s"] <= ceilings["compute_ceiling_tok_s"] else "compute"
        lines.append(f"  roofline at batch {cfg['batch_size']}: ceiling {_fmt(ceilings['ceiling_tok_s'])} tok/s "
                     f"({bound}-bound; GEMM {_fmt(result['roofline']['calibration']['peak_gflops'], '.0f')} GFLOP/s)"
                     f" -> ascent at {_fmt(result['fraction_of_decode_ceiling'], '.3f')} of it")
    if result["paired_fraction_of_bandwidth_roofline"] is not None:
        streams = ", ".join(_fmt(x, ".1f") for x in result["paired_stream_gbps"])
        lines.append(f"  paired with the stream read before/after each iteration ({streams} GB/s): median "
                     f"{_fmt(result['paired_fraction_of_bandwidth_roofline'], '.3f')} of bandwidth")
    if peer:
        lines.append(f"  HF peer: avg {_fmt(peer['avg_latency'], '.4f')} s  {_fmt(peer['decode_tokens_per_second'])}"
                     f" tok/s  ratio ascent/HF = {_fmt(result['ratio_vs_peer'])}")
    if result["env"]["load_warning"]:
        lines.append(f"  WARNING: 1-minute load {result['env']['loadavg'][0]:.2f} exceeds half the cores; "
                     "timings are unreliable")
    return "\n".join(lines)
