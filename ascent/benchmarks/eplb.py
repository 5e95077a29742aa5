"""``ascent bench eplb``: EPLB policies on seeded synthetic traces, and on the ``recorded`` trace of our own MoE model
(``ascent.benchmarks.eplb_recorded``), vs a DeepSeek-algorithm baseline (specs §4).

Per trace and policy: the policy is fitted on window k (starting from the trace's placement and keeping its own
placement and state across windows) and evaluated per step on window k + 1. Reported: mean imbalance (max/mean rank
load, mean over layers) on the fitted window, mean per-step imbalance on the next window, slots/bytes moved, max per-rank
receive bytes and the policy wall time per rebalance. The baseline is DeepSeek's global algorithm (replicate by
argmax w/count, pack heaviest-first onto the lightest non-full rank, duplicates allowed, no slot preservation).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from ascent.benchmarks.common import collect_env, write_json
from ascent.benchmarks.eplb_recorded import RecordedSpec
from ascent.benchmarks.eplb_traces import TRACE_NAMES, Shape, Trace, make_trace
from ascent.benchmarks.png import heatmap_panels, write_png
from ascent.eplb.placement import DEEPSEEK_V3_EXPERT_BYTES, imbalance, per_step_imbalance, rank_loads, \
    received_slots
from ascent.eplb.policy import PolicyFactory

DEFAULT_TRACES = ("zipf_0.8", "zipf_1.0", "zipf_1.2", "dirichlet_0.3", "drift_random_walk", "drift_regime_switch",
                  "drift_rotation", "layer_correlated", "policy_ut", "recorded")
DEFAULT_POLICIES = ("default", "swift", "flashlb")


def deepseek_global(weight: np.ndarray, num_ranks: int, slots: int) -> np.ndarray:
    """DeepSeek EPLB, global branch: float [L, E] -> int64 [L, R, S] logical ids."""
    layers, num_experts = weight.shape
    out = np.empty((layers, num_ranks, slots), dtype=np.int64)
    for layer in range(layers):
        counts = np.ones(num_experts)
        for _ in range(num_ranks * slots - num_experts):
            counts[int(np.argmax(weight[layer] / counts))] += 1
        experts = np.repeat(np.arange(num_experts), counts.astype(np.int64))
        unit = weight[layer][experts] / counts[experts]
        loads, fill = np.zeros(num_ranks), np.zeros(num_ranks, dtype=np.int64)
        for idx in np.argsort(-unit, kind="stable"):
            rank = int(np.argmin(np.where(fill < slots, loads, np.inf)))
            out[layer, rank, fill[rank]] = experts[idx]
            fill[rank] += 1
            loads[rank] += unit[idx]
    return out


class DeepSeekBaseline:
    """Adapter giving the baseline the policy interface (always re-plans every layer)."""

    name = "deepseek"

    def rebalance_experts(self, placement: np.ndarray, load: np.ndarray) -> tuple[bool, np.ndarray, np.ndarray]:
        weight = load.sum(axis=0) if load.ndim == 3 else load
        new = deepseek_global(weight, placement.shape[1], placement.shape[2])
        return True, np.arange(placement.shape[0]), new


def evaluate(policy: Any, trace: Trace, bytes_per_expert: int) -> dict[str, Any]:
    """Chain rebalances over the trace's windows; returns metrics and the first before/after rank loads."""
    placement, w = trace.placement.copy(), trace.window
    fit_is_eval = trace.meta.get("fit_is_eval", False)
    n_fits = 1 if fit_is_eval else trace.load.shape[0] // w - 1
    fitted, before_fit, nxt, nxt_before, times, recv = [], [], [], [], [], []
    heat = None
    for k in range(n_fits):
        fit = trace.load[k * w:(k + 1) * w]
        evl = fit if fit_is_eval else trace.load[(k + 1) * w:(k + 2) * w]
        t0 = time.perf_counter()
        _, _, new = policy.rebalance_experts(placement, fit)
        times.append(time.perf_counter() - t0)
        weight = fit.sum(axis=0)
        before_fit.append(imbalance(placement, weight).mean())
        fitted.append(imbalance(new, weight).mean())
        nxt_before.append(per_step_imbalance(placement, evl).mean())
        nxt.append(per_step_imbalance(new, evl).mean())
        recv.append(received_slots(placement, new))
        if heat is None:
            heat = (rank_loads(placement, weight), rank_loads(new, weight))
        placement = new
    recv_all = np.stack(recv)
    return {
        "rebalances": n_fits,
        "imbalance_fitted_before": float(np.mean(before_fit)),
        "imbalance_fitted": float(np.mean(fitted)),
        "imbalance_fitted_max_layer": float(max(fitted)),
        "imbalance_next_window_before": float(np.mean(nxt_before)),
        "imbalance_next_window": float(np.mean(nxt)),
        "slots_moved": int(recv_all.sum()),
        "slots_moved_fraction": float(recv_all.sum() / (n_fits * placement.size)),
        "bytes_moved": int(recv_all.sum()) * bytes_per_expert,
        "max_rank_receive_bytes": int(recv_all.max(initial=0)) * bytes_per_expert,
        "compute_ms_mean": 1e3 * float(np.mean(times)),
        "compute_ms_max": 1e3 * float(np.max(times)),
        "_heat": heat,
    }


def _compare(row: dict[str, Any], base: dict[str, Any]) -> None:
    row["next_window_vs_deepseek"] = row["imbalance_next_window"] / base["imbalance_next_window"]
    row["moves_vs_deepseek"] = row["slots_moved"] / max(base["slots_moved"], 1)


def write_heatmap(path: str, before: np.ndarray, after: np.ndarray) -> str:
    """Per-rank load [layers, ranks] before | after, normalised by each layer's mean (blue 0.5 .. red 1.5)."""
    norm = [x / np.maximum(x.mean(axis=1, keepdims=True), 1e-12) for x in (before, after)]
    return str(write_png(path, heatmap_panels(norm, 0.5, 1.5)))


def run_eplb(args: argparse.Namespace) -> dict[str, Any]:
    shape = Shape(args.layers, args.experts, args.ranks, args.slots, args.window, args.windows, args.tokens_per_step)
    recorded = RecordedSpec(layers=args.recorded_layers, experts=args.recorded_experts, top_k=args.recorded_top_k,
                            ranks=args.recorded_ranks, prompts=args.recorded_prompts,
                            max_tokens=args.recorded_max_tokens)
    results: dict[str, Any] = {}
    heat_done = None
    for name in args.traces:
        trace = make_trace(name, shape, args.seed, recorded=recorded)
        base = evaluate(DeepSeekBaseline(), trace, args.bytes_per_expert)
        rows = {"deepseek": base}
        for policy_name in args.policies:
            row = evaluate(PolicyFactory.generate_policy(policy_name), trace, args.bytes_per_expert)
            _compare(row, base)
            rows[policy_name] = row
            if heat_done is None and args.heatmap and policy_name == args.heatmap_policy:
                heat_done = write_heatmap(args.heatmap, *row["_heat"])
        for row in rows.values():
            row.pop("_heat")
        results[name] = rows
        if name == "recorded":
            results[name]["_trace"] = {"steps": int(trace.load.shape[0]), "window": trace.window,
                                       "layers": int(trace.load.shape[1]), "experts": int(trace.load.shape[2]),
                                       **{k: v for k, v in trace.meta.items() if k != "tokens"},
                                       "tokens_per_step": trace.meta["tokens"]}
        _print_trace(name, rows)
    out = {"shape": vars(shape), "seed": args.seed, "bytes_per_expert": args.bytes_per_expert,
           "traces": results, "heatmap": heat_done, "env": collect_env("float64", None)}
    if args.output_json:
        write_json(args.output_json, out)
    return out


def _print_trace(name: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"[{name}]")
    for policy, r in rows.items():
        if policy.startswith("_"):
            continue
        print(f"  {policy:9s} fit {r['imbalance_fitted_before']:.3f}->{r['imbalance_fitted']:.3f}  next "
              f"{r['imbalance_next_window_before']:.3f}->{r['imbalance_next_window']:.3f}  moved {r['slots_moved']:6d} "
              f"({r['slots_moved_fraction']:.1%})  {r['compute_ms_mean']:.0f} ms", flush=True)


def _run_command(args: argparse.Namespace) -> dict[str, Any]:
    return run_eplb(args)


def _names(choices: Any) -> Any:
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: unknown {bad}; choose from {sorted(choices)}")
        return names
    return parse


def add_eplb_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=_names(TRACE_NAMES), default=list(DEFAULT_TRACES),
                        help="comma-separated trace names ('recorded': loads of a synthetic-weight Qwen3-MoE served "
                             "by ascent, sized by the --recorded-* flags)")
    parser.add_argument("--policies", type=_names(("random", "default", "swift", "flashlb")),
                        default=list(DEFAULT_POLICIES), help="comma-separated policies")
    for flag, default, text in (("--layers", 58, "MoE layers"), ("--experts", 256, "logical experts"),
                                ("--ranks", 32, "EP ranks"), ("--slots", 9, "slots per rank"),
                                ("--window", 50, "steps per rebalance window"),
                                ("--windows", 4, "windows per trace (drifting: chained rebalances)"),
                                ("--tokens-per-step", 65536, "routed (token, expert) pairs per step and layer")):
        parser.add_argument(flag, type=int, default=default, help=text)
    for flag, default, text in (("--recorded-layers", 8, "recorded trace: MoE layers"),
                                ("--recorded-experts", 64, "recorded trace: experts"),
                                ("--recorded-top-k", 8, "recorded trace: experts per token"),
                                ("--recorded-ranks", 8, "recorded trace: EP ranks (slots = experts/ranks + 1)"),
                                ("--recorded-prompts", 32, "recorded trace: seeded random prompts"),
                                ("--recorded-max-tokens", 24, "recorded trace: tokens generated per prompt")):
        parser.add_argument(flag, type=int, default=default, help=text)
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--bytes-per-expert", type=int, default=DEEPSEEK_V3_EXPERT_BYTES,
                        help="bytes of one expert's weights (default DeepSeek-V3 bf16)")
    parser.add_argument("--output-json", default=None, help="write the result JSON here")
    parser.add_argument("--heatmap", default=None, help="write a PNG heatmap of per-rank load before/after here")
    parser.add_argument("--heatmap-policy", default="swift", help="policy whose first rebalance is drawn")


def register_eplb_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``eplb`` to the ``bench`` sub-parsers (sets ``func``)."""
    parser = commands.add_parser("eplb", help="EPLB policies on synthetic expert-load traces",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_eplb_args(parser)
    parser.set_defaults(func=_run_command)
    return parser
