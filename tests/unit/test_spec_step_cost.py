"""Cost-aware draft gate: the online step-cost fit, the throughput-optimal cut, config validation, runner timing and
greedy equality end to end (deterministic: fixed cost models or an injected clock, never wall time)."""

from __future__ import annotations

import itertools
import math
import sys

import numpy as np
import pytest

from ascent import LLM, SamplingParams
from ascent.core.sched_output import CachedRequestData, SchedulerOutput
from tests.fixtures.scripted_proposer import BAD, GOOD, ScriptedProposer, plain_continuations, run_greedy
from ascent.spec_decode.dynamic import DraftGate, DynamicSpecParams
from ascent.spec_decode.step_cost import ROW_BLOCK, BatchStepCost, StepCostModel, best_drafts, cost_cut


# ---------------------------------------------------------------------------------------------------- the fit
def _feed(model: StepCostModel, a: float, b: float, xs, noise: float = 0.0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for x in xs:
        model.observe(x, a + b * x + noise * rng.standard_normal())


def test_fit_recovers_exact_coefficients():
    model = StepCostModel(half_life=32, min_samples=4)
    assert not model.ready and model.coefficients() == (0.0, 0.0, 0.0) and model.marginal_ratio(10) == 0.0
    _feed(model, 0.020, 0.0015, [16, 20, 17, 30, 25, 16, 40, 33, 18, 22] * 5)
    a, b, c = model.coefficients()
    assert c == pytest.approx(0.0, abs=1e-9)
    assert model.ready and a == pytest.approx(0.020, rel=1e-2) and b == pytest.approx(0.0015, rel=1e-2)
    assert model.predict(10) == pytest.approx(0.035, rel=1e-2)
    assert model.marginal_ratio(10) == pytest.approx(0.0015 / 0.035, rel=2e-2)


def test_fit_is_robust_to_noise_and_outliers():
    rng = np.random.default_rng(1)
    xs = rng.integers(16, 65, size=600)
    model = StepCostModel(half_life=128)
    for i, x in enumerate(xs):
        y = 0.030 + 0.001 * x + 0.001 * rng.standard_normal()
        if i % 25 == 3:
            y += 5.0  # an idle gap / a hiccup of a shared machine
        if i == 0:
            y = 30.0  # first step: compilation
        model.observe(int(x), y)
    a, b, _ = model.coefficients()
    assert a == pytest.approx(0.030, abs=0.006) and b == pytest.approx(0.001, rel=0.15)
    assert model.num_clipped >= 20


def test_fit_separates_the_fixed_verify_cost():
    model = StepCostModel(half_life=64, min_samples=6)
    rng = np.random.default_rng(2)
    for i in range(400):
        x, verify = int(rng.integers(16, 40)), i % 3 != 0
        model.observe(x, 0.03 + 0.002 * x + (0.006 if verify else 0.0) + 0.0005 * rng.standard_normal(), verify)
    a, b, c = model.coefficients()
    assert a == pytest.approx(0.03, abs=0.003) and b == pytest.approx(0.002, rel=0.05)
    assert c == pytest.approx(0.006, abs=0.001) and model.predict(20, True) == pytest.approx(0.076, rel=0.02)
    model = StepCostModel(min_samples=4)  # every step verifies: c is not identifiable and stays 0
    _feed(model, 0.02, 0.001, [10, 20, 30] * 10)
    assert model.coefficients()[2] == 0.0


def test_fit_follows_a_shift_and_memory_is_bounded():
    model = StepCostModel(half_life=16, min_samples=4)
    xs = [1, 2, 3, 4] * 10
    _feed(model, 0.010, 0.0001, xs)
    size = sys.getsizeof(model.__dict__) + sum(sys.getsizeof(v) for v in model.__dict__.values())
    _feed(model, 0.010, 0.0001, xs * 250)
    size_after = sys.getsizeof(model.__dict__) + sum(sys.getsizeof(v) for v in model.__dict__.values())
    assert size_after <= size  # O(1): no per-observation history
    _feed(model, 0.005, 0.005, xs * 60)  # the step became compute-bound
    a, b, _ = model.coefficients()
    assert a == pytest.approx(0.005, rel=0.1) and b == pytest.approx(0.005, rel=0.1)


def test_fit_without_token_variation_assumes_free_tokens_and_clamps():
    model = StepCostModel(min_samples=4)
    _feed(model, 0.02, 0.0, [16] * 20)
    a, b, _ = model.coefficients()
    assert b == pytest.approx(0.0, abs=1e-6) and a == pytest.approx(0.02)
    model = StepCostModel(min_samples=4)  # a decreasing cost: clamped to b >= 0
    _feed(model, 0.05, -0.001, [1, 5, 10, 20] * 5)
    assert model.coefficients()[1] == 0.0
    model = StepCostModel(min_samples=4)  # negative intercept: refit through the origin
    _feed(model, -0.01, 0.002, [10, 20, 30, 40] * 5)
    a, b, _ = model.coefficients()
    assert a == 0.0 and b > 0
    model.observe(float("nan"), 1.0)
    model.observe(3, -1.0)
    assert model.num_observed == 20


@pytest.mark.parametrize("kwargs", [{"half_life": 0}, {"half_life": float("inf")}, {"min_samples": 1},
                                    {"min_samples": 2.5}, {"outlier_scale": 0}, {"prior_weight": -1}])
def test_fit_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        StepCostModel(**kwargs)


# ---------------------------------------------------------------------------------------------------- the cut
def _rate(survival, counts, a: float, b: float, c: float, e: float = 0.0) -> float:
    g = len(counts) + sum(survival[i, :k].sum() for i, k in enumerate(counts))
    n = len(counts) + sum(counts)
    return g / (a + b * n + (c if sum(counts) else 0.0) + e * math.ceil(n / ROW_BLOCK))


def _brute_force(survival: np.ndarray, keep: np.ndarray, a: float, b: float, c: float) -> float:
    """Best expected throughput over all prefix allocations."""
    return max(_rate(survival, counts, a, b, c) for counts in np.ndindex(*(int(k) + 1 for k in keep)))


def test_cut_memory_bound_keeps_and_compute_bound_drops_low_survival():
    survival = np.cumprod(np.array([[0.95, 0.9, 0.9], [0.3, 0.5, 0.5], [0.6, 0.6, 0.6]]), axis=1)
    keep = np.array([3, 3, 3])
    # batch 1-like memory-bound step: a >> b -> every draft pays
    assert cost_cut(survival, keep, a=0.020, b=0.0001).tolist() == [3, 3, 3]
    # compute-bound step of a large batch: each token costs as much as the fixed part -> only the likely drafts
    out = cost_cut(survival, keep, a=0.003, b=0.001)
    assert out[1] == 0 and out[0] >= 2 and out[2] <= 1
    # fully compute-bound: nothing short of certainty pays
    assert cost_cut(survival, keep, a=0.0, b=0.001).tolist() == [0, 0, 0]
    assert cost_cut(survival, keep, a=0.0, b=0.0).tolist() == [3, 3, 3]  # free tokens
    assert cost_cut(survival, np.array([1, 0, 2]), a=0.02, b=1e-6).tolist() == [1, 0, 2]  # never above keep
    # a larger safety factor keeps no more
    assert (cost_cut(survival, keep, 0.003, 0.001, safety=2.0) <= out).all()


def test_cut_is_throughput_optimal():
    rng = np.random.default_rng(3)
    for _ in range(60):
        bsz, d = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        survival = np.cumprod(rng.uniform(0.05, 1.0, size=(bsz, d)), axis=1)
        keep = rng.integers(0, d + 1, size=bsz)
        a, b = float(rng.uniform(0.0, 0.02)), float(rng.uniform(1e-4, 0.01))
        c = float(rng.choice([0.0, rng.uniform(0.0, 0.02)]))
        out = cost_cut(survival, keep, a, b, c)
        assert (out <= keep).all() and (out >= 0).all()
        assert _rate(survival, out, a, b, c) == pytest.approx(_brute_force(survival, keep, a, b, c), rel=1e-9)


def test_cut_pays_for_the_row_blocks_drafts_start():
    # 14 requests with one draft each (survival 0.2): without e every draft pays; with e (a 17th row starts a second
    # 16-row tile pass) only the two that fit in the first block do
    survival = np.full((14, 1), 0.2)
    keep = np.ones(14, dtype=np.int64)
    assert cost_cut(survival, keep, a=0.01, b=5e-5).sum() == 14
    assert cost_cut(survival, keep, a=0.01, b=5e-5, e=0.004).sum() == 2
    rng = np.random.default_rng(5)
    for _ in range(40):  # optimal over every draft count (one draft per request: the best k are the likeliest)
        bsz = int(rng.integers(8, 40))
        survival = rng.uniform(0.0, 1.0, size=(bsz, 1))
        keep = np.ones(bsz, dtype=np.int64)
        a, b, c, e = (float(rng.uniform(0.0, 0.02)), float(rng.uniform(1e-5, 1e-3)), float(rng.uniform(0.0, 0.005)),
                      float(rng.uniform(0.0, 0.005)))
        out = cost_cut(survival, keep, a, b, c, e=e)
        ranked = np.sort(survival[:, 0])[::-1]
        best = max(_rate(survival, (survival[:, 0] >= ranked[k - 1]).astype(int) if k else np.zeros(bsz, int),
                         a, b, c, e) for k in range(bsz + 1))
        assert _rate(survival, out, a, b, c, e) == pytest.approx(best, rel=1e-9)


def test_fit_separates_the_row_block_cost():
    model = StepCostModel(half_life=1000, min_samples=4)
    for x in [14, 16, 17, 20, 25, 30, 32, 33, 40, 15, 18, 48, 49, 12] * 6:
        model.observe(x, 0.010 + 0.0001 * x + 0.0013 * math.ceil(x / 16), verify=False)
    a, b, c = model.coefficients()
    assert model.row_block_cost() == pytest.approx(0.0013, rel=0.15)  # ridge-shrunk a little (prior_weight 1)
    assert a == pytest.approx(0.010, rel=0.1) and b == pytest.approx(0.0001, rel=0.15) and c == 0.0
    assert model.predict(17) - model.predict(16) == pytest.approx(0.0001 + 0.0013, rel=0.15)
    assert model.predict(17) - model.predict(16) > 5 * (model.predict(16) - model.predict(15))  # the jump is seen


def test_cut_fixed_verify_cost_needs_enough_drafts():
    survival = np.array([[0.5, 0.25], [0.5, 0.25]])
    keep = np.array([2, 2])
    assert cost_cut(survival, keep, a=0.02, b=0.0001).tolist() == [2, 2]
    # a verifying step costs twice as much: +0.75 tokens per request do not pay, unless c is paid anyway
    assert cost_cut(survival, keep, a=0.02, b=0.0001, c=0.02).tolist() == [0, 0]
    assert cost_cut(survival, keep, a=0.02, b=0.0001, c=0.02, forced_drafts=1).tolist() == [2, 2]
    assert cost_cut(np.array([[0.99, 0.98, 0.97]] * 2), np.array([3, 3]), 0.02, 0.0001, 0.01).tolist() == [3, 3]


def test_cut_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="inconsistent"):
        cost_cut(np.ones((2, 3)), np.array([1, 1, 1]), 0.01, 0.001)


class _FixedCost(StepCostModel):
    def __init__(self, a: float, b: float, c: float = 0.0) -> None:
        super().__init__()
        self._a, self._b, self._c = a, b, c

    @property
    def ready(self) -> bool:
        return True

    def coefficients(self) -> tuple[float, float, float]:
        return self._a, self._b, self._c


def test_gate_uses_the_cost_model_and_still_probes():
    probs = np.array([[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]])
    ids = ["good", "bad"]
    mem = DraftGate(0.0, probe_interval=3, cost=_FixedCost(0.02, 0.00001))
    assert mem.apply(ids, probs, np.array([3, 3])).tolist() == [3, 3]
    comp = DraftGate(0.0, probe_interval=3, cost=_FixedCost(0.002, 0.001))
    outs = [comp.apply(ids, probs, np.array([3, 3])).tolist() for _ in range(12)]
    # "bad" is probed on the shared probe steps (every 3rd); each failed probe doubles its wait (3, then 6)
    assert all(o[0] >= 1 for o in outs) and [o[1] for o in outs] == [0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert comp.num_cost_cut > 0
    unready = DraftGate(0.0, 3, cost=StepCostModel())  # no samples yet: no cost cut
    assert unready.apply(ids, probs, np.array([3, 3])).tolist() == [3, 3]
    with pytest.raises(ValueError, match="cost_safety"):
        DraftGate(0.0, 3, cost_safety=-1.0)


def test_gate_on_made_drafts_neither_idles_nor_probes_requests_without_one():
    probs = np.array([[0.9, 0.9, 0.9], [0.6, 0.6, 0.6], [0.2, 0.2, 0.2]])
    ids = ["a", "b", "c"]
    gate = DraftGate(0.0, probe_interval=2, cost=_FixedCost(0.003, 0.001))
    outs = [gate.apply(ids, probs, np.array([3, 0, 2]), drafted=True).tolist() for _ in range(6)]
    assert all(o[0] == 3 and o[1] == 0 for o in outs)  # "b" made no draft: kept at 0, never probed
    assert any(o[2] == 1 for o in outs) and "b" not in gate._idle  # "c"'s drafts are cut, it is probed


def test_drafting_mask_skips_requests_whose_first_draft_cannot_pay_except_on_probe_steps():
    probs = np.array([[0.9, 0.9, 0.9], [0.3, 0.3, 0.3], [0.9, 0.9, 0.9]])
    ids = ["a", "b", "c"]
    gate = DraftGate(0.0, probe_interval=4, cost=_FixedCost(0.003, 0.001))  # bar: 0.001 * 3 / 0.006 = 0.5
    assert DraftGate(0.0, 4, cost=StepCostModel()).drafting_mask(probs).all()  # not ready: draft everyone
    assert DraftGate(0.0, 4).drafting_mask(probs).all()  # no cost model
    masks, outs = [], []
    for _ in range(8):
        mask = gate.drafting_mask(probs)
        keep = np.where(mask, [3, 3, 0], 0)  # "c" never has a draft
        masks.append(mask.tolist())
        outs.append(gate.apply(ids, probs, keep, drafted=True, skipped=~mask).tolist())
    # "b" is drafted only on the shared probe steps (every 4th), where it is probed; "c" is never held back
    assert [m[1] for m in masks] == [False, False, False, True] * 2 and all(m[0] and m[2] for m in masks)
    assert [o[1] for o in outs] == [0, 0, 0, 1, 0, 0, 0, 0] and "c" not in gate._idle
    assert all(o[0] == 3 for o in outs) and gate._idle["b"] == 4  # after its failed probe: waits 8 steps now


class _FixedDrafts:
    """A model-free proposer stub: fixed drafts per request; records the lengths it was asked for."""

    deterministic = True

    def __init__(self, drafts: dict[str, list[int]]) -> None:
        self.drafts, self.asked = drafts, []

    def update_requests(self, req_ids, new_token_ids) -> None:
        pass

    def draft_evidence(self):
        return None  # no scores of its own: the gate uses the position statistics

    def propose(self, req_ids, token_ids, max_num_tokens):
        self.asked.append(list(max_num_tokens))
        width = max(max_num_tokens)
        return np.array([(self.drafts[r] + [-1] * width)[:width] for r in req_ids])


def test_runner_drafts_first_then_gates_for_model_free_proposers():
    from types import SimpleNamespace

    from ascent.spec_decode.base import SpeculativeConfig
    from ascent.worker.spec_decode import SpecDecodeRunner

    k, ids = 8, ["a", "b", "c"]
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=k, dynamic=True)
    runner = SpecDecodeRunner(config, 128, "host", None)
    assert runner.dynamic.budget_k < k  # the scheduler's initial shared budget would hold drafts below k
    runner.proposer = stub = _FixedDrafts({"a": list(range(1, 9)), "b": [], "c": [7, 8]})
    batch = SimpleNamespace(num_reqs=3, req_id_to_index={r: i for i, r in enumerate(ids)},
                            token_ids=np.ones((3, 128), dtype=np.int64), num_tokens=np.full(3, 10))
    runner.gate.cost = runner.step_cost = _FixedCost(0.02, 0.0)  # memory-bound: drafts are free
    assert runner.propose(batch, ids, [[], [], []]) == {"a": list(range(1, 9)), "c": [7, 8]}
    assert stub.asked == [[k] * 3]  # drafted at the full length, not the scheduler's budget
    runner.gate.cost = _FixedCost(0.002, 0.001)  # compute-bound: only likely drafts pay
    for _ in range(20):  # "a" always accepted at every position, "c" never
        runner.acceptance.record("a", k, k)
        runner.acceptance.record("c", 2, 0)
    out = runner.propose(batch, ids, [[], [], []])
    assert len(out["a"]) >= 4 and "c" not in out and runner.last_draft_lengths == {"a": len(out["a"]), "b": 0, "c": 0}


def test_gate_batches_probes_and_lets_paid_verification_keep_drafts():
    ids = ["a", "b", "c"]
    probs = np.array([[0.2, 0.2, 0.2], [0.2, 0.2, 0.2], [0.5, 0.5, 0.5]])
    cost = _FixedCost(0.02, 0.0001, 0.05)  # verification is expensive, tokens are cheap
    gate = DraftGate(0.0, probe_interval=4, cost=cost)
    gate._idle["a"] = 2  # "a" went idle before the others
    outs = [gate.apply(ids, probs, np.array([3, 3, 3])).tolist() for _ in range(5)]
    # nothing pays for c alone; "a" is due at the 2nd step but waits for the shared probe step (the 4th), which
    # also probes the by then due "b" and "c": one verifying step
    assert outs == [[0, 0, 0]] * 3 + [[1, 1, 1], [0, 0, 0]]
    gate = DraftGate(0.0, probe_interval=8, cost=cost)
    gate._idle["a"], gate._steps = 7, 6  # "a" due now, the shared probe step next
    outs = [gate.apply(ids, probs, np.array([3, 3, 3])).tolist() for _ in range(3)]
    # "b", "c" not yet half-way: not probed, but once "a"'s probe pays c their cheap drafts ride along
    assert outs == [[0, 0, 0], [1, 2, 3], [0, 0, 0]] and gate._idle == {"a": 1, "b": 1, "c": 1}


# ---------------------------------------------------------------------------------------------------- config
def test_params_defaults_and_validation():
    params = DynamicSpecParams()
    assert params.cost_gate and params.cost_safety_factor == 1.0
    model = params.step_cost_model()
    assert isinstance(model, BatchStepCost) and model.for_batch(3).min_samples == params.cost_min_samples
    assert model.for_batch(2) is model.for_batch(3) is not model.for_batch(4)  # buckets 2-3 and 4-7
    assert DynamicSpecParams.from_dict({"cost_gate": False}).step_cost_model() is None
    DynamicSpecParams.from_dict({"cost_safety_factor": 0, "cost_half_life": 8, "cost_min_samples": 2})
    for bad, match in (({"cost_gate": 1}, "cost_gate"), ({"cost_gate": "yes"}, "cost_gate"),
                       ({"cost_safety_factor": -0.5}, "cost_safety_factor"),
                       ({"cost_safety_factor": "1"}, "cost_safety_factor"),
                       ({"cost_safety_factor": float("nan")}, "cost_safety_factor"),
                       ({"cost_half_life": 0.5}, "cost_half_life"), ({"cost_half_life": True}, "cost_half_life"),
                       ({"cost_min_samples": 1}, "cost_min_samples"), ({"cost_min_samples": 4.0}, "cost_min_samples"),
                       ({"cost_gates": True}, "unknown keys")):
        with pytest.raises(ValueError, match=match):
            DynamicSpecParams.from_dict(bad)


def test_speculative_config_rejects_bad_cost_params():
    from ascent.spec_decode.base import SpeculativeConfig

    with pytest.raises(ValueError, match="cost_safety_factor"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=3, dynamic=True,
                          dynamic_params={"cost_safety_factor": -1})


# ---------------------------------------------------------------------------------------------------- runner timing
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _so(num_reqs: int, drafts_per_req: int, extra_tokens: int = 0) -> SchedulerOutput:
    ids = [f"r{i}" for i in range(num_reqs)]
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={r: 1 + drafts_per_req for r in ids},
                           total_num_scheduled_tokens=num_reqs * (1 + drafts_per_req) + extra_tokens,
                           scheduled_spec_decode_tokens={r: [7] * drafts_per_req for r in ids if drafts_per_req})


def test_runner_times_decode_steps_with_an_injected_clock():
    from ascent.spec_decode.base import SpeculativeConfig
    from ascent.worker.spec_decode import SpecDecodeRunner

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=True,
                               dynamic_params={"cost_min_samples": 4})
    runner = SpecDecodeRunner(config, 128, "host", None)
    assert runner.step_cost is not None and runner.gate is not None and runner.gate.cost is runner.step_cost
    clock = runner.clock = _Clock()
    a, b, overhead = 0.010, 0.002, 0.001
    for i in range(41):
        num_reqs, drafts = (2 + i % 2, i % 3) if i < 40 else (8, 1)  # batch-size bucket 2-3, then one of 8-15
        so = _so(num_reqs, drafts, extra_tokens=50 if i % 10 == 9 else 0)  # prefill steps are not sampled
        with runner.timed_step(so):
            clock.t += a - overhead + b * so.total_num_scheduled_tokens + (0.003 if drafts else 0.0)
        clock.t += overhead + (60.0 if i == 20 else 0.0)  # between steps; once the engine idles for a minute
    model = runner.step_cost.for_batch(3)
    fit_a, fit_b, fit_c = model.coefficients()
    assert fit_c == pytest.approx(0.003, rel=0.3)  # ridge-shrunk on 36 samples of a narrow token range
    assert fit_a == pytest.approx(a, rel=0.05) and fit_b == pytest.approx(b, rel=0.1)  # idle step: busy only
    assert model.num_observed == 40 - 4  # 4 prefill steps (step 39, the last of the bucket, closes at step 40)
    assert runner.step_cost.for_batch(8).num_observed == 0 and not runner.step_cost.for_batch(8).ready
    with runner.timed_step(_so(8, 0)):  # closes the 8-request step
        pass
    assert runner.step_cost.for_batch(15).num_observed == 1 and runner.step_cost.num_observed == 37
    off = SpecDecodeRunner(SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=True,
                                             dynamic_params={"cost_gate": False}), 128, "host", None)
    with off.timed_step(_so(2, 1)):
        pass
    assert off.step_cost is None and off.gate is not None and off.gate.cost is None


# ---------------------------------------------------------------------------------------------------- end to end
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
K = 3


_ScriptedProposer = ScriptedProposer


def _run(llm: LLM, prompts) -> list[list[int]]:
    return run_greedy(llm, prompts, GREEDY)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> dict[tuple[int, ...], list[int]]:
    return plain_continuations(tiny_llama_dir, GREEDY)


def _gated_llm(model_dir: str, plain, cost: StepCostModel | None, real_suffix: bool = False):
    spec = {"method": "suffix" if real_suffix else "ngram", "num_speculative_tokens": K, "dynamic": True,
            "dynamic_params": {"probe_interval": 4, "cost_min_samples": 2}}
    llm = LLM(model=model_dir, speculative_config=spec, dtype="float32", max_model_len=128, disable_log_stats=True)
    runner = llm.llm_engine.engine_core.worker.model_runner.spec
    runner.clock = _Clock()  # frozen: timing samples are all 0 s -> b = 0 unless a fixed model is injected
    proposer = None
    if not real_suffix:
        proposer = _ScriptedProposer(runner.config, 128, plain)
        runner.proposer = proposer
        proposer.gated = {p: [] for p in plain}  # per prompt, the drafts each step kept after the gate
        propose = runner.propose

        def recording_propose(batch, req_ids, new_tokens):
            drafts = propose(batch, req_ids, new_tokens)
            for req_id in req_ids:
                if req_id in proposer.prompt_of:
                    proposer.gated[proposer.prompt_of[req_id]].append(len(drafts.get(req_id, [])))
            return drafts

        runner.propose = recording_propose
    if cost is not None:
        runner.gate.cost = runner.step_cost = cost
    return llm, proposer


def test_greedy_equal_under_the_cost_gate(tiny_llama_dir, plain):
    expected = [plain[tuple(GOOD)], plain[tuple(BAD)]]
    # memory-bound: drafts are nearly free, the good request keeps its full drafts
    llm, proposer = _gated_llm(tiny_llama_dir, plain, _FixedCost(0.02, 1e-5))
    assert _run(llm, [GOOD, BAD]) == expected
    assert max(proposer.gated[tuple(GOOD)]) == K and set(proposer.budgets[tuple(GOOD)]) <= {K, K - 1}
    # mid cost: the always-accepted request keeps drafting, the always-rejected one is cut to probes
    llm, proposer = _gated_llm(tiny_llama_dir, plain, _FixedCost(0.01, 0.004))
    assert _run(llm, [GOOD, BAD]) == expected
    good, bad = proposer.gated[tuple(GOOD)], proposer.gated[tuple(BAD)]
    assert sum(good) > sum(bad) and bad.count(0) > len(bad) // 2
    # fully compute-bound: only probes survive, output unchanged
    llm, proposer = _gated_llm(tiny_llama_dir, plain, _FixedCost(0.0, 0.004))
    assert _run(llm, [GOOD, BAD]) == expected
    assert set(proposer.gated[tuple(BAD)]) <= {0, 1}


def test_greedy_equal_with_real_suffix_and_the_default_timed_gate(tiny_llama_dir, plain):
    llm, _ = _gated_llm(tiny_llama_dir, plain, None, real_suffix=True)
    assert _run(llm, [GOOD, BAD, GOOD]) == [plain[tuple(GOOD)], plain[tuple(BAD)], plain[tuple(GOOD)]]
    assert any(m.ready for m in llm.llm_engine.engine_core.worker.model_runner.spec.step_cost.models.values())


def test_greedy_equal_while_the_goodput_arbiter_alternates_modes(tiny_llama_dir, plain):
    spec = {"method": "suffix", "num_speculative_tokens": K, "dynamic": True,
            "dynamic_params": {"cost_gate": False, "goodput_arbiter": True, "arbiter_window": 2,
                               "arbiter_interval": 2}}
    llm = LLM(model=tiny_llama_dir, speculative_config=spec, dtype="float32", max_model_len=128,
              disable_log_stats=True)
    runner = llm.llm_engine.engine_core.worker.model_runner.spec
    ticks = itertools.count()
    runner.clock = lambda: next(ticks) * 1e-3  # a ticking clock: timed steps, the arbiter explores both modes
    assert _run(llm, [GOOD, BAD]) == [plain[tuple(GOOD)], plain[tuple(BAD)]]
    assert runner.arbiter is not None and min(runner.arbiter.num_steps) > 0
    assert all(r > 0 for r in runner.arbiter.rates(2))  # decode steps of both modes were timed and attributed


# ---------------------------------------------------------------------------------------------------- exploration
def test_best_drafts_takes_the_most_likely_as_row_prefixes():
    survival = np.cumprod(np.array([[0.9] * 24, [0.5] * 24, [0.99] * 24]), axis=1)
    keep = np.array([24, 24, 3])
    out = best_drafts(survival, keep, 16)
    # 0.9^i beats 0.5^j while 0.9^i >= 0.5^j; the third row is held to its 3 kept drafts
    assert out.tolist() == [12, 1, 3] and out.sum() == 16  # 0.9^12 = 0.28 > 0.5^2 = 0.25
    assert best_drafts(survival, keep, 100).tolist() == [24, 24, 3]
    assert best_drafts(survival, keep, 0).tolist() == [0, 0, 0]


def test_gate_explores_a_batch_size_before_its_model_is_ready():
    cost = BatchStepCost(min_samples=4)
    gate = DraftGate(0.0, probe_interval=3, cost=cost)
    ids, keep = ["a", "b"], np.array([24, 24])
    probs = np.array([[0.9] * 24, [0.5] * 24])
    capped = best_drafts(np.cumprod(probs, axis=1), keep, ROW_BLOCK).tolist()
    outs = [gate.apply(ids, probs, keep).tolist() for _ in range(4)]
    # drafting steps carry the max(2 requests, ROW_BLOCK) most likely drafts, every second step none; no probes
    assert outs == [capped, [0, 0], capped, [0, 0]] and sum(capped) == ROW_BLOCK and gate._idle == {}
    for tokens, seconds in ((2, 0.020), (18, 0.020), (2, 0.020), (18, 0.020)):  # memory-bound: drafts free
        cost.for_batch(2).observe(tokens, seconds, verify=tokens > 2)
    assert cost.for_batch(3).ready and not cost.for_batch(4).ready
    assert gate.apply(ids, probs, keep).tolist() == [24, 24]  # the 2-3 bucket's model keeps every draft
    four = gate.apply(["a", "b", "c", "d"], np.repeat(probs, 2, axis=0), np.array([24] * 4))
    assert four.sum() == ROW_BLOCK  # a new batch size explores again
    with pytest.raises(ValueError, match="min_samples"):
        BatchStepCost(min_samples=1)
