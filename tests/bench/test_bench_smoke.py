"""Smoke runs of ``ascent bench throughput`` / ``latency`` at tiny size (JSON schema and sanity, never timing
thresholds) and the roofline weight-bytes formula against transformers' parameter counts."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from ascent.benchmarks.cli import register_bench_parser
from ascent.benchmarks.common import collect_env, percentiles, write_json
from ascent.benchmarks.datasets import parse_len_range, sample_requests
from ascent.benchmarks.roofline import (
    decode_roofline, generation_flops, kv_bytes_per_token, weight_bytes_per_step, weight_params_per_step,
    workload_roofline,
)

TINY_ROOFLINE = ["--roofline-stream-mib", "4", "--roofline-gemv-mib", "1", "--roofline-gemm-shape", "16,128,128",
                 "--roofline-repeats", "2"]
THROUGHPUT_KEYS = ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second",
                   "output_tokens_per_second")
ENV_KEYS = ("torch_version", "num_threads", "dtype", "cpu_model", "loadavg", "load_warning")
CALIBRATION_KEYS = ("stream_read_gbps", "stream_read_numpy_gbps", "gemv_gbps", "gemm_gflops", "gemv_fp32_gbps",
                    "gemm_fp32_gflops", "bandwidth_gbps", "peak_gflops")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ascent")
    register_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _run_bench(argv: list[str], out) -> tuple[argparse.Namespace, dict]:
    """Run ``ascent bench ARGV --output-json OUT``; returns the parsed arguments and the JSON it wrote."""
    args = _parse([*argv, "--output-json", str(out)])
    args.func(args)
    return args, json.loads(out.read_text())


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_env_and_roofline(data: dict) -> None:
    assert all(k in data["env"] for k in ENV_KEYS)
    assert isinstance(data["env"]["load_warning"], bool) and len(data["env"]["loadavg"]) == 3
    calibration = data["roofline"]["calibration"]
    assert all(_positive(calibration[k]) for k in CALIBRATION_KEYS)
    assert calibration["bandwidth_gbps"] == max(calibration[k] for k in ("stream_read_gbps", "gemv_gbps",
                                                                        "gemv_fp32_gbps"))
    assert calibration["peak_gflops"] == max(calibration["gemm_gflops"], calibration["gemm_fp32_gflops"])
    assert calibration["passes"] == 2  # calibrated before and after the engine's run
    assert set(calibration["huge_pages"]) == {"kernel_mode", "torch_allocator", "enabled"}  # reported with the rates
    ceilings = data["roofline"]["ceilings"]
    assert data["roofline"]["error"] is None
    assert all(_positive(ceilings[k]) for k in ("batch1_bandwidth_ceiling_tok_s", "compute_ceiling_tok_s",
                                                "ceiling_tok_s", "weight_bytes_per_step"))


def test_throughput_smoke(tiny_llama_dir: str, tmp_path) -> None:
    out = tmp_path / "throughput.json"
    args = _parse(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "4", "--dtype", "bfloat16",
                   "--random-input-len-range", "4,12", "--random-output-len-range", "3,8", "--num-threads", "1",
                   "--peer-batch-size", "2", "--max-num-seqs", "4", "--output-json", str(out), *TINY_ROOFLINE])
    returned = args.func(args)
    data = json.loads(out.read_text())
    assert data["num_requests"] == returned["num_requests"] == 4
    requested = data["requested"]
    expected_total = requested["total_input_tokens"] + requested["total_output_tokens"]
    for result in (data, data["peer"]):
        assert all(_positive(result[k]) for k in THROUGHPUT_KEYS)
        assert result["total_num_tokens"] == expected_total
        assert result["total_output_tokens"] == requested["total_output_tokens"]
        assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / result["elapsed_time"])
    assert 4 * 3 <= requested["total_output_tokens"] <= 4 * 8
    assert data["ratio_vs_peer"] == pytest.approx(
        data["output_tokens_per_second"] / data["peer"]["output_tokens_per_second"])
    assert _positive(data["roofline"]["achieved_fraction_of_compute_roofline"])
    workload = data["roofline"]["workload_roofline"]
    assert _positive(workload["seconds"]) and workload["seconds"] == pytest.approx(workload["prefill_s"]
                                                                                  + workload["decode_s"])
    assert data["roofline"]["achieved_fraction_of_workload_roofline"] == pytest.approx(
        workload["seconds"] / data["elapsed_time"])
    assert data["roofline"]["ceilings"]["batch_size"] == 4
    assert data["env"]["num_threads"] == 1 and data["dtype"] == "bfloat16"
    _check_env_and_roofline(data)
    _check_memory(data["memory"], tiny_llama_dir)


def _check_memory(memory: dict, model_dir: str) -> None:
    """B7: RSS figures and the engine's own bytes (every checkpoint parameter at least once, in bf16)."""
    from pathlib import Path

    from safetensors import safe_open

    params = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            params += sum(f.get_slice(name).get_shape().numel() if hasattr(f.get_slice(name).get_shape(), "numel")
                          else math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert memory["weights_bytes"] >= 2 * params > 0 and _positive(memory["kv_cache_bytes"])
    assert memory["current_rss_bytes"] <= memory["peak_rss_bytes"]
    assert memory["peak_rss_over_weights_plus_kv"] == pytest.approx(
        memory["peak_rss_bytes"] / (memory["weights_bytes"] + memory["kv_cache_bytes"]))


def test_throughput_profile_comparison(tiny_llama_dir: str, tmp_path) -> None:
    out = tmp_path / "profiles.json"
    args = _parse(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "3", "--hardware-profile",
                   "310p", "--compare-profile", "cpu", "--random-input-len-range", "4,12",
                   "--random-output-len-range", "3,6", "--num-threads", "1", "--no-peer", "--output-json", str(out),
                   *TINY_ROOFLINE])
    args.func(args)
    data = json.loads(out.read_text())
    other = data["profile_comparison"]
    # --dtype auto: the fp16-only 310p family in float16, the float32 checkpoint in bfloat16 under cpu (vLLM)
    assert data["dtype"] == "float16" and other["hardware_profile"] == "cpu" and other["dtype"] == "bfloat16"
    assert other["total_output_tokens"] == data["total_output_tokens"] == data["requested"]["total_output_tokens"]
    assert other["ratio"] == pytest.approx(data["output_tokens_per_second"] / other["output_tokens_per_second"])


def test_latency_smoke(tiny_llama_dir: str, tmp_path) -> None:
    out = tmp_path / "latency.json"
    args = _parse(["bench", "latency", "--model", tiny_llama_dir, "--batch-size", "2", "--input-len", "8",
                   "--output-len", "8", "--num-iters", "2", "--num-iters-warmup", "1", "--num-threads", "1",
                   "--output-json", str(out), *TINY_ROOFLINE])
    args.func(args)
    data = json.loads(out.read_text())
    for result in (data, data["peer"]):
        assert len(result["latencies"]) == 2 and all(_positive(x) for x in result["latencies"])
        assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
        assert sorted(result["percentiles"]) == sorted(["10", "25", "50", "75", "90", "99"])
        assert result["decode_tokens_per_second"] == pytest.approx(2 * 8 / result["avg_latency"])
        assert _positive(result["achieved_weight_bandwidth_gbps"])
    assert data["achieved_weight_bandwidth_gbps"] == pytest.approx(
        data["weight_bytes_per_step"] * 8 / data["avg_latency"] / 1e9)
    assert data["fraction_of_bandwidth_roofline"] == pytest.approx(
        data["achieved_weight_bandwidth_gbps"] / data["roofline"]["calibration"]["bandwidth_gbps"])
    assert data["ratio_vs_peer"] == pytest.approx(
        data["decode_tokens_per_second"] / data["peer"]["decode_tokens_per_second"])
    streams = data["paired_stream_gbps"]  # one reading before the timed iterations, one after each
    assert len(streams) == 3 and all(_positive(x) for x in streams)
    assert data["roofline"]["calibration"]["stream_read_gbps"] >= max(streams)
    paired = [data["weight_bytes_per_step"] * 8 / lat / 1e9 / max(streams[i], streams[i + 1])
              for i, lat in enumerate(data["latencies"])]
    assert data["paired_bandwidth_fractions"] == pytest.approx(paired)
    assert data["paired_fraction_of_bandwidth_roofline"] == pytest.approx(sum(paired) / 2)
    ceiling = data["roofline"]["ceilings"]
    assert ceiling["batch_size"] == 2 and ceiling["mean_context"] == pytest.approx(8 + 8 / 2)
    for result in (data, data["peer"]):
        assert result["fraction_of_decode_ceiling"] == pytest.approx(
            result["decode_tokens_per_second"] / ceiling["ceiling_tok_s"])
    _check_env_and_roofline(data)


def test_sched_smoke(tiny_llama_dir: str, tmp_path) -> None:
    """B4 runs the real scheduler and the runner's host side on a fake model: per-phase medians, per-sequence
    figures consistent with them, and the runner's batch mirroring the scheduler (checked inside the bench)."""
    args, data = _run_bench(["bench", "sched", "--model", tiny_llama_dir, "--num-seqs", "3,40", "--prompt-len", "70",
                             "--steps", "5", "--warmup-steps", "2"], tmp_path / "sched.json")
    assert data["benchmark"] == "sched" and data["steps"] == 5 and data["block_size"] == 16
    assert [r["num_seqs"] for r in data["results"]] == [3, 40]
    for r in data["results"]:
        assert all(_positive(r[f"{k}_us_per_step"]) for k in ("schedule", "update", "input_prep"))
        assert r["scheduler_us_per_step"] == pytest.approx(r["schedule_us_per_step"] + r["update_us_per_step"])
        assert r["host_us_per_step"] == pytest.approx(r["scheduler_us_per_step"] + r["input_prep_us_per_step"])
        assert r["scheduler_us_per_seq"] == pytest.approx(r["scheduler_us_per_step"] / r["num_seqs"])
    assert all(k in data["env"] for k in ENV_KEYS)
    with pytest.raises(ValueError, match="num_seqs"):
        args.func(_parse(["bench", "sched", "--model", tiny_llama_dir, "--num-seqs", "0"]))


def test_prefix_smoke(tiny_llama_dir: str, tmp_path) -> None:
    """B5: with caching every request after the first reuses floor(prefix / block) * block tokens, without it none;
    TTFTs come from the engine's request metrics."""
    args, data = _run_bench(["bench", "prefix", "--model", tiny_llama_dir, "--num-prompts", "3", "--prefix-len", "40",
                             "--suffix-len", "5", "--num-threads", "1"], tmp_path / "prefix.json")
    assert data["benchmark"] == "prefix" and data["block_size"] == 16 and data["expected_cached_tokens"] == 32
    assert data["caching"]["cached_tokens"] == [0, 32, 32] and data["no_caching"]["cached_tokens"] == [0, 0, 0]
    assert data["hit_rate_after_first"] == pytest.approx(32 / 45) == data["expected_hit_rate_after_first"]
    for engine in ("caching", "no_caching"):
        assert len(data[engine]["ttfts_ms"]) == 3 and all(_positive(t) for t in data[engine]["ttfts_ms"])
    assert data["ttft_ratio_caching_vs_not"] == pytest.approx(
        data["caching"]["mean_ttft_ms"] / data["no_caching"]["mean_ttft_ms"])
    with pytest.raises(ValueError, match="suffix_len=0"):
        args.func(_parse(["bench", "prefix", "--model", tiny_llama_dir, "--suffix-len", "0"]))


def _tiny_config(kind: str, tied: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    return cls(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_formula_matches_transformers(kind: str, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    config = _tiny_config(kind, tied)
    model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    expected = total - embedding + (embedding if tied else 0)
    assert weight_params_per_step(config) == expected
    assert weight_bytes_per_step(config, torch.bfloat16) == 2 * expected
    assert weight_bytes_per_step(config, "float32") == 4 * expected


def test_decode_roofline_ceilings() -> None:
    config = _tiny_config("llama", True)
    w = weight_bytes_per_step(config, "bfloat16")
    one = decode_roofline(config, "bfloat16", bandwidth_gbps=10.0, gflops=100.0)
    assert one["batch1_bandwidth_ceiling_tok_s"] == pytest.approx(10e9 / w)
    big = decode_roofline(config, "bfloat16", bandwidth_gbps=10.0, gflops=100.0, batch_size=64, mean_context=32)
    assert big["ceiling_tok_s"] == pytest.approx(min(big["bandwidth_ceiling_tok_s"], big["compute_ceiling_tok_s"]))
    assert big["bandwidth_ceiling_tok_s"] > one["bandwidth_ceiling_tok_s"]
    with pytest.raises(ValueError, match="batch_size=0"):
        decode_roofline(config, "bfloat16", 10.0, 100.0, batch_size=0)


def test_workload_roofline_counts_prefill_flops_and_each_decode_steps_bytes() -> None:
    config = _tiny_config("llama", True)
    w, kv = weight_bytes_per_step(config, "bfloat16"), kv_bytes_per_token(config, "bfloat16")
    bw, peak = 10e9, 1e9 * 1e6  # a huge FLOP rate: every decode step is bandwidth-bound
    lengths = [(4, 3), (3, 2), (5, 1)]  # 2 + 1 + 0 decode steps (the first token comes from the prefill)
    prefill = sum(generation_flops(config, i, 1) for i, _ in lengths) / peak
    together = workload_roofline(config, "bfloat16", 10.0, 1e6, lengths, max_batch=2)
    assert together["decode_steps"] == 2  # contexts [4, 3] then [5]
    assert together["decode_s"] == pytest.approx(((w + kv * 7) + (w + kv * 5)) / bw)
    assert together["prefill_s"] == pytest.approx(prefill)
    assert together["seconds"] == pytest.approx(together["prefill_s"] + together["decode_s"])
    one_at_a_time = workload_roofline(config, "bfloat16", 10.0, 1e6, lengths, max_batch=1)
    assert one_at_a_time["decode_steps"] == 3  # contexts [4], [5], then [3]
    assert one_at_a_time["decode_s"] == pytest.approx(((w + kv * 4) + (w + kv * 5) + (w + kv * 3)) / bw)
    compute_bound = workload_roofline(config, "bfloat16", 1e9, 1e-3, lengths, max_batch=2)
    assert compute_bound["decode_s"] > together["decode_s"]  # FLOPs / F dominates at a tiny FLOP rate
    with pytest.raises(ValueError, match="max_batch=0"):
        workload_roofline(config, "bfloat16", 10.0, 1.0, lengths, max_batch=0)


def test_datasets_and_common(tmp_path) -> None:
    first = sample_requests(6, (2, 5), (1, 3), vocab_size=50, seed=3)
    assert first == sample_requests(6, (2, 5), (1, 3), vocab_size=50, seed=3)
    assert all(2 <= r.input_len <= 5 and 1 <= r.output_len <= 3 for r in first)
    assert all(0 <= t < 50 for r in first for t in r.prompt_token_ids)
    assert parse_len_range("16,256") == (16, 256)
    with pytest.raises(ValueError, match="'9,3'"):
        parse_len_range("9,3")
    pct = percentiles([1.0, 2.0, 3.0, 4.0])
    assert pct["50"] == pytest.approx(2.5) and list(pct) == ["10", "25", "50", "75", "90", "99"]
    path = write_json(tmp_path / "sub" / "env.json", {"env": collect_env(torch.bfloat16, 1), "x": float("nan")})
    data = json.loads(path.read_text())
    assert data["x"] is None and data["env"]["dtype"] == "bfloat16" and data["env"]["num_threads"] == 1


def test_cli_defaults_follow_vllm_names() -> None:
    args = _parse(["bench", "throughput"])
    assert (args.model, args.dtype, args.num_prompts, args.peer_batch_size, args.temperature) == (
        None, "auto", 64, 16, 0.6)
    assert args.hardware_profile == "auto" and args.compare_profile is None
    assert args.input_len is None and args.random_input_len_range is None and callable(args.func)
    args = _parse(["bench", "latency"])
    latency_defaults = (args.batch_size, args.input_len, args.output_len, args.num_iters, args.num_iters_warmup)
    assert latency_defaults == (1, 8, 128, 3, 1)
    assert callable(args.func) and args.no_peer is False


def test_engine_flags_reach_the_engine(monkeypatch) -> None:
    """Every engine flag (not only the bench's own) is accepted and passed to LLM, as vLLM's benches take EngineArgs."""
    import ascent
    from ascent.benchmarks.throughput import build_llm

    seen: dict = {}
    monkeypatch.setattr(ascent, "LLM", lambda model, **kwargs: seen.update(model=model, **kwargs))
    args = _parse(["bench", "latency", "--model", "m", "--block-size", "32", "--max-model-len", "4k",
                   "--no-enable-prefix-caching", "--quantization", "none", "--max-num-seqs", "4"])
    build_llm(args, 136)
    assert (seen["model"], seen["block_size"], seen["max_model_len"], seen["quantization"]) == ("m", 32, 4000, "none")
    assert seen["enable_prefix_caching"] is False and seen["max_num_seqs"] == 4
    build_llm(_parse(["bench", "latency"]), 136, enable_prefix_caching=False)
    assert seen["max_model_len"] == 136 and seen["enable_prefix_caching"] is False  # the bench's own length
