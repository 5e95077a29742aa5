"""Live EPLB on quantized tiny MoE checkpoints (the compressed-tensors golden fixtures: W8A8 dynamic and W4A16 g32
experts): greedy generation with rebalancing every few steps equals the run without EPLB.

* one process (EP = 1) with two redundant slots and a policy process running the stand-in "rotate" policy (a real
  policy never moves experts on a single rank: there is no imbalance between ranks to fix): every rebalance moves
  every slot, refilled by local copies of all its quantized tensors (weights, scales, packed int4), and the schemes
  rebuild their operands;
* two EP ranks over gloo (W4A16): experts travel between ranks as all their tensors (int32 packed weights, float
  scales, int64 shape records) through batched P2P.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from ascent.eplb.worker import PolicyWorker
from ascent.executor.multiproc import MultiprocExecutor
from ascent.executor.uniproc import UniProcExecutor
from tests.fixtures.tiny_models import build_tokenizer
from tests.integration.executor_helpers import greedy_generate, make_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
MAX_NEW = 10
PROMPTS = [[5, 17, 99, 3, 42, 7, 120, 11], [100, 101, 2, 9], [77] * 6]
STAND_IN_POLICIES = "tests.unit.eplb_lifecycle.fake_policy"
EPLB = {"enable": True, "policy": "default", "window_size": 4, "step_interval": 3, "plan_delay_steps": 1,
        "num_redundant_experts": 2}


def _model_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    """The fixture copied next to a tiny tokenizer (the fixtures have none)."""
    model_dir = tmp_path_factory.mktemp(f"eplb_{name}") / name
    shutil.copytree(FIXTURES / name, model_dir)
    build_tokenizer(model_dir, vocab_size=AutoConfig.from_pretrained(str(model_dir)).vocab_size)
    return str(model_dir)


def _run(model_dir: str, world: int, eplb: dict | None) -> tuple[list[list[int]], list[dict | None]]:
    config = make_config(model_dir, world, dtype="float32", enable_expert_parallel=world > 1, eplb_config=eplb)
    if world == 1:
        executor = UniProcExecutor(config)
        updator = executor.driver_worker.eplb_updator
        if updator is not None:  # swap in the rotating stand-in policy process
            updator.worker.close()
            updator.worker = PolicyWorker("rotate", STAND_IN_POLICIES)
    else:
        executor = MultiprocExecutor(config, daemon=False, execute_timeout_s=120.0)
    try:
        tokens = greedy_generate(executor, config, PROMPTS, MAX_NEW)
        return tokens, executor.collective_rpc("eplb_stats")
    finally:
        executor.shutdown()


@pytest.mark.parametrize("name", ["ct_moe_w8a8", "ct_moe_w4a16"])
def test_single_rank_rebalancing_of_quantized_experts_keeps_greedy_tokens(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    model_dir = _model_dir(tmp_path_factory, name)
    baseline, stats = _run(model_dir, 1, None)
    assert stats == [None]
    tokens, stats = _run(model_dir, 1, EPLB)
    assert tokens == baseline
    assert stats[0]["enabled"] and stats[0]["rebalances"] >= 1 and stats[0]["moves_total"] > 0
    assert len(stats[0]["placement"][0][0]) == 6  # 4 experts + 2 redundant slots on the one rank


def test_two_rank_rebalancing_of_quantized_experts_keeps_greedy_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    model_dir = _model_dir(tmp_path_factory, "ct_moe_w4a16")
    baseline, stats = _run(model_dir, 2, None)
    assert stats == [None, None]
    eplb = {**EPLB, "policy": "swift", "num_redundant_experts": 0}
    tokens, stats = _run(model_dir, 2, eplb)
    assert tokens == baseline
    assert all(s["enabled"] for s in stats) and stats[0]["placement"] == stats[1]["placement"]
    assert stats[0]["rebalances"] >= 1 and stats[0]["moves_total"] > 0 and stats[0]["last"]["bytes_moved"] > 0
