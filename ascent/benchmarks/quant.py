"""``ascent bench quant``: quantized checkpoints against the bf16 model in one process.

Every scheme is exported once (``ascent quantize``, RTN, cached in a temporary or ``--cache-dir`` directory whose
per-scheme folder names the format and whether ``--quantize-lm-head`` quantized the lm_head); then the
bf16 engine and one engine per scheme are built with the same settings and measured *interleaved* (each round visits
every variant, the order rotates between rounds, the best round is reported and all are kept, with each round's ratio
to the bf16 round beside it and their median; one untimed full-length warm-up generate per engine and batch size
comes first):

* decode tok/s at each ``--batch-sizes`` value: fixed random prompts of ``--input-len`` tokens, ``ignore_eos``,
  driven step by step through the engine; the steps up to every request's first token (the prefill) are timed
  apart, so decode = tokens after the first / time of the remaining steps; ``output`` = B * N / total time;
* perplexity on the local corpus (teacher-forced via ``prompt_logprobs``, ``benchmarks/ppl.py``).

Ratios are against bf16 measured in the same run (tok/s ratio, ppl increase in %). A scheme whose export, loading or
kernels fail is reported with its error; the run continues. The JSON also records the CPU flags that decide which
integer kernels are fast (AVX512-VNNI / AMX), torch's CPU capability, threads and the load average.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ascent.benchmarks.common import Timer, collect_env, pin_threads, safe_ratio, write_json
from ascent.benchmarks.datasets import BenchRequest, sample_requests
from ascent.platform import huge_pages

ALL_SCHEMES = ("w8a8_dynamic", "w8a8", "w8a16", "w4a16", "w4a8")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
             "amx_fp16")
GROUP_CANDIDATES = (128, 64, 32)
BASELINE = "bf16"


def cpu_features() -> dict[str, Any]:
    """The CPU flags relevant to int8 / bf16 kernels (from ``lscpu``, else /proc/cpuinfo) and torch's capability."""
    import torch

    text = ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    if "Flags" not in text and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    flags = set()
    for line in text.splitlines():
        if line.lower().startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return {"flags": [f for f in CPU_FLAGS if f in flags],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "huge_pages": huge_pages.process_state()}


def parse_list(text: str, kind: type = str) -> list[Any]:
    """``"a,b"`` -> ``[kind(a), kind(b)]`` (ValueError naming the text when empty)."""
    items = [kind(x.strip()) for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{text!r} is an empty list")
    return items


def pick_group_size(model: Any, requested: int | None, quantize_lm_head: bool = False) -> int:
    """``requested`` or the largest of 128 / 64 / 32 dividing the input size of every quantized linear."""
    from ascent.quantization.export.calibrate import quantized_linear_names

    if requested:
        return requested
    sizes = {model.get_submodule(n).in_features for n in quantized_linear_names(model, quantize_lm_head)}
    for group in GROUP_CANDIDATES:
        if all(k % group == 0 for k in sizes):
            return group
    raise ValueError(f"no group size in {GROUP_CANDIDATES} divides every input size {sorted(sizes)}; "
                     "pass --group-size")


def export_dir_name(scheme: str, fmt: str, quantize_lm_head: bool, group_size: int | None = None,
                    smoothquant: float | None = None, calib_tokens: int | None = None,
                    asymmetric: bool = False) -> str:
    """Cache folder of one export: exports with a different head mode, requested group size (None = picked per
    model), SmoothQuant setting (alpha and calibration tokens) or weight symmetry never share one."""
    name = f"{scheme}-{fmt}-lmhead_{'quant' if quantize_lm_head else 'float'}-g{group_size or 'auto'}"
    name += "-asym" if asymmetric else ""
    return name + (f"-sq{smoothquant:g}_c{calib_tokens}" if smoothquant is not None else "")


def export_schemes(args: argparse.Namespace, cache: Path) -> dict[str, dict[str, Any]]:
    """Export every scheme of ``--schemes`` into ``cache`` (reused when already there); per scheme the path, export
    seconds and checkpoint bytes, or the error."""
    from ascent.quantization.export import export_float_model
    from ascent.quantization.export.source import load_float_model

    results: dict[str, dict[str, Any]] = {}
    float_model = None
    head = bool(getattr(args, "quantize_lm_head", False))
    asymmetric = bool(getattr(args, "asymmetric", False))
    requested_group = args.group_size  # set below to the picked size when auto
    for scheme in args.schemes:
        out = cache / export_dir_name(scheme, args.format, head, requested_group, args.smoothquant, args.calib_tokens,
                                      asymmetric)
        record: dict[str, Any] = {"path": str(out), "error": None}
        try:
            if not (out / "config.json").is_file():
                if out.exists():  # an interrupted export in the bench's own cache
                    shutil.rmtree(out)
                if float_model is None:
                    float_model = load_float_model(args.model, "bfloat16")
                    args.group_size = pick_group_size(float_model.model, args.group_size, head)
                model = copy.deepcopy(float_model) if args.smoothquant is not None else float_model
                res = export_float_model(model, scheme, args.format, out, group_size=args.group_size or 128,
                                         smoothquant=args.smoothquant, calib_tokens=args.calib_tokens,
                                         quantize_lm_head=head, asymmetric=asymmetric)
                record["export_seconds"] = res.seconds
            record["checkpoint_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        except Exception as exc:  # noqa: BLE001 - one failing scheme must not stop the benchmark
            record["error"] = f"export: {type(exc).__name__}: {exc}"
        results[scheme] = record
    return results


def _engine_args(args: argparse.Namespace, model: str | None) -> argparse.Namespace:
    clone = argparse.Namespace(**vars(args))
    clone.model = model
    return clone


def measure_decode(llm: Any, requests: list[BenchRequest], num_tokens: int) -> dict[str, float]:
    """Greedy ``num_tokens`` per request (ignore_eos) driven step by step through ``llm.llm_engine``: the steps up
    to every request's first token are the prefill; the remaining steps time pure decode."""
    from ascent import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
    produced = {engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids}, params): 0 for r in requests}

    def step() -> None:
        for out in engine.step():
            if out.request_id in produced and out.outputs:
                produced[out.request_id] = len(out.outputs[0].token_ids)

    t0 = time.perf_counter()
    while min(produced.values()) < 1 and engine.has_unfinished_requests():
        step()
    t1 = time.perf_counter()
    first = sum(produced.values())
    while engine.has_unfinished_requests():
        step()
    t2 = time.perf_counter()
    total = sum(produced.values())
    if total != len(requests) * num_tokens:
        raise ValueError(f"decode produced {total} tokens, expected {len(requests) * num_tokens}")
    return {"decode_tokens_per_second": (total - first) / max(t2 - t1, 1e-9),
            "output_tokens_per_second": total / max(t2 - t0, 1e-9), "decode_time": t2 - t1, "prefill_time": t1 - t0}


def build_variants(args: argparse.Namespace, exports: dict[str, dict[str, Any]], max_model_len: int
                   ) -> dict[str, dict[str, Any]]:
    """The bf16 engine and one engine per exported scheme (``llm`` or ``error`` per variant)."""
    from ascent.benchmarks.throughput import build_llm

    variants: dict[str, dict[str, Any]] = {BASELINE: {"path": args.model, "error": None}}
    variants.update({s: dict(rec) for s, rec in exports.items()})
    for name, rec in variants.items():
        if rec.get("error"):
            continue
        try:
            with Timer() as timer:
                rec["llm"] = build_llm(_engine_args(args, rec["path"] if name != BASELINE else args.model),
                                       max_model_len, enable_prefix_caching=False)
            rec["load_seconds"] = timer.elapsed
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"load: {type(exc).__name__}: {exc}"
    return variants


def run_rounds(args: argparse.Namespace, variants: dict[str, dict[str, Any]], vocab: int) -> None:
    """Interleaved decode measurements: ``--rounds`` rounds, each visiting every live variant (rotated order)."""
    live = [n for n, r in variants.items() if not r.get("error")]
    requests = {b: sample_requests(b, (args.input_len, args.input_len), (args.decode_tokens, args.decode_tokens),
                                   vocab, args.seed + b) for b in args.batch_sizes}
    for name in live:  # warm-up (excluded): one full-length generate per engine and batch size
        for batch in args.batch_sizes:
            try:
                measure_decode(variants[name]["llm"], requests[batch], args.decode_tokens)
            except Exception as exc:  # noqa: BLE001
                variants[name]["error"] = f"generate: {type(exc).__name__}: {exc}"
    for r in range(args.rounds):
        order = [n for n in live if not variants[n].get("error")]
        order = order[r % len(order):] + order[:r % len(order)] if order else order
        for name in order:
            rec = variants[name]
            for batch in args.batch_sizes:
                try:
                    m = measure_decode(rec["llm"], requests[batch], args.decode_tokens)
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = f"generate: {type(exc).__name__}: {exc}"
                    break
                m["loadavg_1m"] = os.getloadavg()[0]
                rec.setdefault("rounds", {}).setdefault(str(batch), []).append(m)


def run_perplexity(args: argparse.Namespace, variants: dict[str, dict[str, Any]]) -> None:
    from ascent.benchmarks.ppl import corpus_windows, engine_perplexity

    if args.ppl_tokens == 0:
        return
    base = variants[BASELINE].get("llm")
    tokenizer = (base or next(r["llm"] for r in variants.values() if r.get("llm"))).get_tokenizer()
    windows = corpus_windows(tokenizer, args.ppl_tokens, args.ppl_window)
    for rec in variants.values():
        if rec.get("error") or "llm" not in rec:
            continue
        try:
            with Timer() as timer:
                rec["perplexity"] = engine_perplexity(rec["llm"], windows)
            rec["perplexity"]["seconds"] = timer.elapsed
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"perplexity: {type(exc).__name__}: {exc}"


def round_ratios(rounds: list[dict[str, Any]], base_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Round r of a variant over round r of bf16 (the two ran back to back within one interleaved round, so a slow
    phase of the machine hits both): every ratio and their median (None without a complete pair)."""
    ratios = [safe_ratio(r["decode_tokens_per_second"], b["decode_tokens_per_second"])
              for r, b in zip(rounds, base_rounds)]
    valid = sorted(x for x in ratios if x is not None)
    return {"rounds": ratios, "median": statistics.median(valid) if valid else None}


def summarize(args: argparse.Namespace, variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per variant: best decode tok/s per batch (all rounds kept), perplexity, ratios against bf16."""
    out: dict[str, Any] = {}
    for name, rec in variants.items():
        entry: dict[str, Any] = {k: v for k, v in rec.items() if k not in ("llm", "rounds")}
        entry["decode"] = {}
        for batch, rounds in rec.get("rounds", {}).items():
            best = max(rounds, key=lambda m: m["decode_tokens_per_second"] or 0.0)
            entry["decode"][batch] = {**best, "all_rounds": rounds}
        out[name] = entry
    base = out[BASELINE]
    base_ppl = (base.get("perplexity") or {}).get("perplexity")
    for name, entry in out.items():
        entry["tokens_per_second_ratio_vs_bf16"] = {
            b: safe_ratio(d["decode_tokens_per_second"],
                          base["decode"].get(b, {}).get("decode_tokens_per_second"))
            for b, d in entry["decode"].items()}
        entry["tokens_per_second_ratio_per_round"] = {
            b: round_ratios(d["all_rounds"], base["decode"].get(b, {}).get("all_rounds", []))
            for b, d in entry["decode"].items()}
        ppl = (entry.get("perplexity") or {}).get("perplexity")
        entry["ppl_increase_pct"] = (100.0 * (ppl / base_ppl - 1.0)) if ppl and base_ppl else None
    return out


def run_quant_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result dict (also written to ``--output-json`` and printed as a table)."""
    args.schemes = parse_list(args.schemes) if isinstance(args.schemes, str) else list(args.schemes)
    unknown = [s for s in args.schemes if s not in ALL_SCHEMES]
    if unknown:
        raise ValueError(f"schemes {unknown} are not among {ALL_SCHEMES}")
    args.batch_sizes = parse_list(args.batch_sizes, int) if isinstance(args.batch_sizes, str) else args.batch_sizes
    if args.decode_tokens < 2 or args.rounds < 1 or min(args.batch_sizes) < 1:
        raise ValueError("--decode-tokens must be >= 2, --rounds and every batch size >= 1")
    threads = pin_threads(args.num_threads)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batch_sizes)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ascent-bench-quant-") as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        exports = export_schemes(args, cache)
        max_model_len = max(args.input_len + args.decode_tokens, args.ppl_window + 1)
        variants = build_variants(args, exports, max_model_len)
        base_llm = variants[BASELINE].get("llm")
        if base_llm is None:
            raise ValueError(f"the bf16 baseline failed to load: {variants[BASELINE]['error']}")
        from ascent.benchmarks.throughput import prompt_vocab_size

        run_rounds(args, variants, prompt_vocab_size(base_llm))
        run_perplexity(args, variants)
        summary = summarize(args, variants)
    result = {
        "benchmark": "quant",
        "model": base_llm.llm_engine.config.model_config.model,
        "dtype": "bfloat16",
        "config": {"schemes": args.schemes, "format": args.format, "batch_sizes": args.batch_sizes,
                   "decode_tokens": args.decode_tokens, "input_len": args.input_len, "rounds": args.rounds,
                   "ppl_tokens": args.ppl_tokens, "ppl_window": args.ppl_window, "group_size": args.group_size,
                   "smoothquant": args.smoothquant, "calib_tokens": args.calib_tokens,
                   "quantize_lm_head": bool(getattr(args, "quantize_lm_head", False)),
                   "asymmetric": bool(getattr(args, "asymmetric", False)), "seed": args.seed,
                   "num_threads": threads, "max_num_seqs": args.max_num_seqs,
                   "kv_cache_memory_bytes": args.kv_cache_memory_bytes},
        "variants": summary,
        "cpu": cpu_features(),
        "total_seconds": time.perf_counter() - start,
        "env": collect_env("bfloat16", threads),
    }
    if args.output_json:
        write_json(args.output_json, result)
    print(format_table(result))
    return result


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """Markdown table: variant, decode tok/s and ratio per batch size, perplexity and its increase, errors."""
    batches = [str(b) for b in result["config"]["batch_sizes"]]
    head = ["variant"] + [f"tok/s B={b} (x bf16: best; per-round median)" for b in batches] + ["ppl", "ppl +%", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in result["variants"].items():
        cells = [name]
        for b in batches:
            d = entry["decode"].get(b, {})
            per_round = entry["tokens_per_second_ratio_per_round"].get(b, {}).get("median")
            cells.append(f"{_fmt(d.get('decode_tokens_per_second'), '.1f')} "
                         f"({_fmt(entry['tokens_per_second_ratio_vs_bf16'].get(b))}; {_fmt(per_round)})")
        ppl = (entry.get("perplexity") or {}).get("perplexity")
        cells += [_fmt(ppl, ".3f"), _fmt(entry.get("ppl_increase_pct"), "+.2f"), (entry.get("error") or "")[:120]]
        lines.append("| " + " | ".join(cells) + " |")
    env, cpu = result["env"], result["cpu"]
    lines.append(f"threads={env['num_threads']}  loadavg={[round(x, 2) for x in env['loadavg']]}  "
                 f"cpu flags={','.join(cpu['flags'])}  torch capability={cpu['torch_cpu_capability']}  "
                 f"huge pages={cpu['huge_pages']}")
    if env["load_warning"]:
        lines.append("WARNING: 1-minute load exceeds half the cores; timings are unreliable (ratios less so)")
    return "\n".join(lines)


def add_quant_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``ascent bench quant`` (engine flags shared with the other bench commands)."""
    from ascent.benchmarks.cli import add_engine_args, positive_int

    add_engine_args(parser)
    parser.set_defaults(dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
    parser.add_argument("--schemes", default=",".join(ALL_SCHEMES), help="comma-separated schemes to compare")
    parser.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "modelslim"),
                        help="checkpoint layout of the exports")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated decode batch sizes")
    parser.add_argument("--decode-tokens", type=positive_int, default=128,
                        help="new tokens per request (as vLLM's bench latency; with a few dozen a round lasts a "
                             "fraction of a second and a VM's memory-phase noise dominates the batch-1 figures)")
    parser.add_argument("--input-len", type=positive_int, default=16, help="prompt length (random token ids)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved measurement rounds")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="corpus tokens scored for perplexity (0 = skip)")
    parser.add_argument("--ppl-window", type=positive_int, default=512, help="tokens per perplexity window")
    parser.add_argument("--group-size", type=positive_int, default=None,
                        help="w4a16 group size (default: the largest of 128/64/32 dividing every K)")
    parser.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA", help="SmoothQuant alpha")
    parser.add_argument("--calib-tokens", type=positive_int, default=512, help="calibration tokens")
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="quantize lm_head with each scheme too (tied models are untied)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="weight-only schemes with --format modelslim: min-max RTN with float offsets")
    parser.add_argument("--cache-dir", default=None, help="keep / reuse the exports here (default: a temp dir)")
    parser.add_argument("--output-json", default=None, help="write the result JSON to this path")


def register_quant_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``bench quant`` to the bench sub-commands."""
    parser = commands.add_parser("quant", help="quantized schemes vs bf16: decode tok/s and perplexity",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_quant_bench_args(parser)
    parser.set_defaults(func=run_quant_bench)
    return parser
