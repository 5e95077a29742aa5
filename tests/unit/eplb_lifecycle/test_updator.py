"""EplbUpdator state machine on one rank with a fake in-process policy worker (when it plans, when it applies,
validation and failure paths), and the real policy process with a stand-in policy module (answers, bounded waits,
death -> rebalancing disabled with a logged error)."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
from torch import nn

from ascent.distributed import parallel_state as ps
from ascent.eplb.config import EplbConfig
from ascent.eplb.updator import EplbUpdator
from ascent.eplb.worker import PlanResult, PolicyWorker, PolicyWorkerDied
from ascent.layers.fused_moe import FusedMoE
from tests.unit.moe.helpers import load_experts, random_experts

E, K, H, INTER = 4, 2, 8, 6
FAKE_MODULE = "tests.unit.eplb_lifecycle.fake_policy"


class FakeProcess:
    exitcode: int | None = None


class FakeWorker:
    """In-process stand-in for PolicyWorker: answers with ``plan(placement)``."""

    def __init__(self, plan) -> None:
        self.plan, self.alive, self.submits, self.closed = plan, True, [], False
        self.process, self.pid, self._answer = FakeProcess(), 4242, None

    def is_alive(self) -> bool:
        return self.alive

    def submit(self, placement: torch.Tensor, load: torch.Tensor) -> int:
        self.submits.append((placement.clone(), load.clone()))
        self._answer = self.plan(placement)
        return len(self.submits)

    def result(self, timeout_s: float) -> PlanResult | None:
        if not self.alive:
            raise PolicyWorkerDied("fake policy process died")
        answer, self._answer = self._answer, None
        return answer

    def close(self) -> None:
        self.closed = True


def _model() -> nn.Module:
    ckpt = random_experts(E, H, INTER, seed=3)
    layers = nn.ModuleList(FusedMoE(E, K, H, INTER, torch.float32, num_redundant_experts=2) for _ in range(2))
    for layer in layers:
        load_experts(layer, ckpt)
    return layers


def _step(model: nn.Module, updator: EplbUpdator, x: torch.Tensor, logits: torch.Tensor) -> list[torch.Tensor]:
    outs = [layer(x, logits) for layer in model]
    updator.after_forward()
    return outs


def _rotate(placement: torch.Tensor) -> PlanResult:
    new = placement.reshape(placement.shape[0], -1).roll(1, 1).reshape(placement.shape)
    return PlanResult(1, True, [0, 1], new, 0.01)


def _updator(plan, **cfg) -> tuple[nn.Module, EplbUpdator, FakeWorker]:
    model = _model()
    fake = FakeWorker(plan)
    config = EplbConfig(**{"window_size": 4, "step_interval": 3, "plan_delay_steps": 1, "num_redundant_experts": 2,
                           **cfg})
    return model, EplbUpdator(config, model, ps.get_ep_group(), worker_factory=lambda name: fake), fake


def test_plans_at_interval_applies_after_delay_and_keeps_outputs() -> None:
    model, updator, fake = _updator(_rotate)
    x, logits = torch.randn(6, H), torch.randn(6, E)
    reference = [layer(x, logits) for layer in model]
    initial = updator.placement()
    for _ in range(3):
        _step(model, updator, x, logits)
    assert len(fake.submits) == 1 and torch.equal(updator.placement(), initial)
    placement, load = fake.submits[0]
    assert torch.equal(placement, initial) and load.shape == (3, 2, E) and int(load[0].sum()) == 2 * 6 * K
    outs = _step(model, updator, x, logits)
    assert not torch.equal(updator.placement(), initial)  # step 4: applied between steps
    for got, want in zip(outs + [layer(x, logits) for layer in model], reference * 2):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    stats = updator.stats()
    assert stats["rebalances"] == 1 and stats["last"]["changed_layers"] == 2 and stats["last"]["moves"] == 12
    assert stats["last"]["imbalance_before"] and stats["last"]["stall_s"] > 0 and stats["last"]["plan_s"] == 0.01
    for _ in range(3):
        _step(model, updator, x, logits)
    assert len(fake.submits) == 2 and updator.stats()["rebalances"] == 2


def test_zero_delay_applies_in_the_planning_step() -> None:
    model, updator, fake = _updator(_rotate, plan_delay_steps=0, step_interval=2)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    _step(model, updator, x, logits)
    initial = updator.placement()
    _step(model, updator, x, logits)
    assert len(fake.submits) == 1 and not torch.equal(updator.placement(), initial)


def test_invalid_layer_plan_is_rejected_and_other_layers_apply(caplog) -> None:
    def plan(placement: torch.Tensor) -> PlanResult:
        new = _rotate(placement).new_placement
        new[0] = 0  # layer 0 loses experts 1..3: must keep its placement
        return PlanResult(1, True, None, new)

    model, updator, _ = _updator(plan, plan_delay_steps=0)
    before = updator.placement()
    x, logits = torch.randn(3, H), torch.randn(3, E)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            _step(model, updator, x, logits)
    after = updator.placement()
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    assert "MoE layer 0 rejected" in caplog.text


@pytest.mark.parametrize("answer, message", [
    (None, "not ready"), (PlanResult(1, error="Traceback: boom"), "policy failed"),
    (PlanResult(1, True, None, torch.zeros(1, 2, 3, dtype=torch.int64)), "shape"),
])
def test_failed_plans_skip_the_cycle_and_stay_enabled(caplog, answer, message) -> None:
    model, updator, _ = _updator(lambda placement: answer, plan_delay_steps=0)
    before = updator.placement()
    x, logits = torch.randn(3, H), torch.randn(3, E)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            _step(model, updator, x, logits)
    assert torch.equal(updator.placement(), before) and updator.enabled
    assert updator.stats()["plans_failed"] == 1 and message in caplog.text


def test_unchanged_plan_moves_nothing() -> None:
    model, updator, fake = _updator(lambda p: PlanResult(1, False, None, p.clone()), plan_delay_steps=0)
    x, logits = torch.randn(3, H), torch.randn(3, E)
    for _ in range(3):
        _step(model, updator, x, logits)
    assert len(fake.submits) == 1 and updator.stats()["rebalances"] == 0


def test_worker_death_disables_rebalancing_and_serving_continues(caplog) -> None:
    model, updator, fake = _updator(_rotate)
    before = updator.placement()
    x, logits = torch.randn(3, H), torch.randn(3, E)
    fake.alive = False
    fake.process.exitcode = -9
    with caplog.at_level(logging.ERROR):
        for _ in range(8):
            _step(model, updator, x, logits)
    assert not updator.enabled and fake.closed and fake.submits == []
    assert torch.equal(updator.placement(), before)
    assert "died" in caplog.text and "disabled" in caplog.text
    assert "died" in updator.stats()["disabled_reason"]


def test_updator_validates_model_and_redundancy() -> None:
    with pytest.raises(ValueError, match="no FusedMoE"):
        EplbUpdator(EplbConfig(), nn.Linear(2, 2), ps.get_ep_group(), worker_factory=FakeWorker)
    with pytest.raises(ValueError, match="num_redundant_experts=0"):
        EplbUpdator(EplbConfig(), _model(), ps.get_ep_group(), worker_factory=FakeWorker)


def test_policy_process_answers_and_death_is_detected() -> None:
    worker = PolicyWorker("rotate", FAKE_MODULE)
    try:
        placement = torch.arange(8).view(2, 2, 2) % 4
        worker.submit(placement, torch.ones(3, 2, 4))
        result = worker.result(timeout_s=60.0)
        assert result is not None and result.changed and result.error is None
        assert torch.equal(result.new_placement, placement.view(2, -1).roll(1, 1).view(2, 2, 2))
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.join(10.0)
        with pytest.raises(PolicyWorkerDied, match="died"):
            worker.submit(placement, torch.ones(3, 2, 4))
    finally:
        worker.close()
    assert not worker.is_alive()


def test_policy_process_bounded_wait_and_policy_errors() -> None:
    worker = PolicyWorker("slow", FAKE_MODULE)
    try:
        worker.submit(torch.zeros(1, 1, 2, dtype=torch.int64), torch.ones(1, 2))
        start = time.monotonic()
        assert worker.result(timeout_s=0.2) is None and time.monotonic() - start < 5.0
        assert worker.result(timeout_s=60.0).changed
    finally:
        worker.close()
    boom = PolicyWorker("boom", FAKE_MODULE)
    try:
        boom.submit(torch.zeros(1, 1, 2, dtype=torch.int64), torch.ones(1, 2))
        assert "policy exploded" in boom.result(timeout_s=60.0).error and boom.is_alive()
    finally:
        boom.close()


def test_updator_with_killed_policy_process_keeps_serving(caplog) -> None:
    model = _model()
    config = EplbConfig(window_size=4, step_interval=2, plan_delay_steps=1, num_redundant_experts=2)
    updator = EplbUpdator(config, model, ps.get_ep_group(),
                          worker_factory=lambda name: PolicyWorker("rotate", FAKE_MODULE))
    x, logits = torch.randn(3, H), torch.randn(3, E)
    try:
        for _ in range(3):
            _step(model, updator, x, logits)
        assert updator.stats()["rebalances"] == 1
        os.kill(updator.worker.pid, signal.SIGKILL)
        updator.worker.process.join(10.0)
        with caplog.at_level(logging.ERROR):
            for _ in range(4):
                _step(model, updator, x, logits)
        assert not updator.enabled and updator.stats()["rebalances"] == 1 and "died" in caplog.text
    finally:
        updator.shutdown()
