"""``ascent bench spec``: speculative decoding (model-free proposers) against no speculation, same process.

Two locally generated chat workloads (no downloads), tokenized with the model's own tokenizer and chat template:

- ``repetitive``: code-edit style prompts (a code snippet or JSON record to return with a small edit), structured
  answers re-asked in a follow-up turn and "repeat this paragraph" requests; greedy decoding tends to copy the input,
  which is where prompt-lookup (n-gram) and suffix drafting find matches;
- ``non_repetitive``: varied natural-language questions.

One engine per configuration (no speculation first, then each method) with identical engine settings; each engine gets
a warmup generate on separate prompts, then one timed greedy ``generate`` per workload (repetitive first, so the suffix
global tree has seen the warmup and repetitive responses when the second workload runs, as in a serving process).
Per method and workload: mean acceptance length (1 + accepted / drafts), acceptance rate (accepted / draft tokens),
per-position acceptance rates (accepted at position i / drafts; non-increasing since acceptance is a prefix), output
tok/s and its ratio to no speculation, and whether the greedy outputs equal the outputs without speculation.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from typing import Any

import numpy as np

from ascent.benchmarks.common import Timer, collect_env, dtype_name, pin_threads, safe_ratio, write_json
from ascent.benchmarks.datasets import BenchRequest, length_summary

WORKLOADS = ("repetitive", "non_repetitive")
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 8
NO_SPEC = "none"

_NAMES = ("values", "items", "records", "scores", "prices", "events", "rows", "weights", "samples", "orders")
_VARS = ("total", "count", "result", "acc", "best", "limit", "offset", "factor", "step", "window")
_FUNCS = ("summarize", "filter_rows", "normalize", "accumulate", "rank_items", "merge_counts", "clip_values",
          "moving_sum", "bucketize", "score_events")
_KEYS = ("name", "version", "timeout", "retries", "region", "owner", "max_batch", "log_level", "cache_size", "enabled")
_TASKS = ("deploying a web service", "reviewing a pull request", "preparing a release", "onboarding a new engineer",
          "migrating a database", "debugging a memory leak", "writing a design document", "running a load test")
_STEPS = ("Read the current documentation", "List the open questions", "Write down the expected result",
          "Run the automated tests", "Check the logs for errors", "Ask a colleague for a review",
          "Update the change log", "Measure the baseline first", "Back up the existing data",
          "Announce the change to the team", "Verify the rollback plan", "Close the related tickets")
_SENTENCES = ("The river runs past the old mill and into the valley.", "Every morning the baker lights the oven.",
              "A small bell rings when the door opens.", "The library keeps its oldest maps in a locked room.",
              "Children play football in the square after school.", "The train to the coast leaves at noon.",
              "Snow covers the hills for most of the winter.", "The market sells fresh fruit on Saturdays.")
_QUESTIONS = ("Why is the sky blue", "How do vaccines train the immune system", "What causes ocean tides",
              "How does a bicycle stay upright", "Why do leaves change colour in autumn",
              "What is the difference between weather and climate", "How do bees make honey",
              "Why does bread rise", "How does a compass work", "What makes a good night's sleep",
              "How do airplanes fly", "Why do cats purr", "How is glass made", "What is inflation",
              "How do solar panels produce electricity", "Why do we have leap years", "How do volcanoes form",
              "What does a city planner do", "How does the heart pump blood", "Why is the ocean salty")
_STYLES = ("Answer in two sentences.", "Explain it to a ten-year-old.", "Give one concrete example.",
           "Answer briefly.", "Mention one common misconception.", "Use a short analogy.")


@dataclass(frozen=True)
class SpecCounts:
    """Cumulative draft verification counts (a copy of the scheduler's ``spec_stats_total``)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def minus(self, before: "SpecCounts") -> "SpecCounts":
        """Counts accumulated since ``before``."""
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now = list(self.accepted_per_pos) + [0] * (width - len(self.accepted_per_pos))
        old = list(before.accepted_per_pos) + [0] * (width - len(before.accepted_per_pos))
        return SpecCounts(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                          self.num_accepted_tokens - before.num_accepted_tokens,
                          tuple(a - b for a, b in zip(now, old)))


# ------------------------------------------------------------------------------------------------ workloads
def _code_snippet(rng: np.random.Generator) -> tuple[str, str]:
    """A small Python function built from templates; returns (code, name of a local variable to rename)."""
    fn, seq = str(rng.choice(_FUNCS)), str(rng.choice(_NAMES))
    acc, lim = (str(v) for v in rng.choice(_VARS, size=2, replace=False))
    factor = int(rng.integers(2, 9))
    code = (f"def {fn}({seq}, {lim}):\n"
            f"    {acc} = 0\n"
            f"    for item in {seq}:\n"
            f"        if item > {lim}:\n"
            f"            {acc} += item * {factor}\n"
            f"        else:\n"
            f"            {acc} -= item\n"
            f"    return {acc}\n")
    return code, acc


def _code_edit(rng: np.random.Generator) -> list[dict[str, str]]:
    code, var = _code_snippet(rng)
    new = f"{var}_{rng.choice(('sum', 'value', 'out', 'tmp'))}"
    return [{"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\nRename the variable "
                                        f"`{var}` to `{new}` and return the complete updated function in one code "
                                        f"block, without any explanation."}]


def _json_edit(rng: np.random.Generator) -> list[dict[str, str]]:
    keys = [str(k) for k in rng.choice(_KEYS, size=6, replace=False)]
    record = ",\n".join(f'  "{k}": {int(rng.integers(1, 500))}' for k in keys)
    key, value = keys[int(rng.integers(0, len(keys)))], int(rng.integers(500, 999))
    return [{"role": "user", "content": f"Here is a configuration file:\n```json\n{{\n{record}\n}}\n```\nSet "
                                        f'"{key}" to {value} and output the complete file again.'}]


def _reask(rng: np.random.Generator) -> list[dict[str, str]]:
    task = str(rng.choice(_TASKS))
    steps = [str(s) for s in rng.choice(_STEPS, size=5, replace=False)]
    answer = "\n".join(f"{i + 1}. {s}." for i, s in enumerate(steps))
    return [{"role": "user", "content": f"Give me a short checklist for {task}."},
            {"role": "assistant", "content": f"Checklist for {task}:\n{answer}"},
            {"role": "user", "content": "Write the checklist above again, exactly as it is, and add a sixth step "
                                        "at the end."}]


def _repeat_text(rng: np.random.Generator) -> list[dict[str, str]]:
    paragraph = " ".join(str(s) for s in rng.choice(_SENTENCES, size=4, replace=False))
    return [{"role": "user", "content": f"Repeat the following paragraph word for word:\n\n{paragraph}"}]


def repetitive_conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    """``num`` code-edit / re-ask / repeat conversations (the four kinds in turn), seeded."""
    rng = np.random.default_rng(seed)
    kinds = (_code_edit, _json_edit, _reask, _repeat_text)
    return [kinds[i % len(kinds)](rng) for i in range(num)]


def non_repetitive_conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    """``num`` varied natural-language questions (distinct up to 120 prompts), seeded."""
    rng = np.random.default_rng(seed)
    pairs = [(q, s) for s in _STYLES for q in _QUESTIONS]
    order = rng.permutation(len(pairs))
    return [[{"role": "user", "content": f"{pairs[order[i % len(pairs)]][0]}? "
                                         f"{pairs[order[i % len(pairs)]][1]}"}] for i in range(num)]


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (plain ``role: text`` lines without)."""
    if getattr(tokenizer, "chat_template", None):
        from ascent.tokenizer import apply_chat_template

        text = apply_chat_template(tokenizer, messages, add_generation_prompt=True)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_workloads(tokenizer: Any, num_prompts: int, output_len: int, seed: int,
                    ) -> dict[str, list[BenchRequest]]:
    """The two workloads as token-id requests, each of ``num_prompts`` prompts and ``output_len`` max tokens."""
    makers = {"repetitive": repetitive_conversations, "non_repetitive": non_repetitive_conversations}
    return {name: [BenchRequest(encode_conversation(tokenizer, conv), output_len)
                   for conv in makers[name](num_prompts, seed)] for name in WORKLOADS}


# ------------------------------------------------------------------------------------------------ measurement
def spec_counts(llm: Any) -> SpecCounts:
    """A copy of the engine scheduler's cumulative speculation counts (zeros without speculation)."""
    total = getattr(llm.llm_engine.engine_core.scheduler, "spec_stats_total", None)
    if total is None:
        return SpecCounts()
    return SpecCounts(int(total.num_drafts), int(total.num_draft_tokens), int(total.num_accepted_tokens),
                      tuple(int(x) for x in total.accepted_per_pos))


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
    with Timer() as timer:
        outputs = greedy_generate(llm, requests, ignore_eos)
    produced = sum(len(o) for o in outputs)
    return {"elapsed_time": timer.elapsed, "total_output_tokens": produced,
            "output_tokens_per_second": produced / timer.elapsed if timer.elapsed > 0 else None,
            "counts": spec_counts(llm).minus(before)}, outputs


def speculative_config(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The ``speculative_config`` dict of ``method`` from the bench flags."""
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if method == "ngram":
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(args, name, None) is not None:
                config[name] = getattr(args, name)
    return config


def measure_engine(args: argparse.Namespace, max_model_len: int, workloads: dict[str, list[BenchRequest]],
                   warmup: list[BenchRequest], spec: dict[str, Any] | None) -> dict[str, Any]:
    """Build one engine, warm it up, time every workload; the engine is released before returning."""
    from ascent.benchmarks.throughput import build_llm

    llm = build_llm(args, max_model_len, speculative_config=spec)
    try:
        greedy_generate(llm, warmup, ignore_eos=True)
        runs = {name: timed_run(llm, reqs, args.ignore_eos) for name, reqs in workloads.items()}
        startup = dict(getattr(llm.llm_engine, "timings", {}) or {})
    finally:
        del llm
        gc.collect()
    return {"runs": runs, "startup": startup}


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


def method_result(run: dict[str, Any], outputs: list[list[int]], baseline: dict[str, Any],
                  reference: list[list[int]], k: int) -> dict[str, Any]:
    """One method's figures on one workload."""
    equal, diverged = outputs_match(reference, outputs)
    result = {key: run[key] for key in ("elapsed_time", "total_output_tokens", "output_tokens_per_second")}
    result.update(acceptance_summary(run["counts"], k))
    result.update({"speedup_vs_no_spec": safe_ratio(run["output_tokens_per_second"],
                                                    baseline["output_tokens_per_second"]),
                   "outputs_equal_no_spec": equal, "num_mismatched_requests": len(diverged),
                   "first_mismatch_positions": diverged})
    return result


# ------------------------------------------------------------------------------------------------ driver
def parse_methods(text: str) -> list[str]:
    """``"ngram,suffix"`` -> ``["ngram", "suffix"]``; only model-free methods, no duplicates."""
    from ascent.spec_decode.base import MODEL_FREE_METHODS

    methods = [m.strip() for m in str(text).split(",") if m.strip()]
    if not methods:
        raise ValueError(f"methods={text!r} names no method")
    for m in methods:
        if m not in MODEL_FREE_METHODS:
            raise ValueError(f"method {m!r} is not supported here; choose from {MODEL_FREE_METHODS}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods={text!r} repeats a method")
    return methods


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "output_len", "num_speculative_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)!r} must be at least 1")


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


def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    """Run the spec-decode benchmark; returns the result dict (also ``--output-json`` and a stdout summary)."""
    _validate(args)
    methods = parse_methods(args.methods)
    threads = pin_threads(args.num_threads)
    model_config = _model_config(args)
    tokenizer = _load_tokenizer(model_config)
    workloads = build_workloads(tokenizer, args.num_prompts, args.output_len, args.seed)
    warmup_sets = build_workloads(tokenizer, WARMUP_PROMPTS, WARMUP_TOKENS, args.seed + 1)
    warmup = [r for name in WORKLOADS for r in warmup_sets[name]]
    longest = max(r.input_len for reqs in (*workloads.values(), warmup) for r in reqs)
    max_model_len = longest + args.output_len + args.num_speculative_tokens + 1
    base = measure_engine(args, max_model_len, workloads, warmup, None)
    per_method = {m: measure_engine(args, max_model_len, workloads, warmup, speculative_config(args, m))
                  for m in methods}
    result = assemble_result(args, model_config, methods, workloads, base, per_method, threads)
    if args.output_json:
        write_json(args.output_json, result)
    print(format_summary(result))
    return result


def _workload_result(name: str, requests: list[BenchRequest], base: dict[str, Any],
                     per_method: dict[str, dict[str, Any]], k: int) -> dict[str, Any]:
    base_run, reference = base["runs"][name]
    baseline = {key: base_run[key] for key in ("elapsed_time", "total_output_tokens", "output_tokens_per_second")}
    methods = {m: method_result(*engine["runs"][name], baseline, reference, k) for m, engine in per_method.items()}
    return {"requested": length_summary(requests), "no_spec": baseline, "methods": methods}


def assemble_result(args: argparse.Namespace, model_config: Any, methods: list[str],
                    workloads: dict[str, list[BenchRequest]], base: dict[str, Any],
                    per_method: dict[str, dict[str, Any]], threads: int) -> dict[str, Any]:
    """The result JSON from the measured engines."""
    k = args.num_speculative_tokens
    return {
        "benchmark": "spec_decode",
        "model": model_config.model,
        "dtype": dtype_name(model_config.torch_dtype),
        "num_speculative_tokens": k,
        "methods": methods,
        "config": {"num_prompts": args.num_prompts, "output_len": args.output_len, "temperature": 0.0,
                   "ignore_eos": bool(args.ignore_eos), "seed": args.seed, "num_threads": threads,
                   "speculative_configs": {m: speculative_config(args, m) for m in methods},
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "warmup_prompts": WARMUP_PROMPTS * len(WORKLOADS), "warmup_tokens": WARMUP_TOKENS},
        "workloads": {name: _workload_result(name, reqs, base, per_method, k) for name, reqs in workloads.items()},
        "startup": {NO_SPEC: base["startup"], **{m: e["startup"] for m, e in per_method.items()}},
        "env": collect_env(model_config.torch_dtype, threads),
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _equality(r: dict[str, Any]) -> str:
    if r["outputs_equal_no_spec"]:
        return "True"
    return f"False ({r['num_mismatched_requests']} differ, first at output tokens {r['first_mismatch_positions']})"


def format_summary(result: dict[str, Any]) -> str:
    """Human-readable summary of a spec-decode result."""
    lines = [f"spec decode  model={result['model']}  dtype={result['dtype']}  k={result['num_speculative_tokens']}  "
             f"threads={result['env']['num_threads']}  greedy"]
    for name, work in result["workloads"].items():
        req, base = work["requested"], work["no_spec"]
        lines.append(f"  {name}: {req['num_requests']} prompts (mean input {_fmt(req['mean_input_len'], '.0f')} "
                     f"tokens)  no spec {_fmt(base['output_tokens_per_second'])} output tok/s "
                     f"({base['total_output_tokens']} tokens)")
        for method, r in work["methods"].items():
            rates = r["per_position_acceptance_rate"]
            pos = "[" + ", ".join(_fmt(x, ".2f") for x in rates) + "]" if rates else "n/a"
            lines.append(f"    {method:>6}: AL {_fmt(r['mean_acceptance_length'])}  acceptance "
                         f"{_fmt(r['acceptance_rate'], '.3f')}  per-pos {pos}  {_fmt(r['output_tokens_per_second'])} "
                         f"output tok/s  x{_fmt(r['speedup_vs_no_spec'])} vs no spec  outputs equal: "
                         f"{_equality(r)}")
    if result["env"]["load_warning"]:
        lines.append(f"  WARNING: 1-minute load {result['env']['loadavg'][0]:.2f} exceeds half the cores; "
                     "timings are unreliable")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench spec``."""
    from ascent.benchmarks.cli import _add_engine_args, positive_int

    _add_engine_args(parser)
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")
    parser.add_argument("--methods", default="ngram,suffix", help="comma-separated model-free methods")
    parser.add_argument("--num-speculative-tokens", type=positive_int, default=3, help="draft length k")
    parser.add_argument("--prompt-lookup-min", type=positive_int, default=None, help="ngram minimum match length")
    parser.add_argument("--prompt-lookup-max", type=positive_int, default=None, help="ngram maximum match length")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="prompts per workload")
    parser.add_argument("--output-len", type=positive_int, default=96, help="max generated tokens per prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate exactly --output-len tokens")


def _run_spec_command(args: argparse.Namespace) -> dict[str, Any]:
    return run_spec(args)


def register_spec_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``spec`` to the ``bench`` sub-parsers (sets ``func``)."""
    spec = commands.add_parser("spec", help="speculative decoding (ngram, suffix) vs no speculation",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_spec_args(spec)
    spec.set_defaults(func=_run_spec_command)
    return spec
