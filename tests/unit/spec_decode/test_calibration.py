"""DraftCalibration: evidence cells, online per-cell acceptance, the monotone table, and the runner's use of it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.calibration import (NUM_CELLS, SUPPORT_EDGES, DraftCalibration, DraftEvidence,
                                            non_decreasing)
from ascent.spec_decode.suffix import SuffixDecodingProposer
from tests.unit.test_spec_step_cost import _FixedCost

NUM_SUPPORT = len(SUPPORT_EDGES) + 1


def _evidence(ratios: list[float], supports: list[int]) -> DraftEvidence:
    return DraftEvidence(np.array(ratios, dtype=np.float64), np.array(supports, dtype=np.int64))


def test_cells_follow_the_bin_edges():
    ev = _evidence([0.0, 0.49, 0.5, 0.79, 0.8, 0.998, 0.999, 1.0, 1.0, 1.0, 1.0, 1.0],
                   [1, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 500])
    ratio_bins = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3]
    support_bins = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert ev.cells.tolist() == [r * NUM_SUPPORT + s for r, s in zip(ratio_bins, support_bins)]
    assert int(ev.cells.max()) < NUM_CELLS
    with pytest.raises(ValueError, match="shape"):
        DraftEvidence(np.ones(3), np.ones(2, dtype=np.int64))


def test_record_counts_only_the_tried_positions():
    cal = DraftCalibration(half_life=1e9)
    ev = _evidence([1.0] * 5, [1, 2, 4, 8, 16])  # five distinct cells of ratio bin 3
    cal.remember("r", ev, 5)
    cal.record(["r"], [5], [2])  # positions 0, 1 accepted; 2 rejected; 3, 4 never tried
    rates = cal.rates().reshape(-1, NUM_SUPPORT)[3]
    assert rates[:3].tolist() == [1.0, 1.0, 0.0] and np.isnan(rates[3:]).all()
    cal.remember("r", ev, 4)
    cal.record(["r"], [2], [2])  # the scheduler verified only 2 of the 4 kept drafts: both accepted
    assert cal.rates().reshape(-1, NUM_SUPPORT)[3, :3].tolist() == [1.0, 1.0, 0.0]
    cal.record(["r"], [3], [0])  # nothing remembered any more: ignored
    cal.remember("q", ev, 0)  # nothing kept: nothing to book
    cal.record(["q"], [1], [0])
    assert cal.rates().reshape(-1, NUM_SUPPORT)[3, :3].tolist() == [1.0, 1.0, 0.0]


def test_estimates_learn_each_cell_and_keep_rows_without_evidence():
    cal = DraftCalibration()
    sure, doubtful = _evidence([1.0] * 3, [16, 17, 18]), _evidence([0.3] * 3, [2, 3, 4])
    for step in range(200):
        cal.remember("a", sure, 3)
        cal.remember("b", doubtful, 3)
        cal.record(["a", "b"], [3, 3], [3, 0])
    fallback = np.full((3, 4), 0.5)
    out = cal.estimate([sure, doubtful, None], fallback)
    assert (out[0, :3] > 0.95).all() and out[1, 0] < 0.05 and out[2].tolist() == [0.5] * 4
    assert out[0, 3] == out[1, 3] == 0.5 and fallback.tolist() == np.full((3, 4), 0.5).tolist()
    with pytest.raises(ValueError, match="rows"):
        cal.estimate([sure], fallback)


def test_untried_longer_matches_inherit_and_sparse_cells_do_not_pin():
    cal = DraftCalibration(prior_strength=4.0, half_life=1e9)
    short = _evidence([1.0], [4])  # ratio bin 3, support bin 2
    for _ in range(100):
        cal.remember("a", short, 1)
        cal.record(["a"], [1], [1])
    table = cal.table()
    assert table[3, 2] > 0.95 and (table[3, 3:] >= table[3, 2]).all()  # never tried, but at least as likely
    cal = DraftCalibration(prior_strength=4.0, half_life=1e9)
    sparse, dense = _evidence([1.0], [1]), _evidence([1.0], [2])
    cal.remember("a", sparse, 1)
    cal.record(["a"], [1], [1])  # one lucky short match
    for _ in range(200):
        cal.remember("b", dense, 1)
        cal.record(["b"], [1], [0])
    row = cal.table()[3]
    assert (np.diff(row) >= 0).all() and row[1] < 0.1 and row[0] < 0.2  # pooled down, not pinned up


def test_counts_halve_every_half_life():
    cal = DraftCalibration(half_life=10.0)
    ev = _evidence([1.0], [1])
    for _ in range(10):
        cal.remember("a", ev, 1)
        cal.record(["a"], [1], [1])
    tried = cal._tried.sum()
    assert tried == pytest.approx(sum(0.5 ** (i / 10) for i in range(10)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0.1, 50)), min_size=1, max_size=6))
def test_non_decreasing_is_the_weighted_isotonic_fit(pairs):
    values, weights = np.array([v for v, _ in pairs]), np.array([w for _, w in pairs])
    fit = non_decreasing(values, weights)
    assert (np.diff(fit) >= -1e-12).all()
    assert float(weights @ fit) == pytest.approx(float(weights @ values), rel=1e-9, abs=1e-9)
    reference = minimize(lambda x: float(weights @ (x - values) ** 2), np.sort(values), method="SLSQP",
                         constraints=[{"type": "ineq", "fun": lambda x: np.diff(x)}], options={"ftol": 1e-12})
    loss = float(weights @ (fit - values) ** 2)
    assert loss <= float(weights @ (reference.x - values) ** 2) + 1e-7


def test_suffix_evidence_is_the_trees_branch_ratio_and_matched_context():
    cfg = SpeculativeConfig.from_json({"method": "suffix", "num_speculative_tokens": 6})
    p = SuffixDecodingProposer(cfg, 4096)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3, 4, 5, 6]
    p.add_request("r", prompt)
    row = p.propose(["r"], [np.array(prompt + [1, 2], dtype=np.int64)], [6])[0]
    draft, (ev,) = p.last_drafts[0], p.draft_evidence()
    assert [t for t in row if t >= 0] == draft.token_ids and len(draft.token_ids) >= 2
    assert np.cumprod(ev.cond_prob) == pytest.approx(draft.probs)
    assert ev.support.tolist() == [draft.match_len + i for i in range(len(draft.token_ids))]
    assert 0.0 < ev.cond_prob.min() <= ev.cond_prob.max() <= 1.0
    p.propose(["r"], [np.array([77], dtype=np.int64)], [6])  # no match: no draft, no evidence
    assert p.draft_evidence() == [None]


class _ScoredDrafts:
    """A model-free proposer stub with fixed drafts and evidence per request."""

    deterministic = True

    def __init__(self, drafts: dict[str, list[int]], evidence: dict[str, DraftEvidence]) -> None:
        self.drafts, self.evidence, self._last = drafts, evidence, []

    def add_request(self, req_id, prompt_token_ids) -> None:
        pass

    def remove_request(self, req_id) -> None:
        pass

    def update_requests(self, req_ids, new_token_ids) -> None:
        pass

    def propose(self, req_ids, token_ids, max_num_tokens):
        self._last = list(req_ids)
        width = max(max_num_tokens)
        return np.array([(self.drafts[r] + [-1] * width)[:width] for r in req_ids])

    def draft_evidence(self):
        return [self.evidence[r] for r in self._last]


def test_runner_gates_each_draft_by_its_calibrated_evidence():
    from ascent.worker.spec_decode import SpecDecodeRunner

    k, ids = 6, ["sure", "doubtful"]
    runner = SpecDecodeRunner(SpeculativeConfig(method="suffix", num_speculative_tokens=k, dynamic=True,
                                                dynamic_params={"goodput_arbiter": False}), 128, "host", None)
    sure, doubtful = _evidence([1.0] * k, [20 + i for i in range(k)]), _evidence([0.4] * k, [2] * k)
    runner.proposer = _ScoredDrafts({r: list(range(1, k + 1)) for r in ids}, {"sure": sure, "doubtful": doubtful})
    runner.gate.cost = runner.step_cost = _FixedCost(0.002, 0.001)  # compute-bound: only likely drafts pay
    for req_id in ids:
        runner.add_request(req_id, [1, 2, 3], [])
    for _ in range(50):  # equal position statistics for both requests; only the evidence tells them apart
        runner.acceptance.record_batch(ids, [k, k], [3, 3])
        runner.calibration.remember("sure", sure, k)
        runner.calibration.remember("doubtful", doubtful, k)
        runner.calibration.record(ids, [k, k], [k, 0])
    batch = SimpleNamespace(num_reqs=2, req_id_to_index={r: i for i, r in enumerate(ids)},
                            token_ids=np.ones((2, 128), dtype=np.int64), num_tokens=np.full(2, 10))
    out = runner.propose(batch, ids, [[], []])
    assert out == {"sure": list(range(1, k + 1))}
    assert runner.calibration._pending["sure"].tolist() == sure.cells.tolist()
    assert "doubtful" not in runner.calibration._pending
    runner.remove_request("sure")
    assert runner.calibration._pending == {}
    no_cal = SpecDecodeRunner(SpeculativeConfig(method="suffix", num_speculative_tokens=k, dynamic=True,
                                                dynamic_params={"calibrate_drafts": False}), 128, "host", None)
    assert no_cal.calibration is None


def test_table_is_recomputed_after_each_booking():
    cal = DraftCalibration()
    ev = _evidence([1.0], [8])
    before = cal.table().copy()
    assert cal.table() is cal.table()  # cached while the counts stand
    cal.remember("a", ev, 1)
    cal.record(["a"], [1], [0])
    after = cal.table()
    assert after[3, 3] < before[3, 3] and not after.flags.writeable
