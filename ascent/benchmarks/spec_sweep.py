"""``ascent bench spec --concurrency-sweep 1,8,32``: the spec-decode benchmark once per concurrency.

The spec-decode report asks for output throughput at concurrency 1, 8 and 32 (specs/specdec_sampling.md §5): where a
step is bandwidth-bound (few requests) verifying drafts is nearly free, where it is compute-bound (many requests on
few cores) every rejected draft costs. Each value runs the whole benchmark (:func:`ascent.benchmarks.spec.run_spec`,
engines rebuilt with ``max_num_seqs`` = that value, the same seeded prompts); the JSON keeps every run and a table
of speed-ups per concurrency, method and workload.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from ascent.benchmarks.common import write_json


def parse_concurrency_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (``ValueError`` naming the text for empty, non-integer or < 1 values)."""
    from ascent.benchmarks.quant import parse_list

    try:
        values = parse_list(text, int)
    except ValueError:
        raise ValueError(f"concurrency sweep {text!r} must be comma-separated integers >= 1") from None
    if any(v < 1 for v in values):
        raise ValueError(f"concurrency sweep {text!r} must list concurrencies of at least 1")
    return values


def speedup_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: its concurrency and, per ``workload/method``, the output-throughput speed-up over no
    speculation and the mean acceptance length."""
    rows = []
    for run in runs:
        row: dict[str, Any] = {"max_concurrency": run["config"]["max_concurrency"]}
        for work, data in run["workloads"].items():
            for method, r in data["methods"].items():
                row[f"{work}/{method}"] = {"speedup": r["speedup_vs_no_spec"],
                                           "mean_acceptance_length": r["mean_acceptance_length"]}
        rows.append(row)
    return rows


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`speedup_table` (speed-up x, acceptance length in parentheses)."""
    columns = [k for k in rows[0] if k != "max_concurrency"]
    lines = ["| concurrency | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for row in rows:
        cells = []
        for c in columns:
            speedup, length = row[c]["speedup"], row[c]["mean_acceptance_length"]
            cells.append("n/a" if speedup is None else f"x{speedup:.2f} (AL {length:.2f})")
        lines.append(f"| {row['max_concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_spec_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Run :func:`run_spec` at every ``args.concurrency_sweep`` value (each prints its own summary); returns and
    writes (``--output-json``) ``{"benchmark", "concurrencies", "runs", "speedups"}``."""
    from ascent.benchmarks.spec import run_spec

    concurrencies = parse_concurrency_list(args.concurrency_sweep)
    runs = []
    for value in concurrencies:
        one = copy.copy(args)
        one.max_concurrency, one.output_json, one.concurrency_sweep = value, None, None
        runs.append(run_spec(one))
    rows = speedup_table(runs)
    result = {"benchmark": "spec_decode_sweep", "concurrencies": concurrencies, "runs": runs, "speedups": rows}
    if args.output_json:
        write_json(args.output_json, result)
    print("speed-up over no speculation by concurrency (output tok/s, same run):")
    print(format_sweep(rows))
    return result
