"""The runner consults the goodput arbiter only where a plain step's tokens are a real share of its time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ascent.spec_decode.base import SpeculativeConfig
from ascent.worker.spec_decode import ARBITER_MIN_TOKEN_SHARE, SpecDecodeRunner
from tests.unit.test_spec_step_cost import _FixedCost


class _Drafts:
    deterministic = True

    def update_requests(self, req_ids, new_token_ids) -> None:
        pass

    def propose(self, req_ids, token_ids, max_num_tokens):
        return np.array([[5, 6, 7][: max(max_num_tokens)] for _ in req_ids])

    def draft_evidence(self):
        return None


def _runner(cost: _FixedCost | None) -> SpecDecodeRunner:
    runner = SpecDecodeRunner(SpeculativeConfig(method="suffix", num_speculative_tokens=3, dynamic=True), 128, "host",
                              None)
    runner.proposer = _Drafts()
    if cost is not None:
        runner.gate.cost = runner.step_cost = cost
    return runner


def _propose(runner: SpecDecodeRunner, num_reqs: int) -> dict[str, list[int]]:
    ids = [f"r{i}" for i in range(num_reqs)]
    for req_id in ids:  # likely drafts, so the gate keeps them wherever they are proposed
        runner.acceptance.record(req_id, 3, 3)
    batch = SimpleNamespace(num_reqs=num_reqs, req_id_to_index={r: i for i, r in enumerate(ids)},
                            token_ids=np.ones((num_reqs, 128), dtype=np.int64), num_tokens=np.full(num_reqs, 10))
    return runner.propose(batch, ids, [[] for _ in ids])


def test_memory_bound_steps_skip_the_arbiter():
    runner = _runner(_FixedCost(0.012, 0.001))  # a token is 1/13 of a batch-1 step, 4/16 at 4 requests
    assert 1 * 0.001 / 0.013 < ARBITER_MIN_TOKEN_SHARE and 4 * 0.001 / 0.016 < ARBITER_MIN_TOKEN_SHARE
    for num_reqs in (1, 4):
        for _ in range(12):
            assert len(_propose(runner, num_reqs)) == num_reqs  # never a plain window
            assert runner._next_mode is None
    assert runner.arbiter.num_steps == [0, 0]


def test_compute_bound_and_unmodelled_steps_are_arbitrated():
    runner = _runner(_FixedCost(0.002, 0.002))  # tokens dominate: the arbiter decides every step
    _propose(runner, 4)
    assert runner._next_mode == (4, True) and runner.arbiter.num_steps == [1, 0]
    cold = _runner(None)  # the default per-batch models, not ready yet: the arbiter decides
    _propose(cold, 1)
    assert cold._next_mode == (1, True) and cold.arbiter.num_steps == [1, 0]
    off = SpecDecodeRunner(SpeculativeConfig(method="suffix", num_speculative_tokens=3, dynamic=True,
                                             dynamic_params={"cost_gate": False}), 128, "host", None)
    assert off._arbitrated(1)  # no cost model: always arbitrated
