"""Live EPLB with EP=2 over gloo (two worker processes driven through the executor helpers): rebalancing every few
steps during greedy generation leaves the tokens identical to a run without EPLB; killing the policy process
disables rebalancing with a logged error while generation completes.

Workers run with ``daemon=False`` so that EP rank 0 may start the policy process."""

from __future__ import annotations

import os
import signal

import pytest

from ascent.executor.multiproc import MultiprocExecutor
from tests.fixtures.tiny_moe import build_moe_model
from tests.integration.executor_helpers import greedy_generate, make_config

MAX_NEW = 12
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [300, 301, 2, 9], [77] * 6]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_moe_model(tmp_path_factory.mktemp("tiny_moe_eplb"), seed=3))


def _run(moe_dir: str, eplb: dict | None, on_step=None) -> tuple[list[list[int]], list[dict | None]]:
    config = make_config(moe_dir, 2, dtype="float32", enable_expert_parallel=True, eplb_config=eplb)
    executor = MultiprocExecutor(config, daemon=False, execute_timeout_s=120.0)
    try:
        hook = (lambda step: on_step(executor, step)) if on_step is not None else None
        tokens = greedy_generate(executor, config, PROMPTS, MAX_NEW, on_step=hook)
        return tokens, executor.collective_rpc("eplb_stats")
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def baseline(moe_dir: str) -> list[list[int]]:
    tokens, stats = _run(moe_dir, None)
    assert stats == [None, None]
    return tokens


def test_rebalancing_during_generation_keeps_greedy_tokens(moe_dir: str, baseline: list[list[int]]) -> None:
    eplb = {"enable": True, "policy": "swift", "window_size": 4, "step_interval": 3, "plan_delay_steps": 1}
    tokens, stats = _run(moe_dir, eplb)
    assert tokens == baseline
    assert all(s["enabled"] and s["steps"] == stats[0]["steps"] for s in stats)
    assert stats[0]["rebalances"] >= 1 and stats[0]["moves_total"] > 0
    assert stats[0]["placement"] == stats[1]["placement"]  # both ranks switched to the same maps
    assert stats[0]["rebalances"] == stats[1]["rebalances"] and stats[0]["last"]["bytes_moved"] > 0
    assert len(stats[0]["imbalance"]) == 2 and stats[0]["last"]["stall_s"] > 0


def test_redundant_expert_slots_keep_greedy_tokens(moe_dir: str, baseline: list[list[int]]) -> None:
    """2 redundant slots (8 experts -> 10 physical, 5 per rank): replicas and their rebalancing change nothing."""
    eplb = {"enable": True, "policy": "default", "window_size": 4, "step_interval": 3, "plan_delay_steps": 1,
            "num_redundant_experts": 2}
    tokens, stats = _run(moe_dir, eplb)
    assert tokens == baseline
    assert all(s["enabled"] for s in stats) and stats[0]["placement"] == stats[1]["placement"]
    assert len(stats[0]["placement"][0]) * len(stats[0]["placement"][0][0]) == 10


def test_killed_policy_process_disables_rebalancing_and_generation_completes(
        moe_dir: str, baseline: list[list[int]], capfd) -> None:
    eplb = {"enable": True, "policy": "swift", "window_size": 4, "step_interval": 3, "plan_delay_steps": 1}

    def kill_policy(executor: MultiprocExecutor, step: int) -> None:
        if step == 4:
            pid = executor.collective_rpc("eplb_stats")[0]["policy_pid"]
            os.kill(pid, signal.SIGKILL)

    tokens, stats = _run(moe_dir, eplb, on_step=kill_policy)
    assert tokens == baseline
    assert [s["enabled"] for s in stats] == [False, False]
    assert all("died" in s["disabled_reason"] for s in stats)
    assert stats[0]["policy_pid"] is None
    assert "EPLB disabled" in capfd.readouterr().err
