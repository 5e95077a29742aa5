"""GoodputArbiter: measured choice between speculative and plain decoding (synthetic step times, no wall clock)."""

from __future__ import annotations

import pytest

from ascent.spec_decode.arbiter import GoodputArbiter
from ascent.spec_decode.dynamic import DynamicSpecParams


def _drive(arbiter: GoodputArbiter, steps: int, num_reqs: int, spec_cost, plain_cost) -> list[bool]:
    """Run ``steps`` decisions; a speculative step yields ``spec_cost() = (tokens, seconds)``, a plain one
    ``plain_cost()``. Returns the decisions."""
    modes = []
    for _ in range(steps):
        spec = arbiter.speculate(num_reqs)
        tokens, seconds = spec_cost() if spec else plain_cost()
        arbiter.observe(num_reqs, tokens, seconds, spec)
        modes.append(spec)
    return modes


def test_faster_speculation_is_kept_with_sparse_exploration():
    arb = GoodputArbiter()
    modes = _drive(arb, 600, 4, lambda: (8, 0.020), lambda: (4, 0.015))  # 400 vs 267 tokens/s
    steady = modes[100:]
    assert 0.85 <= sum(steady) / len(steady) < 1.0  # mostly speculating, still re-checking plain
    spec_rate, plain_rate = arb.rates(4)
    assert spec_rate == pytest.approx(8 / (0.020 * 4)) and plain_rate == pytest.approx(4 / (0.015 * 4))


def test_slower_speculation_is_dropped():
    arb = GoodputArbiter()
    modes = _drive(arb, 600, 16, lambda: (18, 0.021), lambda: (16, 0.017))  # 857 vs 941 tokens/s
    steady = modes[100:]
    assert sum(steady) / len(steady) <= 0.2  # plain decoding, with short speculative probes
    assert modes[:4] == [True] * 4  # speculation is measured first


def test_a_change_of_traffic_is_followed_quickly():
    arb = GoodputArbiter()
    _drive(arb, 300, 4, lambda: (8, 0.020), lambda: (4, 0.015))
    after = _drive(arb, 100, 4, lambda: (4.2, 0.020), lambda: (4, 0.015))  # drafts stop being accepted
    assert sum(after[:10]) <= 8 and sum(after[10:]) / len(after[10:]) <= 0.25
    back = _drive(arb, 200, 4, lambda: (8, 0.020), lambda: (4, 0.015))
    assert sum(back[:4 * arb.interval + 2 * arb.window]) > 0  # a plain run re-checks speculation in bounded time
    assert sum(back[100:]) / 100 >= 0.85


def test_buckets_are_independent_and_rates_are_per_request():
    arb = GoodputArbiter()
    _drive(arb, 300, 1, lambda: (2, 0.010), lambda: (1, 0.008))  # batch 1: speculation pays
    _drive(arb, 300, 16, lambda: (17, 0.020), lambda: (16, 0.010))  # batch 16: it does not
    assert arb.rates(1)[0] > arb.rates(1)[1] and arb.rates(16)[0] < arb.rates(16)[1]
    assert arb.rates(20) == arb.rates(16) and arb.rates(40) == (0.0, 0.0)  # bucket 16-31; 32-63 unmeasured
    assert sum(_drive(arb, 100, 1, lambda: (2, 0.010), lambda: (1, 0.008))) >= 85
    assert sum(_drive(arb, 100, 16, lambda: (17, 0.020), lambda: (16, 0.010))) <= 20
    # a draining batch (31 -> 16 requests, one bucket; raw tokens/s halves): per-request rates keep plain ahead
    modes = [m for n in range(31, 15, -1) for m in _drive(arb, 6, n, lambda: (1.06 * n, 0.020), lambda: (n, 0.010))]
    assert sum(modes) / len(modes) <= 0.2


def test_untimed_steps_leave_speculation_on():
    arb = GoodputArbiter()
    assert all(_drive(arb, 200, 3, lambda: (6, 0.0), lambda: (3, 0.0)))  # a frozen clock: no information
    assert arb.rates(3) == (0.0, 0.0)


def test_validation_and_params():
    with pytest.raises(ValueError, match="window=0"):
        GoodputArbiter(window=0)
    with pytest.raises(ValueError, match="half_life=nan"):
        GoodputArbiter(half_life=float("nan"))
    assert isinstance(DynamicSpecParams().arbiter(), GoodputArbiter)  # on by default
    assert DynamicSpecParams(goodput_arbiter=False).arbiter() is None
    arb = DynamicSpecParams(goodput_arbiter=True, arbiter_window=2, arbiter_interval=8).arbiter()
    assert arb is not None and (arb.window, arb.interval) == (2, 8)
    for bad in ({"goodput_arbiter": 1}, {"arbiter_window": 0}, {"arbiter_interval": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DynamicSpecParams.from_dict(bad)
