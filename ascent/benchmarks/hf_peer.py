"""HF transformers peer: the same weights and dtype as the engine, driven through batched ``generate``.

Throughput: requests sorted by output length, batches of ``batch_size`` with left padding, each batch generating
exactly ``max(output_len)`` tokens (``min_new_tokens == max_new_tokens``, the ``ignore_eos`` equivalent) with
``do_sample=True, temperature, top_k=0, top_p=1.0``. Credited tokens are the requested ones, so the totals equal the
engine's; tokens a shorter request generates only because its batch runs longer are reported as padding.
Latency: greedy ``generate`` at a fixed batch size.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ascent.benchmarks.common import Timer
from ascent.benchmarks.datasets import BenchRequest


def load_peer_model(model_path: str, dtype: torch.dtype) -> Any:
    """Build the HF model from the engine's resolved ``model_path`` (a ``.gguf`` file, dequantized to ``dtype``,
    or an HF directory) in eval mode."""
    from transformers import AutoModelForCausalLM

    if model_path.lower().endswith(".gguf"):
        if not os.path.isfile(model_path):
            raise ValueError(f"model_path={model_path!r} is not a file")
        from transformers.utils.quantization_config import GgufConfig

        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(model_path)), gguf_file=os.path.basename(model_path), dtype=dtype,
            quantization_config=GgufConfig(dequantize=True))
    elif os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    else:
        raise ValueError(f"model_path={model_path!r} is neither a .gguf file nor a model directory")
    return model.eval()


def _pad_token_id(model: Any) -> int:
    cfg = model.config
    for value in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists to one ``[B, T]`` int64 batch; returns ``(input_ids, attention_mask)``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def _generation_config(model: Any, num_tokens: int, temperature: float) -> Any:
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    return GenerationConfig(max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=_pad_token_id(model),
                            eos_token_id=model.config.eos_token_id, use_cache=True, **sampling)


def generate_batch(model: Any, prompts: list[list[int]], num_tokens: int, temperature: float) -> int:
    """One left-padded ``generate`` call producing exactly ``num_tokens`` per row; returns the tokens generated."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r} must be at least 1")
    ids, mask = left_pad(prompts, _pad_token_id(model))
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask,
                             generation_config=_generation_config(model, num_tokens, temperature))
    return int((out.shape[1] - ids.shape[1]) * out.shape[0])


def plan_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Sort by (output_len, input_len) and cut into batches of at most ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"peer batch_size={batch_size!r} must be at least 1")
    ordered = sorted(requests, key=lambda r: (r.output_len, r.input_len))
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def throughput_metrics(elapsed: float, num_requests: int, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """vLLM throughput-bench keys from a wall time and token counts."""
    if elapsed <= 0:
        raise ValueError(f"elapsed={elapsed!r} must be positive")
    total = input_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def peer_throughput(model: Any, requests: list[BenchRequest], temperature: float, batch_size: int = 16,
                    seed: int = 0) -> dict[str, Any]:
    """Offline throughput of HF ``generate`` over ``requests`` after one small warmup generate."""
    batches = plan_batches(requests, batch_size)
    first = batches[0]
    generate_batch(model, [r.prompt_token_ids for r in first], min(8, first[-1].output_len), temperature)
    torch.manual_seed(seed)
    generated = 0
    with Timer() as timer:
        for batch in batches:
            generated += generate_batch(model, [r.prompt_token_ids for r in batch], batch[-1].output_len, temperature)
    requested = sum(r.output_len for r in requests)
    result = throughput_metrics(timer.elapsed, len(requests), sum(r.input_len for r in requests), requested)
    result.update({"batch_size": batch_size, "num_batches": len(batches), "padded_output_tokens": generated - requested,
                   "generated_tokens": generated})
    return result


def peer_latencies(model: Any, prompts: list[list[int]], output_len: int, num_iters: int,
                   num_iters_warmup: int) -> list[float]:
    """Wall times (s) of ``num_iters`` greedy generates of ``output_len`` tokens on the ``prompts`` batch."""
    if num_iters < 1 or num_iters_warmup < 0:
        raise ValueError(f"num_iters={num_iters!r} must be >= 1 and num_iters_warmup={num_iters_warmup!r} >= 0")
    for _ in range(num_iters_warmup):
        generate_batch(model, prompts, output_len, 0.0)
    latencies = []
    for _ in range(num_iters):
        with Timer() as timer:
            generate_batch(model, prompts, output_len, 0.0)
        latencies.append(timer.elapsed)
    return latencies
