"""``ascent bench sched`` (B4): the host cost of a decode step without a model.

For each batch size N the real ``Scheduler`` (with its ``KVCacheManager``, prefix caching on) and the real
``ModelRunner``'s host side (persistent-batch update and numpy input preparation, ``ModelRunner.prepare_host_inputs``,
built from the model's config without weights) run N requests of ``--prompt-len`` random tokens; a fake model samples
one fixed token per finished row. After the prompts are in and every request decodes, ``--steps`` steps are timed per
phase: ``schedule``, input preparation, ``update_from_output``. Reported per step and per sequence (µs); the spec's
targets (≤ 5 µs per sequence and step for the scheduler, ≤ 5 % of a real step at batch 32) are printed beside them,
never asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np

from ascent.benchmarks.common import collect_env, write_json

SCHEDULER_TARGET_US_PER_SEQ = 5.0  # anchors_style_perf.md §2.4 B4
FAKE_TOKEN = 42


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"num_seqs={text!r} must be a comma-separated list of positive integers")
    return sizes


def _engine_config(args: argparse.Namespace, max_seqs: int) -> Any:
    from ascent.args import EngineArgs

    max_len = args.prompt_len + args.steps + args.warmup_steps + _prefill_steps(max_seqs, args.prompt_len) + 8
    return EngineArgs(model=args.model, max_num_seqs=max_seqs, max_model_len=max_len, block_size=args.block_size,
                      max_num_batched_tokens=max(2048, max_seqs), dtype=args.dtype).create_engine_config()


def _prefill_steps(num_seqs: int, prompt_len: int) -> int:
    """An upper bound on the steps the prompts take (requests done early decode meanwhile, one token a step)."""
    return -(-num_seqs * prompt_len // max(2048, num_seqs)) + 1


def _fake_output(runner: Any, inp: Any) -> Any:
    """One FAKE_TOKEN for every row whose known tokens are all computed (the runner's sampling rule), appended to the
    persistent batch as the sampler would."""
    from ascent.core.sched_output import ModelRunnerOutput

    batch = runner.input_batch
    sampling = inp.common.seq_lens_np >= batch.num_tokens[inp.rows]
    tokens: list[list[int]] = []
    for row, samples in zip(inp.rows.tolist(), sampling.tolist()):
        if samples:
            batch.append_token(row, FAKE_TOKEN)
        tokens.append([FAKE_TOKEN] if samples else [])
    return ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=tokens)


def _check_mirrored(scheduler: Any, runner: Any) -> None:
    """The runner's persistent batch holds every running request with the scheduler's token count (a fake step that
    lost or duplicated a token would time the wrong work)."""
    batch = runner.input_batch
    for request in scheduler.running:
        row = batch.req_id_to_index[request.request_id]
        if int(batch.num_tokens[row]) != request.num_tokens:
            raise RuntimeError(f"request {request.request_id}: runner holds {int(batch.num_tokens[row])} tokens, "
                               f"the scheduler {request.num_tokens}")


def measure_batch(config: Any, num_seqs: int, prompt_len: int, steps: int, warmup_steps: int,
                  seed: int) -> dict[str, float]:
    """Time ``steps`` decode steps of ``num_seqs`` requests; returns µs per step and per sequence of each phase."""
    from ascent.config import CacheConfig, SchedulerConfig
    from ascent.core.kv_cache.hashing import make_block_hasher
    from ascent.core.kv_cache.manager import KVCacheManager
    from ascent.core.request import Request
    from ascent.core.scheduler import Scheduler
    from ascent.sampling_params import SamplingParams
    from ascent.worker.model_runner import ModelRunner

    block, max_len = config.cache_config.block_size, config.model_config.max_model_len
    blocks_per_seq = -(-max_len // block)
    manager = KVCacheManager(num_blocks=num_seqs * blocks_per_seq + 1, block_size=block, max_model_len=max_len,
                             enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs)),
                          CacheConfig(block_size=block), max_len, manager)
    runner = ModelRunner(config)
    rng = random.Random(seed)
    vocab = int(config.model_config.vocab_size)
    hasher = make_block_hasher(block)
    params = SamplingParams(max_tokens=max_len, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"b4-{i}", prompt, params, arrival_time=float(i), block_hasher=hasher))
    phases: dict[str, list[float]] = {"schedule": [], "input_prep": [], "update": []}
    step, decode_steps = 0, 0
    for _ in range(steps + warmup_steps + _prefill_steps(num_seqs, prompt_len) + 4):
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        inp = runner.prepare_host_inputs(so)
        t2 = time.perf_counter()
        out = _fake_output(runner, inp)
        t3 = time.perf_counter()
        scheduler.update_from_output(so, out)
        t4 = time.perf_counter()
        if len(so.num_scheduled_tokens) < num_seqs or so.total_num_scheduled_tokens != num_seqs:
            continue  # prompts still going in
        decode_steps += 1
        if decode_steps > warmup_steps:
            phases["schedule"].append(t1 - t0)
            phases["input_prep"].append(t2 - t1)
            phases["update"].append(t4 - t3)
            step += 1
            if step == steps:
                break
    if step < steps:
        raise RuntimeError(f"only {step} of {steps} decode steps of {num_seqs} requests ran")
    _check_mirrored(scheduler, runner)
    result = {f"{name}_us_per_step": float(np.median(v)) * 1e6 for name, v in phases.items()}
    result["scheduler_us_per_step"] = result["schedule_us_per_step"] + result["update_us_per_step"]
    result["host_us_per_step"] = result["scheduler_us_per_step"] + result["input_prep_us_per_step"]
    for key in ("scheduler", "input_prep", "host"):
        result[f"{key}_us_per_seq"] = result[f"{key}_us_per_step"] / num_seqs
    return {"num_seqs": num_seqs, **result}


def run_sched(args: argparse.Namespace) -> dict[str, Any]:
    """Run B4 for every ``--num-seqs``; returns the result dict (also written to ``--output-json``)."""
    sizes = _batch_sizes(args.num_seqs)
    if args.steps < 1 or args.prompt_len < 1:
        raise ValueError(f"steps={args.steps!r} and prompt_len={args.prompt_len!r} must be at least 1")
    config = _engine_config(args, max(sizes))
    rows = [measure_batch(config, n, args.prompt_len, args.steps, args.warmup_steps, args.seed) for n in sizes]
    result = {"benchmark": "sched", "model": config.model_config.model, "block_size": config.cache_config.block_size,
              "prompt_len": args.prompt_len, "steps": args.steps, "results": rows,
              "scheduler_target_us_per_seq": SCHEDULER_TARGET_US_PER_SEQ,
              "env": collect_env(config.model_config.torch_dtype, None)}
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


def format_summary(result: dict[str, Any]) -> str:
    lines = [f"sched (B4)  block_size={result['block_size']}  prompt_len={result['prompt_len']}  "
             f"steps={result['steps']}  (medians; target: scheduler <= {SCHEDULER_TARGET_US_PER_SEQ:g} us/seq/step)"]
    for r in result["results"]:
        lines.append(f"  N={r['num_seqs']:4d}: scheduler {r['scheduler_us_per_step']:8.1f} us/step "
                     f"({r['scheduler_us_per_seq']:.2f} us/seq; schedule {r['schedule_us_per_step']:.1f}, update "
                     f"{r['update_us_per_step']:.1f})  input prep {r['input_prep_us_per_step']:8.1f} us/step "
                     f"({r['input_prep_us_per_seq']:.2f} us/seq)  host total {r['host_us_per_step'] / 1e3:.3f} ms")
    return "\n".join(lines)


def register_sched_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``ascent bench sched`` (sets ``func``)."""
    parser = commands.add_parser("sched", help="B4 scheduler + input-preparation cost per decode step, no model",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="model whose config sizes the runner (weights are not read)")
    parser.add_argument("--dtype", default="auto", help="serving dtype of the config")
    parser.add_argument("--num-seqs", default="16,64,256", help="running requests per measurement (comma list)")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed decode steps first")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")
    parser.set_defaults(func=run_sched)
    return parser
