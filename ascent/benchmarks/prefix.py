"""``ascent bench prefix`` (B5): time to first token with a shared system prompt, prefix caching on vs off.

``--num-prompts`` requests share one ``--prefix-len``-token system prompt (random ids) and add ``--suffix-len`` unique
tokens each. Each engine (prefix caching on, then off; same model, same flags) answers them one at a time with one
greedy token, so a request's TTFT is its own prefill (plus the step's host cost), not queueing. Reported: TTFT per
engine (mean / median / p99 ms) and their ratio, the cached tokens of every request after the first against the
analytic expectation ``floor(prefix / block) * block`` and the hit rate ``cached / prompt tokens`` over those requests.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from ascent.benchmarks.common import collect_env, dtype_name, percentiles, pin_threads, safe_ratio, write_json


def check_prompt_sizes(num_prompts: int, prefix_len: int, suffix_len: int) -> None:
    """ValueError naming the sizes unless num_prompts >= 1, prefix_len >= 0 and suffix_len >= 1."""
    if num_prompts < 1 or prefix_len < 0 or suffix_len < 1:
        raise ValueError(f"num_prompts={num_prompts!r} must be >= 1, prefix_len={prefix_len!r} >= 0 and "
                         f"suffix_len={suffix_len!r} >= 1")


def shared_prefix_prompts(num_prompts: int, prefix_len: int, suffix_len: int, vocab: int,
                          seed: int) -> list[list[int]]:
    """``num_prompts`` token lists: one shared random prefix, then ``suffix_len`` random tokens of each prompt's own
    (ids in [0, vocab))."""
    check_prompt_sizes(num_prompts, prefix_len, suffix_len)
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    return [prefix + rng.integers(0, vocab, suffix_len).tolist() for _ in range(num_prompts)]


def _ttfts(llm: Any, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """One request at a time: (TTFT seconds, cached prompt tokens) per prompt."""
    from ascent import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttfts, cached = [], []
    for tokens in prompts:
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        metrics = out.metrics
        if metrics is None or metrics.first_token_time is None:
            raise RuntimeError("the engine reported no first-token time")
        ttfts.append(metrics.first_token_time - metrics.arrival_time)
        cached.append(int(out.num_cached_tokens or 0))
    return ttfts, cached


def _summary(ttfts: list[float]) -> dict[str, Any]:
    ms = [1e3 * t for t in ttfts]
    return {"mean_ttft_ms": float(np.mean(ms)), "median_ttft_ms": float(np.median(ms)),
            "p99_ttft_ms": percentiles(ms, (99,))["99"], "ttfts_ms": ms}


def run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    """Run B5; returns the result dict (also written to ``--output-json``)."""
    from ascent.benchmarks.throughput import build_llm, prompt_vocab_size

    check_prompt_sizes(args.num_prompts, args.prefix_len, args.suffix_len)  # before any engine is built
    threads = pin_threads(args.num_threads)
    max_len = args.prefix_len + args.suffix_len + 1
    engines: dict[str, dict[str, Any]] = {}
    block_size = dtype = model = None
    for caching in (True, False):
        llm = build_llm(args, max_len, enable_prefix_caching=caching)
        config = llm.llm_engine.config
        block_size, dtype = config.cache_config.block_size, config.model_config.torch_dtype
        model = config.model_config.model
        prompts = shared_prefix_prompts(args.num_prompts, args.prefix_len, args.suffix_len, prompt_vocab_size(llm),
                                        args.seed)
        _ttfts(llm, [prompts[0][::-1]])  # warm-up on an unrelated prompt (no shared blocks)
        ttfts, cached = _ttfts(llm, prompts)
        engines["caching" if caching else "no_caching"] = {**_summary(ttfts), "cached_tokens": cached}
        del llm
    expected = args.prefix_len // block_size * block_size
    later = engines["caching"]["cached_tokens"][1:]
    prompt_len = args.prefix_len + args.suffix_len
    result = {
        "benchmark": "prefix", "model": model, "dtype": dtype_name(dtype), "block_size": block_size,
        "num_prompts": args.num_prompts, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
        **engines,
        "ttft_ratio_caching_vs_not": safe_ratio(engines["caching"]["mean_ttft_ms"],
                                                engines["no_caching"]["mean_ttft_ms"]),
        "expected_cached_tokens": expected,
        "hit_rate_after_first": sum(later) / (prompt_len * len(later)) if later else None,
        "expected_hit_rate_after_first": expected / prompt_len,
        "env": collect_env(dtype, threads),
    }
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


def format_summary(r: dict[str, Any]) -> str:
    on, off = r["caching"], r["no_caching"]
    hit = r["hit_rate_after_first"]
    return "\n".join([
        f"prefix (B5)  model={r['model']}  {r['num_prompts']} prompts = {r['prefix_len']} shared + {r['suffix_len']} "
        f"own tokens  block_size={r['block_size']}",
        f"  TTFT caching on:  mean {on['mean_ttft_ms']:.1f} ms  median {on['median_ttft_ms']:.1f}  "
        f"p99 {on['p99_ttft_ms']:.1f}",
        f"  TTFT caching off: mean {off['mean_ttft_ms']:.1f} ms  median {off['median_ttft_ms']:.1f}  "
        f"p99 {off['p99_ttft_ms']:.1f}   ratio on/off = {r['ttft_ratio_caching_vs_not']:.3f}",
        f"  cached tokens after the first request: {sorted(set(on['cached_tokens'][1:]))} (expected "
        f"{r['expected_cached_tokens']});  hit rate {hit if hit is None else f'{hit:.3f}'} (expected "
        f"{r['expected_hit_rate_after_first']:.3f}; target >= 0.9)",
    ])


def register_prefix_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``ascent bench prefix`` (sets ``func``)."""
    from ascent.benchmarks.cli import add_engine_args

    parser = commands.add_parser("prefix", help="B5 TTFT with a shared system prompt, prefix caching on vs off",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=32, help="requests sharing the prefix")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared system-prompt tokens")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own")
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")
    parser.set_defaults(func=run_prefix)
    return parser
