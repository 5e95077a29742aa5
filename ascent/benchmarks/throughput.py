"""B1 offline throughput (nano-vllm protocol scaled down) for ascent and the HF transformers peer, same process.

Both run with the same pinned torch thread count on the same weights and dtype. The engine does one warmup generate
on a few separate prompts, then one timed ``generate`` of all requests with ``ignore_eos`` and exact ``max_tokens``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np

from ascent.args import EngineArgs
from ascent.benchmarks.cli import BENCH_OWN_ENGINE_FLAGS
from ascent.benchmarks.common import Timer, collect_env, dtype_name, pin_threads, safe_ratio, write_json
from ascent.benchmarks.datasets import (BenchRequest, length_summary, resolve_len_range, sample_requests)
from ascent.benchmarks.hf_peer import load_peer_model, peer_throughput, throughput_metrics
from ascent.benchmarks.memory import PeakWindow, memory_report
from ascent.benchmarks.roofline import (
    RooflineSizes,
    calibrate,
    generation_flops,
    merge_calibrations,
    roofline_report,
    workload_roofline,
)

DEFAULT_INPUT_RANGE = (16, 256)
DEFAULT_OUTPUT_RANGE = (16, 128)
WARMUP_PROMPTS = 4
WARMUP_TOKENS = 8


def roofline_sizes(args: argparse.Namespace) -> RooflineSizes:
    """Calibration sizes from the ``--roofline-*`` flags."""
    try:
        m, n, k = (int(x) for x in str(args.roofline_gemm_shape).split(","))
    except ValueError:
        raise ValueError(f"roofline_gemm_shape={args.roofline_gemm_shape!r} must be three integers 'M,N,K'") from None
    return RooflineSizes(stream_bytes=int(args.roofline_stream_mib * (1 << 20)),
                         gemv_bytes=int(args.roofline_gemv_mib * (1 << 20)), gemm_m=m, gemm_n=n, gemm_k=k,
                         repeats=args.roofline_repeats)


def build_llm(args: argparse.Namespace, max_model_len: int, **overrides: Any) -> Any:
    """Construct the engine from the bench flags (unset flags keep the engine's defaults)."""
    from ascent import LLM

    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": max_model_len, "seed": args.seed,
                              "disable_log_stats": True,
                              "hardware_profile": getattr(args, "hardware_profile", None) or "auto"}
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes", "num_threads",
                 "tensor_parallel_size", "enable_expert_parallel"):
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    for f in dataclasses.fields(EngineArgs):  # the engine flags the bench passes through (max_model_len if given)
        if f.name not in BENCH_OWN_ENGINE_FLAGS and getattr(args, f.name, None) is not None:
            kwargs[f.name] = getattr(args, f.name)
    kwargs.update(overrides)
    return LLM(model=args.model, **kwargs)


def prompt_vocab_size(llm: Any) -> int:
    """Token ids safe for random prompts: below both the model's and the tokenizer's vocabulary size."""
    vocab = int(llm.llm_engine.config.model_config.hf_config.vocab_size)
    try:
        vocab = min(vocab, len(llm.get_tokenizer()))
    except (AttributeError, TypeError):
        pass
    return vocab


def engine_generate(llm: Any, requests: list[BenchRequest], temperature: float, detokenize: bool = True) -> int:
    """Run one ``generate`` over ``requests`` (ignore_eos, exact max_tokens); returns the output tokens produced."""
    from ascent import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True,
                             detokenize=detokenize) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def _fraction_of_compute(report: dict[str, Any], flops: float | None, elapsed: float | None) -> float | None:
    if flops is None or not elapsed:
        return None
    return flops / elapsed / (report["calibration"]["peak_gflops"] * 1e9)


def _add_roofline_fractions(report: dict[str, Any], flops: float | None, ours: dict[str, Any],
                            peer: dict[str, Any] | None) -> None:
    ceiling = report["ceilings"]["ceiling_tok_s"] if report["ceilings"] else None
    report["total_flops"] = flops
    report["achieved_fraction_of_compute_roofline"] = _fraction_of_compute(report, flops, ours["elapsed_time"])
    report["achieved_fraction_of_decode_ceiling"] = safe_ratio(ours["output_tokens_per_second"], ceiling)
    report["peer_achieved_fraction_of_compute_roofline"] = (
        _fraction_of_compute(report, flops, peer["elapsed_time"]) if peer else None)


def _add_workload_roofline(report: dict[str, Any], hf_config: Any, dtype: Any, requests: list[BenchRequest],
                           batch: int, elapsed: float | None) -> None:
    """``workload_roofline`` of the run's requests (None for a model without a formula) and the fraction of it the
    engine achieved (roofline seconds / elapsed seconds)."""
    cal = report["calibration"]
    try:
        workload = workload_roofline(hf_config, dtype, cal["bandwidth_gbps"], cal["peak_gflops"],
                                     [(r.input_len, r.output_len) for r in requests], batch)
    except ValueError:
        workload = None
    report["workload_roofline"] = workload
    report["achieved_fraction_of_workload_roofline"] = (
        workload["seconds"] / elapsed if workload is not None and elapsed else None)


def _total_flops(hf_config: Any, requests: list[BenchRequest]) -> float | None:
    try:
        return float(sum(generation_flops(hf_config, r.input_len, r.output_len) for r in requests))
    except ValueError:
        return None


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Run B1; returns the result dict (also written to ``--output-json`` and summarised on stdout)."""
    threads = pin_threads(args.num_threads)
    in_range = resolve_len_range(args.input_len, args.random_input_len_range, DEFAULT_INPUT_RANGE, "input_len")
    out_range = resolve_len_range(args.output_len, args.random_output_len_range, DEFAULT_OUTPUT_RANGE, "output_len")
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts={args.num_prompts!r} must be at least 1")
    llm = build_llm(args, in_range[1] + out_range[1])
    peak = PeakWindow()
    peak.loaded()
    mc = llm.llm_engine.config.model_config
    calibration = calibrate(mc.torch_dtype, roofline_sizes(args))
    peak.start_run()  # B7 leaves the calibration's buffers out
    vocab = prompt_vocab_size(llm)
    requests = sample_requests(args.num_prompts, in_range, out_range, vocab, args.seed)
    warmup = sample_requests(min(WARMUP_PROMPTS, args.num_prompts), in_range,
                             (1, min(WARMUP_TOKENS, out_range[1])), vocab, args.seed + 1)
    engine_generate(llm, warmup, args.temperature, not args.disable_detokenize)
    with Timer() as timer:
        produced = engine_generate(llm, requests, args.temperature, not args.disable_detokenize)
    memory = memory_report(llm, peak)  # B7, before the second calibration's and the peer's allocations
    calibration = merge_calibrations(calibration, calibrate(mc.torch_dtype, roofline_sizes(args)))
    lengths = length_summary(requests)
    result: dict[str, Any] = throughput_metrics(timer.elapsed, len(requests), lengths["total_input_tokens"], produced)
    if getattr(args, "compare_profile", None):
        result["profile_comparison"] = _run_other_profile(args, in_range[1] + out_range[1], requests, warmup,
                                                          result, lengths["total_input_tokens"])
    peer = None
    if not args.no_peer:
        pin_threads(threads)
        peer_model = load_peer_model(mc.model, mc.torch_dtype)
        peer = peer_throughput(peer_model, requests, args.temperature, args.peer_batch_size, args.seed)
        del peer_model
    batch = min(int(llm.llm_engine.config.scheduler_config.max_num_seqs), len(requests))
    mean_context = lengths["mean_input_len"] + lengths["mean_output_len"] / 2.0
    report = roofline_report(mc.hf_config, mc.torch_dtype, calibration, batch, mean_context)
    _add_roofline_fractions(report, _total_flops(mc.hf_config, requests), result, peer)
    _add_workload_roofline(report, mc.hf_config, mc.torch_dtype, requests, batch, result["elapsed_time"])
    result.update({
        "benchmark": "throughput",
        "model": mc.model,
        "dtype": dtype_name(mc.torch_dtype),
        "requested": lengths,
        "config": _config_record(args, in_range, out_range, threads, batch),
        "peer": peer,
        "ratio_vs_peer": safe_ratio(result["output_tokens_per_second"],
                                    peer["output_tokens_per_second"] if peer else None),
        "roofline": report,
        "startup": dict(getattr(llm.llm_engine, "timings", {}) or {}),
        "memory": memory,
        "env": collect_env(mc.torch_dtype, threads),
    })
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


def _run_other_profile(args: argparse.Namespace, max_model_len: int, requests: list[BenchRequest],
                       warmup: list[BenchRequest], ours: dict[str, Any], input_tokens: int) -> dict[str, Any]:
    """The same workload under ``--compare-profile`` in this process; ``ratio`` = main run / this run."""
    from ascent.platform.device_config import get_hardware_profile, parse_dtype

    profile = get_hardware_profile(args.compare_profile)
    dtype = args.dtype
    if dtype != "auto" and not profile.allows_dtype(parse_dtype(dtype)):
        dtype = "auto"
    other = build_llm(args, max_model_len, hardware_profile=args.compare_profile, dtype=dtype)
    engine_generate(other, warmup, args.temperature, not args.disable_detokenize)
    with Timer() as timer:
        produced = engine_generate(other, requests, args.temperature, not args.disable_detokenize)
    metrics = throughput_metrics(timer.elapsed, len(requests), input_tokens, produced)
    metrics.update({
        "hardware_profile": args.compare_profile,
        "dtype": dtype_name(other.llm_engine.config.model_config.torch_dtype),
        "ratio": safe_ratio(ours["output_tokens_per_second"], metrics["output_tokens_per_second"]),
    })
    return metrics


def _config_record(args: argparse.Namespace, in_range: tuple[int, int], out_range: tuple[int, int], threads: int,
                   batch: int) -> dict[str, Any]:
    return {
        "num_prompts": args.num_prompts, "input_len_range": list(in_range), "output_len_range": list(out_range),
        "temperature": args.temperature, "ignore_eos": True, "seed": args.seed, "num_threads": threads,
        "max_num_seqs": args.max_num_seqs, "effective_batch_size": batch,
        "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "peer_batch_size": None if args.no_peer else args.peer_batch_size,
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def format_summary(result: dict[str, Any]) -> str:
    """Human-readable summary of a throughput result."""
    peer, roof = result["peer"], result["roofline"]
    cal, ceil = roof["calibration"], roof["ceilings"] or {}
    lines = [
        f"throughput  model={result['model']}  dtype={result['dtype']}  threads={result['env']['num_threads']}",
        f"  ascent: {result['num_requests']} requests in {_fmt(result['elapsed_time'])} s  "
        f"{_fmt(result['requests_per_second'])} req/s  {_fmt(result['tokens_per_second'])} tok/s  "
        f"{_fmt(result['output_tokens_per_second'])} output tok/s",
    ]
    if peer:
        lines.append(f"  HF peer: {_fmt(peer['elapsed_time'])} s  {_fmt(peer['tokens_per_second'])} tok/s  "
                     f"{_fmt(peer['output_tokens_per_second'])} output tok/s  (batch {peer['batch_size']})  "
                     f"ratio ascent/HF = {_fmt(result['ratio_vs_peer'])}")
    lines.append(f"  roofline: stream {_fmt(cal['stream_read_gbps'])} GB/s  GEMV {_fmt(cal['gemv_gbps'])} GB/s "
                 f"(fp32 {_fmt(cal['gemv_fp32_gbps'])})  GEMM {_fmt(cal['gemm_gflops'])} GFLOP/s "
                 f"(fp32 {_fmt(cal['gemm_fp32_gflops'])})  decode ceiling at B={ceil.get('batch_size', 'n/a')}: "
                 f"{_fmt(ceil.get('ceiling_tok_s'))} tok/s  fraction of compute roof "
                 f"{_fmt(roof['achieved_fraction_of_compute_roofline'], '.3f')}")
    workload = roof.get("workload_roofline")
    if workload:
        lines.append(f"  workload roofline: {_fmt(workload['seconds'])} s (prefill {_fmt(workload['prefill_s'])} s at "
                     f"peak FLOP/s + {workload['decode_steps']} decode steps {_fmt(workload['decode_s'])} s)  "
                     f"ascent at {_fmt(roof['achieved_fraction_of_workload_roofline'], '.3f')} of it")
    memory = result.get("memory")
    if memory and memory["weights_bytes"] is not None:
        lines.append(f"  memory (B7): peak RSS {memory['peak_rss_bytes'] / 2**20:.0f} MiB = "
                     f"{_fmt(memory['peak_rss_over_weights_plus_kv'], '.2f')} x (weights "
                     f"{memory['weights_bytes'] / 2**20:.0f} MiB + KV cache {memory['kv_cache_bytes'] / 2**20:.0f} MiB)"
                     f"  (target <= {memory['target_ratio']:g})")
    other = result.get("profile_comparison")
    if other:
        lines.append(f"  profile {other['hardware_profile']} ({other['dtype']}): {_fmt(other['output_tokens_per_second'])} "
                     f"output tok/s  ratio main/{other['hardware_profile']} = {_fmt(other['ratio'])}")
    if result["env"]["load_warning"]:
        lines.append(f"  WARNING: 1-minute load {result['env']['loadavg'][0]:.2f} exceeds half the cores; "
                     "timings are unreliable")
    return "\n".join(lines)
