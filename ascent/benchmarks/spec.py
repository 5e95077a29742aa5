"""``ascent bench spec``: speculative decoding proposers against no speculation, in the same process.

Workloads (:mod:`ascent.benchmarks.spec_workloads`): ``repetitive`` (code edits, re-asked structured answers, "repeat
this paragraph": greedy output copies the input) and ``non_repetitive`` (varied questions).

Draft length k: ``--num-speculative-tokens``, else each method's default: suffix decoding's engine default (the tree
depth, 24, as in vLLM; each request's draft is bounded by its match length) and 3 for the others.

Methods: the model-free ``ngram`` and ``suffix``, and ``draft_model`` drafting with the target truncated to its first
``--draft-num-layers`` layers (the ``draft_num_layers`` extension key: no second checkpoint needed, weights shared).
``name+dynamic`` runs a method with ``dynamic: true`` and ``--dynamic-params`` (default: the engine's dynamic defaults;
per-request draft lengths from acceptance statistics under the cost-aware draft gate).
EAGLE / EAGLE-3 / Medusa / MTP are not benchmarked: they need trained draft heads for the target, which do not exist
for the default model (random heads would only measure rejection overhead).

One engine per configuration (no speculation plus each method), all built and warmed up first; then ``--rounds``
rounds, each on freshly generated prompts (seed + round), run every engine on each workload back to back (the engine
order rotates per round), so slow phases of a shared machine hit every engine alike. ``--max-concurrency`` caps the
running requests (the engine's ``max_num_seqs``): 1 = single stream, where a decode step is memory-bound and
speculation pays; larger batches make the verification of extra tokens cost real compute.
Per method and workload: mean acceptance length (1 + accepted / drafts), acceptance rate, per-position acceptance
(accepted at position i / drafts), output tok/s (all rounds), the speed ratio to no speculation (median of the
per-round ratios; ``speedup_aggregate``: ratio of the all-round throughputs; ``speedup_cpu_time``: the same median
on tokens per CPU second of this process, less sensitive to other load on a shared machine) and whether greedy
outputs equal the outputs without speculation (bf16 verification of k + 1 positions rounds differently from 1-token
decoding, so near-ties can flip there; float32 is exact).
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ascent.benchmarks.common import Timer, collect_env, dtype_name, pin_threads, safe_ratio, write_json
from ascent.benchmarks.datasets import BenchRequest, length_summary
from ascent.benchmarks.spec_ceiling import bench_batch_size, first_ceiling, format_ceiling, runner_spec
from ascent.benchmarks.spec_workloads import (WORKLOADS, build_workloads, non_repetitive_conversations,
                                              repetitive_conversations)
from ascent.config import parse_json_object

logger = logging.getLogger(__name__)

__all__ = ["non_repetitive_conversations", "repetitive_conversations", "run_spec", "SpecCounts"]

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8
NO_SPEC = "none"
DEFAULT_K = 3  # draft length of methods whose engine config requires one, unless --num-speculative-tokens
BENCH_METHODS = ("ngram", "suffix", "draft_model")
VARIANTS = ("", "dynamic")
UNSUPPORTED = {"eagle": "trained EAGLE heads", "eagle3": "trained EAGLE-3 heads", "medusa": "trained Medusa heads",
               "mtp": "a model with MTP layers", "dflash": "a DFlash drafter", "dspark": "a DSpark drafter"}
# '+dynamic' runs the engine's own dynamic defaults (DynamicSpecParams()) unless --dynamic-params is given. A survival
# floor of 0.25 (the former bench default) lost against no floor at every concurrency measured (c1 / c4 / c16, both
# workloads, one process): the cost-aware gate already cuts drafts that do not pay.
DEFAULT_DYNAMIC_PARAMS: dict[str, Any] = {}


@dataclass(frozen=True)
class SpecCounts:
    """Cumulative draft verification counts (a copy of the scheduler's ``spec_stats_total``) and the goodput
    arbiter's decided steps ``(speculative, plain)`` (zeros without dynamic speculation)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    arbiter_steps: tuple[int, int] = (0, 0)

    def minus(self, before: "SpecCounts") -> "SpecCounts":
        """Counts accumulated since ``before``."""
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now = list(self.accepted_per_pos) + [0] * (width - len(self.accepted_per_pos))
        old = list(before.accepted_per_pos) + [0] * (width - len(before.accepted_per_pos))
        return SpecCounts(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                          self.num_accepted_tokens - before.num_accepted_tokens,
                          tuple(a - b for a, b in zip(now, old)),
                          (self.arbiter_steps[0] - before.arbiter_steps[0],
                           self.arbiter_steps[1] - before.arbiter_steps[1]))

    def plus(self, other: "SpecCounts") -> "SpecCounts":
        """Counts of both (e.g. two rounds)."""
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = list(self.accepted_per_pos) + [0] * (width - len(self.accepted_per_pos))
        b = list(other.accepted_per_pos) + [0] * (width - len(other.accepted_per_pos))
        return SpecCounts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                          self.num_accepted_tokens + other.num_accepted_tokens, tuple(x + y for x, y in zip(a, b)),
                          (self.arbiter_steps[0] + other.arbiter_steps[0],
                           self.arbiter_steps[1] + other.arbiter_steps[1]))


# ------------------------------------------------------------------------------------------------ measurement
def spec_counts(llm: Any) -> SpecCounts:
    """A copy of the engine scheduler's cumulative speculation counts (zeros without speculation)."""
    total = getattr(llm.llm_engine.engine_core.scheduler, "spec_stats_total", None)
    if total is None:
        return SpecCounts()
    return SpecCounts(int(total.num_drafts), int(total.num_draft_tokens), int(total.num_accepted_tokens),
                      tuple(int(x) for x in total.accepted_per_pos), _arbiter_steps(llm))


def _arbiter_steps(llm: Any) -> tuple[int, int]:
    """The in-process runner's goodput-arbiter step counts ``(speculative, plain)``; zeros when there is none (no
    dynamic speculation, or workers in other processes)."""
    arbiter = getattr(runner_spec(llm), "arbiter", None)
    return (int(arbiter.num_steps[0]), int(arbiter.num_steps[1])) if arbiter is not None else (0, 0)


def acceptance_summary(counts: SpecCounts, k: int) -> dict[str, Any]:
    """Mean acceptance length, acceptance rate and per-position rates (length ``k``); None where no draft ran."""
    drafts, tokens = counts.num_drafts, counts.num_draft_tokens
    per_pos = list(counts.accepted_per_pos[:k]) + [0] * max(0, k - len(counts.accepted_per_pos))
    return {
        "num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": counts.num_accepted_tokens,
        "accepted_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + counts.num_accepted_tokens / drafts if drafts else None,
        "acceptance_rate": safe_ratio(counts.num_accepted_tokens, tokens),
        "per_position_acceptance_rate": [c / drafts for c in per_pos] if drafts else None,
        "mean_draft_length": safe_ratio(tokens, drafts),
        "arbiter_speculative_steps": counts.arbiter_steps[0], "arbiter_plain_steps": counts.arbiter_steps[1],
    }


def greedy_generate(llm: Any, requests: list[BenchRequest], ignore_eos: bool) -> list[list[int]]:
    """One greedy ``generate`` of all requests; returns each request's output token ids."""
    from ascent import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=ignore_eos) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def timed_run(llm: Any, requests: list[BenchRequest], ignore_eos: bool) -> tuple[dict[str, Any], list[list[int]]]:
    """Time one greedy generate; returns (metrics with the speculation counts of this run, output token ids)."""
    before = spec_counts(llm)
    cpu = time.process_time()
    with Timer() as timer:
        outputs = greedy_generate(llm, requests, ignore_eos)
    cpu = time.process_time() - cpu
    produced = sum(len(o) for o in outputs)
    return {"elapsed_time": timer.elapsed, "total_output_tokens": produced,
            "output_tokens_per_second": produced / timer.elapsed if timer.elapsed > 0 else None,
            "cpu_time": cpu, "counts": spec_counts(llm).minus(before)}, outputs


def parse_dynamic_params(text: str | None) -> dict[str, Any]:
    """``--dynamic-params`` JSON object (validated as ``dynamic_params``); None -> the bench defaults."""
    from ascent.spec_decode.dynamic import DynamicSpecParams

    if text is None:
        return dict(DEFAULT_DYNAMIC_PARAMS)
    params = parse_json_object("dynamic_params", text)
    DynamicSpecParams.from_dict(params)
    return params


def method_k(args: argparse.Namespace, method: str) -> int:
    """Draft length k of ``method``: ``--num-speculative-tokens`` when given, else the engine's default for suffix
    decoding (its tree depth, as vLLM: per-request drafts are bounded by the match length) and
    :data:`DEFAULT_K` for the methods whose engine config requires k."""
    if args.num_speculative_tokens is not None:
        return int(args.num_speculative_tokens)
    if method.partition("+")[0] == "suffix":
        from ascent.spec_decode.base import SpeculativeConfig

        return SpeculativeConfig.from_json({"method": "suffix"}).num_speculative_tokens
    return DEFAULT_K


def speculative_config(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The ``speculative_config`` dict of ``method`` (``base`` or ``base+dynamic``) from the bench flags."""
    base, _, variant = method.partition("+")
    config: dict[str, Any] = {"method": base, "num_speculative_tokens": method_k(args, method)}
    if base == "ngram":
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(args, name, None) is not None:
                config[name] = getattr(args, name)
    if base == "draft_model":
        config["draft_num_layers"] = getattr(args, "draft_num_layers", None) or 6
    if variant == "dynamic":
        config["dynamic"] = True
        config["dynamic_params"] = parse_dynamic_params(getattr(args, "dynamic_params", None))
    if getattr(args, "disable_by_batch_size", None) is not None:
        config["speculative_disable_by_batch_size"] = args.disable_by_batch_size
    return config


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first output token where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def outputs_match(reference: list[list[int]], outputs: list[list[int]]) -> tuple[bool, list[int]]:
    """(all outputs equal, first diverging output position of each differing request)."""
    if len(reference) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(reference)} reference outputs")
    positions = [first_divergence(a, b) for a, b in zip(reference, outputs)]
    diverged = [p for p in positions if p is not None]
    return not diverged, diverged


# ------------------------------------------------------------------------------------------------ driver
def parse_methods(text: str) -> list[str]:
    """``"ngram,suffix+dynamic"`` -> ``["ngram", "suffix+dynamic"]``; methods of ``BENCH_METHODS``, optionally with
    ``+dynamic``; no duplicates. Methods that need trained draft heads are refused with the reason."""
    methods = [m.strip() for m in str(text).split(",") if m.strip()]
    if not methods:
        raise ValueError(f"methods={text!r} names no method")
    for m in methods:
        base, sep, variant = m.partition("+")
        if base in UNSUPPORTED:
            raise ValueError(f"method {base!r} needs {UNSUPPORTED[base]} for the target; none exist for the bench "
                             f"model, so it is not benchmarked (choose from {BENCH_METHODS})")
        if base not in BENCH_METHODS or (sep and variant not in VARIANTS[1:]):
            raise ValueError(f"method {m!r} is not supported here; choose from {BENCH_METHODS}, optionally with "
                             "'+dynamic'")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods={text!r} repeats a method")
    return methods


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "output_len", "num_speculative_tokens", "rounds"):
        value = getattr(args, name, 1)
        if value is not None and value < 1:  # num_speculative_tokens None: each method's default
            raise ValueError(f"{name}={value!r} must be at least 1")


def _model_config(args: argparse.Namespace) -> Any:
    """The engine's resolved ``ModelConfig`` for these flags (reads config metadata, no weights)."""
    from ascent.args import EngineArgs

    engine_args = EngineArgs(model=args.model, dtype=args.dtype,
                             hardware_profile=getattr(args, "hardware_profile", None) or "auto")
    return engine_args.create_engine_config().model_config


def _load_tokenizer(model_config: Any) -> Any:
    """The model's tokenizer, loaded the way the engine loads it (no engine is built)."""
    from ascent.tokenizer import get_tokenizer

    return get_tokenizer(model_config.model, model_config.tokenizer, model_config.chat_template)


def round_workloads(tokenizer: Any, args: argparse.Namespace) -> list[dict[str, list[BenchRequest]]]:
    """One workload set per round (seeds ``seed .. seed + rounds - 1``)."""
    return [build_workloads(tokenizer, args.num_prompts, args.output_len, args.seed + r)
            for r in range(getattr(args, "rounds", 1))]


def build_engines(args: argparse.Namespace, max_model_len: int, configs: dict[str, dict[str, Any] | None],
                  warmup: list[BenchRequest]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One warmed-up engine per configuration (same engine flags); returns (engines, startup timings)."""
    from ascent.benchmarks.throughput import build_llm

    overrides: dict[str, Any] = {}
    if getattr(args, "max_concurrency", None) is not None:
        overrides["max_num_seqs"] = args.max_concurrency
    engines, startup = {}, {}
    for name, spec in configs.items():
        llm = build_llm(args, max_model_len, speculative_config=spec, **overrides)
        greedy_generate(llm, warmup, ignore_eos=True)
        engines[name] = llm
        startup[name] = dict(getattr(llm.llm_engine, "timings", {}) or {})
    return engines, startup


def run_rounds(args: argparse.Namespace, engines: dict[str, Any],
               rounds: list[dict[str, list[BenchRequest]]]) -> list[dict[str, dict[str, Any]]]:
    """Per round and workload, every engine back to back (order rotated per round): ``[round][workload][name]``
    = (metrics, outputs)."""
    names = list(engines)
    results = []
    for r, workloads in enumerate(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        measured: dict[str, dict[str, Any]] = {}
        for w, reqs in workloads.items():
            measured[w] = {}
            for name in order:
                measured[w][name] = timed_run(engines[name], reqs, args.ignore_eos)
                logger.info("bench spec round %d %s %s: %.2f output tok/s", r, w, name,
                            measured[w][name][0]["output_tokens_per_second"] or 0.0)
        results.append(measured)
    return results


def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    """Run the spec-decode benchmark; returns the result dict (also ``--output-json`` and a stdout summary)."""
    _validate(args)
    methods = parse_methods(args.methods)
    threads = pin_threads(args.num_threads)
    model_config = _model_config(args)
    tokenizer = _load_tokenizer(model_config)
    rounds = round_workloads(tokenizer, args)
    warmup_sets = build_workloads(tokenizer, WARMUP_PROMPTS, WARMUP_TOKENS, args.seed + 10_000)
    warmup = [r for name in WORKLOADS for r in warmup_sets[name]]
    longest = max(r.input_len for reqs in (*(w for rd in rounds for w in rd.values()), warmup) for r in reqs)
    max_model_len = longest + args.output_len + max(method_k(args, m) for m in methods) + 1
    configs = {NO_SPEC: None, **{m: speculative_config(args, m) for m in methods}}
    engines, startup = build_engines(args, max_model_len, configs, warmup)
    try:
        measured = run_rounds(args, engines, rounds)
        ceiling = first_ceiling(engines, bench_batch_size(args))
    finally:
        engines.clear()
        gc.collect()
    result = assemble_result(args, model_config, methods, rounds, measured, startup, threads)
    result["speculation_ceiling"] = {"method": ceiling[0], **ceiling[1]} if ceiling else None
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


RUN_KEYS = ("elapsed_time", "total_output_tokens", "output_tokens_per_second")


def _totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    elapsed = sum(r["elapsed_time"] for r in runs)
    tokens = sum(r["total_output_tokens"] for r in runs)
    cpu = sum(r.get("cpu_time", 0.0) for r in runs)
    return {"elapsed_time": elapsed, "total_output_tokens": tokens,
            "output_tokens_per_second": tokens / elapsed if elapsed > 0 else None,
            "output_tokens_per_cpu_second": tokens / cpu if cpu > 0 else None}


def _median_ratio(runs: list[dict[str, Any]], base_runs: list[dict[str, Any]], key: str) -> float | None:
    ratios = [safe_ratio(r[key], b[key]) for r, b in zip(runs, base_runs)]
    return float(np.median(ratios)) if ratios and all(x is not None for x in ratios) else None


def method_result(name: str, work: str, measured: list[dict[str, dict[str, Any]]], k: int) -> dict[str, Any]:
    """One method's figures on one workload, over all rounds."""
    runs = [rd[work][name][0] for rd in measured]
    base_runs = [rd[work][NO_SPEC][0] for rd in measured]
    result = _totals(runs)
    counts = SpecCounts()
    for run in runs:
        counts = counts.plus(run["counts"])
    result.update(acceptance_summary(counts, k))
    ratios = [safe_ratio(r["output_tokens_per_second"], b["output_tokens_per_second"]) for r, b in zip(runs, base_runs)]
    diverged: list[int] = []
    for rd in measured:
        diverged += outputs_match(rd[work][NO_SPEC][1], rd[work][name][1])[1]
    cpu = [_totals([r]) for r in runs], [_totals([b]) for b in base_runs]
    result.update({"speedup_vs_no_spec": _median_ratio(runs, base_runs, "output_tokens_per_second"),
                   "speedup_per_round": ratios,
                   "speedup_cpu_time": _median_ratio(*cpu, "output_tokens_per_cpu_second"),
                   "speedup_aggregate": safe_ratio(result["output_tokens_per_second"],
                                                   _totals(base_runs)["output_tokens_per_second"]),
                   "outputs_equal_no_spec": not diverged, "num_mismatched_requests": len(diverged),
                   "first_mismatch_positions": diverged})
    return result


def assemble_result(args: argparse.Namespace, model_config: Any, methods: list[str],
                    rounds: list[dict[str, list[BenchRequest]]], measured: list[dict[str, dict[str, Any]]],
                    startup: dict[str, dict[str, Any]], threads: int) -> dict[str, Any]:
    """The result JSON from the measured rounds."""
    ks = {m: method_k(args, m) for m in methods}
    workloads = {}
    for work in WORKLOADS:
        requests = [r for rd in rounds for r in rd[work]]
        base = _totals([rd[work][NO_SPEC][0] for rd in measured])
        workloads[work] = {"requested": length_summary(requests), "no_spec": base,
                           "methods": {m: method_result(m, work, measured, ks[m]) for m in methods}}
    return {
        "benchmark": "spec_decode",
        "model": model_config.model,
        "dtype": dtype_name(model_config.torch_dtype),
        "num_speculative_tokens": args.num_speculative_tokens,  # None: each method's default (ks)
        "num_speculative_tokens_per_method": ks,
        "methods": methods,
        "config": {"num_prompts": args.num_prompts, "output_len": args.output_len, "temperature": 0.0,
                   "ignore_eos": bool(args.ignore_eos), "seed": args.seed, "num_threads": threads,
                   "rounds": len(rounds), "max_concurrency": getattr(args, "max_concurrency", None),
                   "speculative_configs": {m: speculative_config(args, m) for m in methods},
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "warmup_prompts": WARMUP_PROMPTS * len(WORKLOADS), "warmup_tokens": WARMUP_TOKENS},
        "workloads": workloads,
        "startup": startup,
        "env": collect_env(model_config.torch_dtype, threads),
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _equality(r: dict[str, Any]) -> str:
    if r["outputs_equal_no_spec"]:
        return "True"
    return f"False ({r['num_mismatched_requests']} differ, first at output tokens {r['first_mismatch_positions']})"


def _arbiter_share(r: dict[str, Any]) -> str:
    spec, plain = r.get("arbiter_speculative_steps") or 0, r.get("arbiter_plain_steps") or 0
    return f"  arbiter: {spec}/{spec + plain} steps speculative" if spec + plain else ""


def _positions_text(rates: list[float] | None) -> str:
    """Per-position rates up to the last non-zero one (long suffix drafts leave many zero tails in the JSON)."""
    if not rates:
        return "n/a"
    shown = max((i + 1 for i, x in enumerate(rates) if x), default=1)
    tail = f", 0 x {len(rates) - shown}" if shown < len(rates) else ""
    return "[" + ", ".join(_fmt(x, ".2f") for x in rates[:shown]) + tail + "]"


def format_summary(result: dict[str, Any]) -> str:
    """Human-readable summary of a spec-decode result."""
    cfg = result["config"]
    ks = result.get("num_speculative_tokens_per_method") or {}
    k_text = ",".join(f"{m}:{k}" for m, k in ks.items()) or result["num_speculative_tokens"]
    lines = [f"spec decode  model={result['model']}  dtype={result['dtype']}  k={k_text}  "
             f"threads={result['env']['num_threads']}  max concurrency={cfg.get('max_concurrency') or 'engine'}  "
             f"rounds={cfg.get('rounds', 1)}  greedy"]
    for name, work in result["workloads"].items():
        req, base = work["requested"], work["no_spec"]
        lines.append(f"  {name}: {req['num_requests']} prompts (mean input {_fmt(req['mean_input_len'], '.0f')} "
                     f"tokens)  no spec {_fmt(base['output_tokens_per_second'])} output tok/s "
                     f"({base['total_output_tokens']} tokens)")
        for method, r in work["methods"].items():
            pos = _positions_text(r["per_position_acceptance_rate"])
            lines.append(f"    {method:>14}: AL {_fmt(r['mean_acceptance_length'])}  acceptance "
                         f"{_fmt(r['acceptance_rate'], '.3f')}  per-pos {pos}  {_fmt(r['output_tokens_per_second'])} "
                         f"output tok/s  x{_fmt(r['speedup_vs_no_spec'])} vs no spec (CPU time "
                         f"x{_fmt(r.get('speedup_cpu_time'))})  outputs equal: "
                         f"{_equality(r)}{_arbiter_share(r)}")
    ceiling = result.get("speculation_ceiling")
    if ceiling:
        lines.append(format_ceiling(ceiling["method"], ceiling))
    if result["env"]["load_warning"]:
        lines.append(f"  WARNING: 1-minute load {result['env']['loadavg'][0]:.2f} exceeds half the cores; "
                     "timings are unreliable")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench spec``."""
    from ascent.benchmarks.cli import positive_int, add_engine_args

    add_engine_args(parser)
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")
    parser.add_argument("--methods", default="ngram,suffix,suffix+dynamic,draft_model",
                        help=f"comma-separated methods of {BENCH_METHODS}, each optionally '+dynamic'")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                        help=f"draft length k (default: the engine's for suffix, its tree depth; {DEFAULT_K} otherwise)")
    parser.add_argument("--prompt-lookup-min", type=positive_int, default=None, help="ngram minimum match length")
    parser.add_argument("--prompt-lookup-max", type=positive_int, default=None, help="ngram maximum match length")
    parser.add_argument("--draft-num-layers", type=positive_int, default=6,
                        help="draft_model: the target truncated to its first N layers")
    parser.add_argument("--dynamic-params", default=None,
                        help="JSON dynamic_params of the '+dynamic' methods (default: the engine's defaults)")
    parser.add_argument("--disable-by-batch-size", type=positive_int, default=None,
                        help="speculative_disable_by_batch_size of every method (no drafts with >= N running)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="most requests running at once (engine max_num_seqs; 1 = single stream)")
    parser.add_argument("--concurrency-sweep", default=None,
                        help="comma-separated concurrencies (e.g. 1,8,32): the whole benchmark once per value")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds of fresh prompts; engines interleave within each round (the speed-up is the "
                             "median of the per-round ratios: one round's ratio moves by several %% on a shared VM)")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="prompts per workload and round")
    parser.add_argument("--output-len", type=positive_int, default=96, help="max generated tokens per prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate exactly --output-len tokens")


def _run_spec_command(args: argparse.Namespace) -> dict[str, Any]:
    if args.concurrency_sweep:
        from ascent.benchmarks.spec_sweep import run_spec_sweep

        return run_spec_sweep(args)
    return run_spec(args)


def register_spec_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``spec`` to the ``bench`` sub-parsers (sets ``func``)."""
    spec = commands.add_parser("spec", help="speculative decoding (ngram, suffix, draft_model) vs no speculation",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_spec_args(spec)
    spec.set_defaults(func=_run_spec_command)
    return spec
