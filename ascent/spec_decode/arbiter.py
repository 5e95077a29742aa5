"""Measured arbitration between speculative and plain decoding (the dynamic-speculation safety net).

The draft gate of :mod:`ascent.spec_decode.dynamic` decides per request from a model of the step cost and of the
acceptance; when that model is wrong (a step's cost is not affine in its tokens, acceptance estimates lag, the
proposer's own time is not counted), speculation can be slower than plain decoding. :class:`GoodputArbiter` checks
the outcome directly: it measures the output tokens per second of decode steps run *with* speculation (whatever
the gate kept) and *without* (no drafts, the proposer only learns the committed tokens), separately per batch-size
bucket (``num_reqs.bit_length()``: 1, 2-3, 4-7, 8-15, ...), and runs the faster mode. The rate is per request,
``Σ output tokens / Σ (seconds · requests)``, so the shrinking batch of a draining bucket does not bias it (a
decode step's time grows far less than linearly with its requests).

Schedule per bucket: speculation first, until it has ``min_samples`` timed steps; then ``window`` plain steps; from
then on runs of the faster mode alternate with ``window``-step runs of the other (exploration, so a change of the
workload is noticed). An exploitation run lasts ``interval`` steps, stretched as the measured advantage grows
(``interval · 10 · (ratio - 1)``) up to ``16 × interval`` for speculation and ``4 × interval`` for plain decoding
(a plain run re-checks speculation within ``4 × interval`` steps), and ends at once when the exploited mode's own
rate falls more than ``SWITCH_MARGIN`` below the other's: speculation that stopped paying is noticed within a few
steps. The margin is for batch 1 on repetitive text: the first steps of each response run speculation at about
plain speed, and ending the run on any dip handed 16 steps to plain decoding at the start of many requests (seen in
a trace of the bench workload). Rates are exponentially weighted sums with ``half_life`` steps per mode, so an
exploration window is compared with the recent steps of the winner. Steps timed at 0 s (a frozen test clock) carry
no information and leave the arbiter on speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ascent.spec_decode.step_cost import batch_bucket

SPEC, PLAIN = 0, 1
SWITCH_MARGIN = 0.05  # an exploited run ends early only when its rate falls this far below the other mode's
MAX_STRETCH = {SPEC: 16.0, PLAIN: 4.0}  # per exploited mode: the longest run, in intervals


@dataclass
class _Bucket:
    """Per batch-size bucket: exponentially weighted tokens / seconds / sample counts per mode and the schedule."""

    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # request-seconds
    samples: list[int] = field(default_factory=lambda: [0, 0])
    mode: int = SPEC
    left: int = 0  # steps left in the current run
    exploring: bool = True

    def rate(self, mode: int) -> float:
        return self.tokens[mode] / self.seconds[mode] if self.seconds[mode] > 0 else 0.0


class GoodputArbiter:
    """Chooses speculative or plain decoding per step from measured output tokens per second (module docstring)."""

    def __init__(self, window: int = 4, interval: int = 16, half_life: float = 4.0, min_samples: int = 4) -> None:
        if window < 1 or interval < 1 or min_samples < 1 or not half_life > 0 or not math.isfinite(half_life):
            raise ValueError(f"window={window}, interval={interval}, half_life={half_life}, min_samples="
                             f"{min_samples} are invalid: need window, interval, min_samples >= 1 and a finite "
                             "half_life > 0")
        self.window = window
        self.interval = interval
        self.decay = 0.5 ** (1.0 / half_life)
        self.min_samples = min_samples
        self.num_steps = [0, 0]  # decided steps per mode (telemetry)
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_reqs: int) -> int:
        return batch_bucket(num_reqs)

    def speculate(self, num_reqs: int) -> bool:
        """Decide the mode of the next step of a batch of ``num_reqs`` requests (True: speculate)."""
        state = self._buckets.setdefault(self.bucket_of(num_reqs), _Bucket())
        if state.left <= 0:
            self._next_run(state)
        state.left -= 1
        self.num_steps[state.mode] += 1
        return state.mode == SPEC

    def observe(self, num_reqs: int, output_tokens: int, seconds: float, speculated: bool) -> None:
        """One timed decode step of ``num_reqs`` requests that produced ``output_tokens`` in ``seconds``."""
        if not (seconds > 0 and math.isfinite(seconds)) or output_tokens < 0:
            return
        state = self._buckets.setdefault(self.bucket_of(num_reqs), _Bucket())
        mode = SPEC if speculated else PLAIN
        state.tokens[mode] = self.decay * state.tokens[mode] + output_tokens
        state.seconds[mode] = self.decay * state.seconds[mode] + seconds * max(int(num_reqs), 1)
        state.samples[mode] += 1
        other = 1 - mode
        if (mode == state.mode and not state.exploring and state.samples[other] >= self.min_samples
                and state.rate(mode) < state.rate(other) * (1.0 - SWITCH_MARGIN)):  # fell behind: decide again now
            state.left = 0

    def rates(self, num_reqs: int) -> tuple[float, float]:
        """Measured (speculative, plain) output tokens per request-second of the bucket of ``num_reqs``
        (0: unmeasured)."""
        state = self._buckets.get(self.bucket_of(num_reqs))
        return (state.rate(SPEC), state.rate(PLAIN)) if state is not None else (0.0, 0.0)

    def _next_run(self, state: _Bucket) -> None:
        if state.samples[SPEC] < self.min_samples:  # speculation first (also: an untimed clock stays here)
            state.mode, state.left, state.exploring = SPEC, 1, True
            return
        if state.samples[PLAIN] < self.min_samples:
            state.mode, state.left, state.exploring = PLAIN, self.window, True
            return
        spec, plain = state.rate(SPEC), state.rate(PLAIN)
        best = SPEC if spec >= plain else PLAIN
        if state.exploring or state.mode != best:
            ratio = max(spec, plain) / max(min(spec, plain), 1e-12)
            stretch = min(max(10.0 * (ratio - 1.0), 1.0), MAX_STRETCH[best])
            state.mode, state.left, state.exploring = best, int(self.interval * stretch), False
        else:
            state.mode, state.left, state.exploring = 1 - best, self.window, True
