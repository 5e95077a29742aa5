"""B0 roofline: calibrate the box (stream / GEMV bandwidth, GEMM FLOP/s) and derive decode ceilings for a model.

Method (specs/anchors_style_perf.md §2.3): one decode step of batch B at mean context c moves at least
W + B * KV(c) bytes, with W = (non-embedding params + lm_head params) * bytes/param (a tied lm_head is read in full
every step), and costs about B * (2 * P + 4 * L * q_heads * head_dim * c) FLOPs. Hence
single-stream tok/s <= BW / W and aggregate tok/s <= B / max(bytes / BW, FLOPs / F). BW and F are the best rates
measured (``ceiling_rates``), so a CPU whose 16-bit torch kernels are emulated does not get a flattering ceiling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ascent.benchmarks.common import best_time, dtype_name, parse_torch_dtype
from ascent.platform import huge_pages

MIB = 1 << 20
GIB = 1 << 30
GEMV_COLS = 4096
DENSE_DECODERS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RooflineSizes:
    """Calibration sizes; the defaults follow B0 (stream 1 GiB, GEMV 256 MiB, GEMM 512x2048x2048)."""

    stream_bytes: int = GIB
    gemv_bytes: int = 256 * MIB
    gemm_m: int = 512
    gemm_n: int = 2048
    gemm_k: int = 2048
    repeats: int = 5

    def __post_init__(self) -> None:
        for name in ("stream_bytes", "gemv_bytes", "gemm_m", "gemm_n", "gemm_k", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")


def measure_stream_read_gbps(nbytes: int, repeats: int = 5) -> float:
    """Streaming-read bandwidth (GB/s) of a torch fp32 sum over ``nbytes`` (uses the pinned torch threads)."""
    return StreamProbe(max(nbytes, 4), repeats).read_gbps()


class StreamProbe:
    """A streaming-read probe kept alive across a benchmark, so the box's bandwidth can be read right before and
    after each timed iteration. On a shared host the available bandwidth drifts by tens of percent within a run
    (neighbours, vCPU placement); an iteration is then compared with the bandwidth of its own moment instead of
    the best moment of the run (``paired_bandwidth_fractions``)."""

    def __init__(self, nbytes: int, repeats: int = 3) -> None:
        if nbytes < 4 or repeats < 1:
            raise ValueError(f"nbytes={nbytes!r} must be at least 4 and repeats={repeats!r} at least 1")
        self.data = torch.ones(nbytes // 4, dtype=torch.float32)
        self.repeats = repeats
        self.readings: list[float] = []

    def read_gbps(self) -> float:
        """Measure once (best of ``repeats`` fp32 sums, torch threads), record and return the GB/s."""
        gbps = self.data.numel() * 4 / best_time(lambda: self.data.sum(), self.repeats) / 1e9
        self.readings.append(gbps)
        return gbps


def paired_bandwidth_fractions(weight_bytes: int, steps: int, seconds: list[float],
                               stream_gbps: list[float]) -> list[float]:
    """Per timed iteration i (``steps`` weight reads in ``seconds[i]``): achieved weight GB/s over the higher of the
    stream readings taken just before (``stream_gbps[i]``) and just after (``stream_gbps[i + 1]``) it."""
    if len(stream_gbps) != len(seconds) + 1:
        raise ValueError(f"{len(stream_gbps)} stream readings for {len(seconds)} iterations; need one more")
    return [weight_bytes * steps / sec / 1e9 / max(stream_gbps[i], stream_gbps[i + 1])
            for i, sec in enumerate(seconds)]


def measure_numpy_stream_read_gbps(nbytes: int, repeats: int = 5) -> float:
    """STREAM-style baseline: streaming-read bandwidth (GB/s) of a numpy fp32 sum over ``nbytes``."""
    data = np.ones(max(nbytes // 4, 1), dtype=np.float32)
    seconds = best_time(lambda: np.add.reduce(data), repeats)
    return data.size * 4 / seconds / 1e9


def measure_gemv_gbps(weight_bytes: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Bandwidth (GB/s) of ``linear(x[1, K], W[N, K])`` with a ``weight_bytes`` weight in ``dtype``."""
    elem = torch.empty((), dtype=dtype).element_size()
    rows = weight_bytes // (elem * GEMV_COLS)
    if rows < 1:
        raise ValueError(f"gemv weight_bytes={weight_bytes!r} is below one {GEMV_COLS}-wide row of {dtype}")
    weight = torch.randn(rows, GEMV_COLS).to(dtype)
    x = torch.randn(1, GEMV_COLS).to(dtype)
    with torch.inference_mode():
        seconds = best_time(lambda: F.linear(x, weight), repeats)
    return weight.numel() * elem / seconds / 1e9


def measure_gemm_gflops(m: int, n: int, k: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of ``linear(x[m, k], W[n, k])`` in ``dtype`` (2*m*n*k FLOPs)."""
    weight = torch.randn(n, k).to(dtype)
    x = torch.randn(m, k).to(dtype)
    with torch.inference_mode():
        seconds = best_time(lambda: F.linear(x, weight), repeats)
    return 2.0 * m * n * k / seconds / 1e9


def calibrate(dtype: torch.dtype | str, sizes: RooflineSizes | None = None) -> dict[str, Any]:
    """Run the B0 calibration in the serving ``dtype``; returns GB/s and GFLOP/s figures plus the sizes used."""
    dtype = parse_torch_dtype(dtype)
    sizes = sizes or RooflineSizes()
    gemm = (sizes.gemm_m, sizes.gemm_n, sizes.gemm_k)
    result: dict[str, Any] = {
        "dtype": dtype_name(dtype),
        "num_threads": torch.get_num_threads(),
        "stream_read_gbps": measure_stream_read_gbps(sizes.stream_bytes, sizes.repeats),
        "stream_read_numpy_gbps": measure_numpy_stream_read_gbps(sizes.stream_bytes, sizes.repeats),
        "gemv_gbps": measure_gemv_gbps(sizes.gemv_bytes, dtype, sizes.repeats),
        "gemm_gflops": measure_gemm_gflops(*gemm, dtype, sizes.repeats),
        "huge_pages": huge_pages.process_state(),  # the stream figures depend on it (huge_pages.py)
    }
    same = dtype == torch.float32
    result["gemv_fp32_gbps"] = result["gemv_gbps"] if same else measure_gemv_gbps(
        sizes.gemv_bytes, torch.float32, sizes.repeats)
    result["gemm_fp32_gflops"] = result["gemm_gflops"] if same else measure_gemm_gflops(
        *gemm, torch.float32, sizes.repeats)
    return {**result, **ceiling_rates(result), "sizes": asdict(sizes)}


RATE_KEYS = ("stream_read_gbps", "stream_read_numpy_gbps", "gemv_gbps", "gemm_gflops", "gemv_fp32_gbps",
             "gemm_fp32_gflops")


def merge_calibrations(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The best of two calibrations of one box, rate by rate (``passes`` counts them): benchmarks calibrate before
    and after the engine's run, so a slow phase of a shared machine during one calibration cannot lower the
    ceilings the run is compared with."""
    merged = {**first, **{k: max(first[k], second[k]) for k in RATE_KEYS}}
    merged["passes"] = int(first.get("passes", 1)) + int(second.get("passes", 1))
    return {**merged, **ceiling_rates(merged)}


def with_stream_readings(calibration: dict[str, Any], readings: list[float]) -> dict[str, Any]:
    """``calibration`` whose stream figure is also the best of ``readings`` (a ``StreamProbe``'s, taken during the
    run), so a probe that caught a faster moment raises the ceilings the run is compared with."""
    merged = {**calibration, "stream_read_gbps": max([calibration["stream_read_gbps"], *readings])}
    return {**merged, **ceiling_rates(merged)}


def ceiling_rates(calibration: dict[str, Any]) -> dict[str, float]:
    """The rates the ceilings use: the best bandwidth any measured read reached (stream, GEMV in the serving dtype,
    GEMV in fp32) and the best GEMM rate (serving dtype or fp32). Taking the best keeps the ceiling honest on CPUs
    without native 16-bit arithmetic, where torch's 16-bit GEMV/GEMM are conversion-bound and an engine can do
    better (e.g. by keeping an fp32 copy)."""
    bandwidth = max(calibration[k] for k in ("stream_read_gbps", "gemv_gbps", "gemv_fp32_gbps"))
    peak = max(calibration["gemm_gflops"], calibration["gemm_fp32_gflops"])
    return {"bandwidth_gbps": bandwidth, "peak_gflops": peak}


def _cfg_int(cfg: Any, name: str, default: int | None = None) -> int:
    value = getattr(cfg, name, None)
    if value is None:
        if default is None:
            raise ValueError(f"model config has no {name!r}")
        return default
    return int(value)


def _dims(cfg: Any) -> tuple[int, int, int, int, int, int, int]:
    hidden = _cfg_int(cfg, "hidden_size")
    q_heads = _cfg_int(cfg, "num_attention_heads")
    kv_heads = _cfg_int(cfg, "num_key_value_heads", q_heads)
    head_dim = _cfg_int(cfg, "head_dim", hidden // q_heads)
    return (hidden, q_heads, kv_heads, head_dim, _cfg_int(cfg, "intermediate_size"),
            _cfg_int(cfg, "num_hidden_layers"), _cfg_int(cfg, "vocab_size"))


def _layer_params(cfg: Any, model_type: str) -> int:
    hidden, q_heads, kv_heads, head_dim, inter, _, _ = _dims(cfg)
    q_out, kv_out = q_heads * head_dim, kv_heads * head_dim
    attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    qkv_bias = model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    o_bias = model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
    attn += (q_out + 2 * kv_out) * qkv_bias + hidden * o_bias
    mlp = 3 * hidden * inter + (2 * inter + hidden) * bool(getattr(cfg, "mlp_bias", False))
    norms = 2 * hidden + (2 * head_dim if model_type == "qwen3" else 0)
    return attn + mlp + norms


def weight_params_per_step(hf_config: Any) -> int:
    """Parameters read by one decode step: non-embedding params + lm_head params (tied or not), by formula."""
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type not in DENSE_DECODERS:
        raise ValueError(f"model_type={model_type!r} has no weight-bytes formula; supported: {DENSE_DECODERS}")
    hidden, _, _, _, _, layers, vocab = _dims(hf_config)
    return layers * _layer_params(hf_config, model_type) + hidden + vocab * hidden


def weight_bytes_per_step(hf_config: Any, dtype: torch.dtype | str) -> int:
    """Bytes of weights read by one decode step in ``dtype`` (W in the roofline)."""
    elem = torch.empty((), dtype=parse_torch_dtype(dtype)).element_size()
    return weight_params_per_step(hf_config) * elem


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype | str) -> int:
    """KV-cache bytes per token: 2 * layers * kv_heads * head_dim * bytes/elem."""
    _, _, kv_heads, head_dim, _, layers, _ = _dims(hf_config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=parse_torch_dtype(dtype)).element_size()


def flops_per_token(hf_config: Any, context: float = 0.0) -> float:
    """FLOPs to process one token at ``context`` earlier tokens: 2 * P + 4 * L * q_heads * head_dim * context."""
    _, q_heads, _, head_dim, _, layers, _ = _dims(hf_config)
    return 2.0 * weight_params_per_step(hf_config) + 4.0 * layers * q_heads * head_dim * max(context, 0.0)


def decode_roofline(hf_config: Any, dtype: torch.dtype | str, bandwidth_gbps: float, gflops: float,
                    batch_size: int = 1, mean_context: float = 0.0) -> dict[str, float]:
    """Decode ceilings (tok/s): batch-1 bandwidth ceiling BW / W, and at batch B the bandwidth, compute and
    combined ceilings (the latter = B / max(bytes / BW, FLOPs / F))."""
    if bandwidth_gbps <= 0 or gflops <= 0:
        raise ValueError(f"bandwidth_gbps={bandwidth_gbps!r} and gflops={gflops!r} must be positive")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be at least 1")
    weight_bytes = weight_bytes_per_step(hf_config, dtype)
    step_bytes = weight_bytes + batch_size * kv_bytes_per_token(hf_config, dtype) * max(mean_context, 0.0)
    step_flops = batch_size * flops_per_token(hf_config, mean_context)
    bw, peak = bandwidth_gbps * 1e9, gflops * 1e9
    return {
        "batch_size": batch_size,
        "mean_context": float(mean_context),
        "weight_bytes_per_step": weight_bytes,
        "bytes_per_step": step_bytes,
        "flops_per_step": step_flops,
        "batch1_bandwidth_ceiling_tok_s": bw / weight_bytes,
        "bandwidth_ceiling_tok_s": batch_size * bw / step_bytes,
        "compute_ceiling_tok_s": batch_size * peak / step_flops,
        "ceiling_tok_s": batch_size / max(step_bytes / bw, step_flops / peak),
    }


def roofline_report(hf_config: Any, dtype: torch.dtype | str, calibration: dict[str, Any], batch_size: int,
                    mean_context: float) -> dict[str, Any]:
    """Calibration plus the model's ceilings (against ``bandwidth_gbps`` and ``peak_gflops``, see
    ``ceiling_rates``); ``error`` names why the ceilings are missing for a model without a formula."""
    report: dict[str, Any] = {"calibration": calibration, "ceilings": None, "error": None}
    try:
        report["ceilings"] = decode_roofline(hf_config, dtype, calibration["bandwidth_gbps"],
                                             calibration["peak_gflops"], batch_size, mean_context)
    except ValueError as exc:
        report["error"] = str(exc)
    return report


def generation_flops(hf_config: Any, input_len: int, output_len: int) -> float:
    """FLOPs to prefill ``input_len`` tokens and decode ``output_len`` (the last sampled token is never fed back):
    2 * P per processed token plus attention over every earlier token."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len={input_len!r} and output_len={output_len!r} must be at least 1")
    _, q_heads, _, head_dim, _, layers, _ = _dims(hf_config)
    processed = input_len + output_len - 1
    pairs = processed * (processed - 1) / 2.0
    return 2.0 * weight_params_per_step(hf_config) * processed + 4.0 * layers * q_heads * head_dim * pairs


def workload_roofline(hf_config: Any, dtype: torch.dtype | str, bandwidth_gbps: float, gflops: float,
                      lengths: list[tuple[int, int]], max_batch: int) -> dict[str, float]:
    """The least time this box's roofline allows for a whole offline batch of requests ``(input_len, output_len)``:
    every prompt prefilled at the peak FLOP rate (a prefill reads the weights once for thousands of tokens, so it is
    compute-bound), then the decode steps of a continuous batch of up to ``max_batch`` requests admitted in order,
    each step taking ``max(bytes / BW, FLOPs / F)`` for the weights plus the active requests' KV cache at their
    current context. Unlike the FLOP-only fraction it charges the decode phase with the bytes it must read."""
    if bandwidth_gbps <= 0 or gflops <= 0:
        raise ValueError(f"bandwidth_gbps={bandwidth_gbps!r} and gflops={gflops!r} must be positive")
    if max_batch < 1 or not lengths or any(i < 1 or o < 1 for i, o in lengths):
        raise ValueError(f"max_batch={max_batch!r} and every (input_len, output_len) in {len(lengths)} requests "
                         "must be at least 1")
    bw, peak = bandwidth_gbps * 1e9, gflops * 1e9
    prefill_flops = sum(generation_flops(hf_config, i, 1) for i, _ in lengths)
    weight_bytes, kv_token = weight_bytes_per_step(hf_config, dtype), kv_bytes_per_token(hf_config, dtype)
    # per request: [context before its next decode step, decode steps left]
    waiting = [[i, o - 1] for i, o in lengths if o > 1]
    active: list[list[int]] = []
    decode_s, steps = 0.0, 0
    while waiting or active:
        while waiting and len(active) < max_batch:
            active.append(waiting.pop(0))
        contexts = [ctx for ctx, _ in active]
        step_bytes = weight_bytes + kv_token * sum(contexts)
        step_flops = sum(flops_per_token(hf_config, ctx) for ctx in contexts)
        decode_s += max(step_bytes / bw, step_flops / peak)
        steps += 1
        for request in active:
            request[0] += 1
            request[1] -= 1
        active = [r for r in active if r[1] > 0]
    prefill_s = prefill_flops / peak
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps, "seconds": prefill_s + decode_s}
