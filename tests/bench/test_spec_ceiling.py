"""The speculation ceiling ``ascent bench spec`` reports: the bound a fitted step cost ``a + b · tokens`` puts on what
drafts can gain at a batch size (memory-bound batch 1: high; compute-bound batch with ``a = 0``: none)."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest

from ascent.benchmarks.spec import format_summary
from ascent.benchmarks.spec_ceiling import (bench_batch_size, first_ceiling, format_ceiling, runner_spec,
                                            speculation_ceiling)
from ascent.spec_decode.step_cost import BatchStepCost


def _engine(step_cost: BatchStepCost | None) -> SimpleNamespace:
    spec = None if step_cost is None else SimpleNamespace(step_cost=step_cost, arbiter=None)
    worker = SimpleNamespace(model_runner=SimpleNamespace(spec=spec))
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(worker=worker)))


def _fitted(num_reqs: int, a: float, b: float, steps: int = 200) -> BatchStepCost:
    """A step-cost model of ``num_reqs`` requests fed exact affine steps (1 to 16 drafts in all, half verifying)."""
    cost = BatchStepCost()
    model = cost.for_batch(num_reqs)
    for i in range(steps):
        drafts = (i * 7) % 17
        model.observe(num_reqs + drafts, a + b * (num_reqs + drafts), verify=drafts > 0)
    return cost


def test_memory_bound_batch_has_a_high_ceiling() -> None:
    """a = 10 ms, b = 2 ms at batch 1: a plain step is 12 ms per token, a verified token costs 2 ms -> x6 at most,
    and a draft pays above acceptance 1/6."""
    c = speculation_ceiling(_engine(_fitted(1, 0.010, 0.002)), 1)
    assert c is not None and c["batch_size"] == 1
    assert c["per_step_ms"] == pytest.approx(10.0, rel=0.02) and c["per_token_ms"] == pytest.approx(2.0, rel=0.02)
    assert c["plain_step_ms"] == pytest.approx(12.0, rel=0.01)
    assert c["decode_ceiling"] == pytest.approx(6.0, rel=0.03)
    assert c["break_even_acceptance"] == pytest.approx(1 / 6, rel=0.03)


def test_compute_bound_batch_has_no_headroom() -> None:
    """a = 0 at 16 requests (what 2 cores measured on SmolLM2): every token costs the same, so no draft can pay."""
    c = speculation_ceiling(_engine(_fitted(16, 0.0, 0.003)), 16)
    assert c is not None and c["decode_ceiling"] == pytest.approx(1.0, abs=0.02)
    assert c["break_even_acceptance"] == pytest.approx(1.0, abs=0.02)


def test_no_ceiling_without_a_ready_model() -> None:
    """No speculation, no step-cost model, an unready bucket or another bucket: None; first_ceiling skips them."""
    fitted = _engine(_fitted(1, 0.010, 0.002))
    assert speculation_ceiling(_engine(None), 1) is None
    assert speculation_ceiling(_engine(BatchStepCost()), 1) is None
    assert speculation_ceiling(fitted, 8) is None  # bucket 8-15 never observed
    assert speculation_ceiling(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object())), 1) is None
    assert runner_spec(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object()))) is None
    assert first_ceiling({"none": _engine(None), "suffix": _engine(BatchStepCost())}, 1) is None
    name, c = first_ceiling({"none": _engine(None), "suffix+dynamic": fitted}, 1)
    assert name == "suffix+dynamic" and c["decode_ceiling"] > 5


def test_free_tokens_give_an_unbounded_ceiling() -> None:
    """Tokens measured free (b = e = 0, constant steps): inf ceiling, break-even acceptance 0."""
    c = speculation_ceiling(_engine(_fitted(1, 0.010, 0.0)), 1)
    assert c is not None and (c["decode_ceiling"] > 1e3 or math.isinf(c["decode_ceiling"]))
    assert c["break_even_acceptance"] < 1e-3


def test_batch_size_of_a_run() -> None:
    ns = argparse.Namespace
    assert bench_batch_size(ns(max_concurrency=1, max_num_seqs=None, num_prompts=16)) == 1
    assert bench_batch_size(ns(max_concurrency=None, max_num_seqs=None, num_prompts=16)) == 16
    assert bench_batch_size(ns(max_concurrency=None, max_num_seqs=4, num_prompts=16)) == 4
    assert bench_batch_size(ns(max_concurrency=32, max_num_seqs=None, num_prompts=16)) == 16


def test_summary_prints_the_ceiling() -> None:
    c = speculation_ceiling(_engine(_fitted(1, 0.010, 0.002)), 1)
    line = format_ceiling("suffix+dynamic", c)
    assert "batch 1" in line and "suffix+dynamic" in line and "x6.0" in line and "acceptance 0.17" in line
    result = {"model": "m", "dtype": "bfloat16", "num_speculative_tokens": 3, "config": {"rounds": 1},
              "env": {"num_threads": 2, "load_warning": False}, "workloads": {},
              "speculation_ceiling": {"method": "suffix+dynamic", **c}}
    assert line in format_summary(result)
    assert "step cost" not in format_summary({**result, "speculation_ceiling": None})


def test_bench_reports_the_dynamic_methods_ceiling(tiny_llama_dir: str) -> None:
    """End to end: a cost-gated dynamic method's engine fits batch-1 steps during the run, and the result carries
    its ceiling (a finite or infinite bound >= 1 from a plain step no faster than its tokens' marginal cost)."""
    from ascent.benchmarks.cli import register_bench_parser

    parser = argparse.ArgumentParser(prog="ascent")
    register_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "spec", "--model", tiny_llama_dir, "--dtype", "float32", "--methods",
                              "suffix+dynamic", "--max-concurrency", "1", "--rounds", "1", "--num-prompts", "2",
                              "--output-len", "16", "--ignore-eos", "--num-threads", "1"])
    c = args.func(args)["speculation_ceiling"]
    assert c is not None and c["method"] == "suffix+dynamic" and c["batch_size"] == 1
    assert c["plain_step_ms"] > 0 and c["decode_ceiling"] >= 1.0
    assert c["break_even_acceptance"] == pytest.approx(1.0 / c["decode_ceiling"])
