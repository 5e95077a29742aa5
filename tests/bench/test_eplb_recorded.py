"""The ``recorded`` trace of ``ascent bench eplb``: expert loads of a synthetic-weight Qwen3-MoE served by ascent."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from ascent.benchmarks.eplb import register_eplb_bench_parser
from ascent.benchmarks.eplb_recorded import RecordedSpec
from ascent.benchmarks.eplb_traces import Shape, make_trace
from ascent.eplb.placement import replica_counts

SPEC = RecordedSpec(layers=2, experts=16, top_k=4, ranks=4, prompts=10, max_tokens=6, max_num_seqs=4)


@pytest.fixture(scope="module")
def trace():
    return make_trace("recorded", Shape(windows=2), seed=3, recorded=SPEC)


def test_recorded_trace_shape_and_routed_token_sums(trace) -> None:
    steps = trace.load.shape[0]
    assert trace.load.shape == (steps, SPEC.layers, SPEC.experts) and steps == 2 * trace.window
    assert steps >= SPEC.prompts * SPEC.max_tokens // SPEC.max_num_seqs
    tokens = np.asarray(trace.meta["tokens"][:steps])
    assert (tokens > 0).all() and tokens.max() > SPEC.max_num_seqs  # prefill steps and decode steps
    # every scheduled token is routed to top_k experts in every layer
    assert np.array_equal(trace.load.sum(axis=2), np.repeat(tokens[:, None] * SPEC.top_k, SPEC.layers, axis=1))
    total = trace.load.sum(axis=0)
    assert (total > 0).sum(axis=1).min() > SPEC.top_k  # routing spreads over many experts ...
    assert (total.max(axis=1) > 1.2 * total.mean(axis=1)).all()  # ... but not uniformly
    assert trace.placement.shape == (SPEC.layers, SPEC.ranks, SPEC.slots)
    assert (replica_counts(trace.placement, SPEC.experts) >= 1).all()


def test_recorded_trace_is_seeded(trace) -> None:
    again = make_trace("recorded", Shape(windows=2), seed=3, recorded=SPEC)
    assert np.array_equal(again.load, trace.load)


def test_bench_runs_the_policies_on_the_recorded_trace(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    register_eplb_bench_parser(parser.add_subparsers())
    out = tmp_path / "eplb.json"
    args = parser.parse_args(["eplb", "--traces", "recorded", "--windows", "2", "--recorded-layers", "2",
                              "--recorded-experts", "16", "--recorded-top-k", "4", "--recorded-ranks", "4",
                              "--recorded-prompts", "6", "--recorded-max-tokens", "4", "--output-json", str(out)])
    args.func(args)
    rows = json.loads(out.read_text())["traces"]["recorded"]
    assert rows["_trace"]["experts"] == 16 and rows["_trace"]["layers"] == 2
    for name in ("deepseek", "default", "swift", "flashlb"):
        assert rows[name]["rebalances"] == 1 and rows[name]["imbalance_fitted"] >= 1.0
