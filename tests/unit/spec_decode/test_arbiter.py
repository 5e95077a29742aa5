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
    assert sum(after[:10]) <= 9 and sum(after[10:]) / len(after[10:]) <= 0.25  # (9: the SWITCH_MARGIN step)
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


def _runs(modes: list[bool]) -> list[tuple[bool, int]]:
    """Run-length encoding of a decision sequence."""
    runs: list[tuple[bool, int]] = []
    for m in modes:
        runs = runs[:-1] + [(m, runs[-1][1] + 1)] if runs and runs[-1][0] == m else runs + [(m, 1)]
    return runs


def test_a_clear_winner_is_exploited_longer_for_speculation_than_for_plain():
    """Speculation three times as fast: runs of 16 intervals between 4-step plain windows (the exploration costs
    ~1/64 of the steps); plain twice as fast: runs of at most 4 intervals, so speculation is re-checked in bounded time."""
    arb = GoodputArbiter(window=4, interval=16)
    runs = _runs(_drive(arb, 1200, 1, lambda: (3, 0.010), lambda: (1, 0.010)))  # 3x: stretch 20, capped at 16
    spec_runs = [n for m, n in runs[2:] if m]
    assert spec_runs and max(spec_runs) == 16 * 16 and all(n == 4 for m, n in runs[2:] if not m)
    arb = GoodputArbiter(window=4, interval=16)
    runs = _runs(_drive(arb, 1200, 16, lambda: (16, 0.040), lambda: (16, 0.020)))  # 2x: stretch 10, capped at 4
    plain_runs = [n for m, n in runs[3:] if not m]  # (runs[1] is the first plain window merged with its run)
    assert plain_runs and max(plain_runs) == 4 * 16


def test_a_dip_within_the_margin_does_not_end_a_speculative_run():
    """Speculation 2x plain, then a few steps at plain speed (the start of a response): the run goes on; a drop far
    below plain ends it at once."""
    from ascent.spec_decode.arbiter import SWITCH_MARGIN

    assert SWITCH_MARGIN > 0.025  # (the dip below is 2.5 %)
    arb = GoodputArbiter(window=4, interval=16)
    _drive(arb, 200, 1, lambda: (2, 0.010), lambda: (1, 0.010))
    assert arb.speculate(1)  # mid-run
    dip = _drive(arb, 40, 1, lambda: (0.975, 0.010), lambda: (1, 0.010))
    assert all(dip)
    drop = _drive(arb, 12, 1, lambda: (0.5, 0.010), lambda: (1, 0.010))
    assert not all(drop[:8])
