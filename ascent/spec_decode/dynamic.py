"""Dynamic speculation: batch-size schedules and the DynamicSpecScheduler (per-request draft lengths).

Batch-size schedule (vLLM ``num_speculative_tokens_per_batch_size``): inclusive ranges ``[start, end, K]`` that must
start at 1 and not overlap; gaps and the tail inherit the previous K; K is clamped to the configured maximum.

DynamicSpecScheduler (vLLM Ascend's, for DFlash/DSpark; here fed by any per-position acceptance estimate): for
``token_probs [B, D]`` (estimated P(draft i accepted | prefix accepted)), ``survival = cumprod`` is the probability
that the prefix through position i is accepted. Every request keeps ``min_k`` drafts; the remaining shared budget
``B * (budget_k - min_k)`` goes to the globally largest survival values in columns ``>= min_k`` (a prefix per row,
since survival is non-increasing). Every ``budget_update_interval`` steps ``budget_k`` becomes
``ceil(#(survival >= budget_threshold) / B)``, bumped to the next odd value when even and ``< D``, clamped to
``[min_k, D]``. ``AcceptanceStats`` turns verification outcomes of model-free proposers into ``token_probs``.

Ascent extensions (``dynamic_params``): ``min_draft_survival`` (default 0 = off) cuts every request's draft to the
positions whose survival is at least that value, so a request whose drafts are persistently rejected drafts nothing
(non-repetitive traffic then runs at plain-decoding cost); ``probe_interval`` (default 16): a request held at 0
drafts (by that cut, or by ``min_verify_tokens = 0`` with a zero budget) drafts one token on every
``probe_interval``-th step so its statistics can recover (:class:`DraftGate`); a probe that does not earn the
request its drafts back doubles its wait for the next one, up to ``PROBE_BACKOFF`` times ``probe_interval``, and
once the cost model is ready due probes wait for a shared probe step (every ``probe_interval``-th): each verifying
step pays the fixed cost ``c`` below, and staggered probes of non-repetitive requests had made most steps of a
compute-bound batch verifying ones. Nor are requests probed at a batch size where a lone first draft would need a
survival above ``MAX_PROBE_BAR`` to pay: there a probe costs a token of a compute-bound step and could only reveal
drafts that still would not pay (at 16 requests on 2 cores this cost about 3 % of non-repetitive throughput).
``batch_size_k`` is the per-step cap of the batch-size schedule.

Cost-aware gate (``cost_gate``, default on): the model runner times every decode step and feeds a
:class:`~ascent.spec_decode.step_cost.StepCostModel` (``t_step ≈ a + b · tokens + c · [drafts]``, exponentially
weighted with ``cost_half_life`` steps, one per batch-size bucket, active after ``cost_min_samples`` steps of that
bucket, explored until then); :class:`DraftGate` then keeps a draft only while its survival ``s`` pays for its
verification, ``s ≥ cost_safety_factor · b · G / (a + b · N)`` (``N``: tokens of the step, ``G``: its expected
output), and only when the step's drafts together also pay the fixed cost ``c`` of a verifying step
(:func:`~ascent.spec_decode.step_cost.cost_cut`); probes of idle requests are batched into the same step. For
model-free proposers (suffix, n-gram) the runner drafts first and the gate cuts the drafts made, in place of the
scheduler's shared budget (which still applies to model drafters and with ``cost_gate: false``). Memory-bound steps
(batch 1) keep nearly every draft, compute-bound ones (large batches on few cores) only the likely ones. For a
proposer that scores its own drafts (suffix decoding) the survival is each draft's own, from
:class:`~ascent.spec_decode.calibration.DraftCalibration` (``calibrate_drafts``, default on), instead of the request's
per-position curve.

Goodput arbiter (``goodput_arbiter``, default on): a safety net over all of the above, which are models. The runner
measures output tokens per second of decode steps with speculation and of interleaved windows without it, per
batch-size bucket, and speculates only while that is measured to be faster (:mod:`ascent.spec_decode.arbiter`).
Where the gate's model of a compute-bound step is off by a few percent (16 requests on 2 cores: drafts accepted at
0.8-0.9 barely break even there) the arbiter turns speculation off, and with it most of the per-step bookkeeping.
Measured on the bench workloads (SmolLM2, 2 cores, 8 rounds, same run): at 16 concurrent requests 0.974x / 0.968x
(repetitive / non-repetitive) with it against 0.931x / 0.958x without; at 8, 1.07x / 1.005x against 1.08x / 0.98x;
at 1 its price showed: 2.12-2.24x against 2.26-2.28x on repetitive text (the first steps of each response run
speculation at about plain speed, and its plain windows follow those dips), so the runner no longer consults it where
the step-cost model shows a memory-bound step (``ARBITER_MIN_TOKEN_SHARE`` in :mod:`ascent.worker.spec_decode`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ascent.spec_decode.acceptance import AcceptanceStats  # re-exported: the dynamic-speculation API
from ascent.spec_decode.arbiter import GoodputArbiter
from ascent.spec_decode.step_cost import (EXPLORE_MIN_DRAFTS, BatchStepCost, StepCostModel, best_drafts, cost_cut,
                                          row_blocks)

Schedule = list[tuple[int, int, int]]
PROBE_BACKOFF = 4  # a failed probe doubles the request's probe interval, up to this multiple of probe_interval
MAX_PROBE_BAR = 0.6  # no probes where a lone first draft needs a higher survival to pay (compute-bound batches)


def validate_batch_size_schedule(schedule: Any) -> Schedule:
    """Normalize ``[[start, end, K], ...]`` (sorted by start); ValueError naming the offending entry."""
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"{name}={schedule!r} is invalid: must be a non-empty list of [start, end, K] entries")
    parsed: Schedule = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise ValueError(f"{name} entry {entry!r} is invalid: must be 3 integers [start, end, K]")
        start, end, k = entry
        if start <= 0 or end < start or k < 0:
            raise ValueError(f"{name} entry {list(entry)} is invalid: need 1 <= start <= end and K >= 0")
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    if parsed[0][0] != 1:
        raise ValueError(f"{name}={schedule!r} is invalid: the first range must start at batch size 1")
    for prev, cur in zip(parsed, parsed[1:]):
        if cur[0] <= prev[1]:
            raise ValueError(f"{name} ranges {list(prev)} and {list(cur)} overlap")
    return parsed


def build_batch_size_lookup(schedule: Any, max_batch_size: int, max_k: int) -> list[int]:
    """Dense lookup: ``lookup[batch_size]`` = K for ``1 <= batch_size <= max_batch_size``; ``lookup[0] = 0``.
    Indexing past ``max_batch_size`` raises IndexError."""
    if max_batch_size < 1 or max_k < 1:
        raise ValueError(f"max_batch_size={max_batch_size}, max_k={max_k} are invalid: both must be >= 1")
    lookup = [0] * (max_batch_size + 1)
    ranges = validate_batch_size_schedule(schedule)
    for i, (start, end, k) in enumerate(ranges):
        stop = ranges[i + 1][0] - 1 if i + 1 < len(ranges) else max_batch_size
        for bs in range(start, min(stop, max_batch_size) + 1):
            lookup[bs] = min(k, max_k)
    return lookup


def batch_size_k(schedule: Schedule, batch_size: int, max_k: int) -> int:
    """K of the (validated) batch-size schedule for ``batch_size`` running requests: the range containing it, else
    the closest range starting below it (gaps and the tail inherit); 0 for an empty batch; clamped to ``max_k``."""
    k = 0
    for start, _end, value in schedule:
        if start > batch_size:
            break
        k = value
    return min(k, max_k) if batch_size > 0 else 0


@dataclass(frozen=True)
class DynamicSpecParams:
    """vLLM Ascend ``dynamic_spec_config.method_params`` (defaults as there) plus the ascent extensions
    ``min_draft_survival``, ``probe_interval``, the cost-aware gate ``cost_gate``, ``cost_safety_factor``,
    ``cost_half_life``, ``cost_min_samples`` (module docstring), the measured arbitration ``goodput_arbiter``,
    ``arbiter_window``, ``arbiter_interval`` (:mod:`ascent.spec_decode.arbiter`) and ``calibrate_drafts``: per-draft
    estimates from a proposer's own evidence (:mod:`ascent.spec_decode.calibration`)."""

    initial_verify_budget_per_req: int = 5
    budget_update_interval: int = 16
    budget_threshold: float = 0.3
    min_verify_tokens: int = 1
    min_draft_survival: float = 0.0
    probe_interval: int = 16
    cost_gate: bool = True
    cost_safety_factor: float = 1.0
    cost_half_life: float = 64.0
    cost_min_samples: int = 8
    goodput_arbiter: bool = True
    calibrate_drafts: bool = True
    arbiter_window: int = 4
    arbiter_interval: int = 16

    def __post_init__(self) -> None:
        for name, lo in (("initial_verify_budget_per_req", 0), ("budget_update_interval", 1),
                         ("min_verify_tokens", 0), ("probe_interval", 1), ("arbiter_window", 1),
                         ("arbiter_interval", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= {lo}")
        for name in ("budget_threshold", "min_draft_survival"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
                raise ValueError(f"{name}={t!r} is invalid: must be in [0, 1]")
        for name in ("cost_gate", "goodput_arbiter", "calibrate_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be true or false")
        for name, lo, hi in (("cost_safety_factor", 0.0, 100.0), ("cost_half_life", 1.0, 1e6)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"{name}={v!r} is invalid: must be a number in [{lo:g}, {hi:g}]")
        v = self.cost_min_samples
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"cost_min_samples={v!r} is invalid: must be an integer >= 2")

    def arbiter(self) -> GoodputArbiter | None:
        """A fresh :class:`GoodputArbiter` (None when ``goodput_arbiter`` is off)."""
        if not self.goodput_arbiter:
            return None
        return GoodputArbiter(window=self.arbiter_window, interval=self.arbiter_interval)

    def step_cost_model(self) -> BatchStepCost | None:
        """Fresh per-batch-size step-cost models for the cost-aware gate (None when ``cost_gate`` is off)."""
        if not self.cost_gate:
            return None
        return BatchStepCost(half_life=float(self.cost_half_life), min_samples=self.cost_min_samples)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DynamicSpecParams:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"dynamic_params has unknown keys {unknown}")
        return cls(**values)


def survival_of(token_probs: np.ndarray) -> np.ndarray:
    """float64 ``[B, D]`` conditional acceptance estimates -> their running products, each factor clamped to
    ``[1e-6, 1]`` (the cumulative probability that the draft prefix through each position is accepted)."""
    return np.cumprod(np.minimum(np.maximum(token_probs, 1e-6), 1.0), axis=1)


class DynamicSpecScheduler:
    """Per-request verify lengths within a shared budget (host numpy; one instance per engine)."""

    def __init__(self, num_speculative_tokens: int, params: DynamicSpecParams | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} is invalid: must be >= 1")
        self.params = params or DynamicSpecParams()
        self.max_k = num_speculative_tokens
        self.min_k = min(self.params.min_verify_tokens, self.max_k)
        self.budget_k = max(self.min_k, min(self.params.initial_verify_budget_per_req, self.max_k))
        self._steps_since_update = 0

    def update(self, token_probs: np.ndarray) -> np.ndarray:
        """``token_probs`` float ``[B, D]`` (D == num_speculative_tokens) -> keep lengths int32 ``[B]`` in
        ``[min_k, D]`` with ``sum <= B * budget_k``. Advances the budget-update clock by one step."""
        probs = np.asarray(token_probs, dtype=np.float64)
        if probs.ndim != 2 or probs.shape[1] != self.max_k:
            raise ValueError(f"token_probs shape {probs.shape} is invalid: expected [B, {self.max_k}]")
        survival = survival_of(probs)
        self._maybe_update_budget(survival)
        return self.allocate(survival)

    def _maybe_update_budget(self, survival: np.ndarray) -> None:
        self._steps_since_update += 1
        if self._steps_since_update < self.params.budget_update_interval or survival.shape[0] == 0:
            return
        self._steps_since_update = 0
        budget = math.ceil(float((survival >= self.params.budget_threshold).sum()) / survival.shape[0])
        if budget % 2 == 0 and budget < self.max_k:
            budget += 1
        self.budget_k = max(self.min_k, min(budget, self.max_k))

    def allocate(self, survival: np.ndarray) -> np.ndarray:
        """Keep lengths for ``survival [B, D]`` under the current ``budget_k`` (ties -> earlier column, then row)."""
        num_reqs, d = survival.shape
        keep = np.full(num_reqs, self.min_k, dtype=np.int64)
        window = survival[:, self.min_k:]
        extra = min(num_reqs * max(self.budget_k - self.min_k, 0), window.size)
        if extra >= window.size:  # the budget covers every column
            keep += window.shape[1]
        elif extra > 0:
            rows, cols = np.indices(window.shape)
            order = np.lexsort((rows.ravel(), cols.ravel(), -window.ravel()))[:extra]
            keep += np.bincount(rows.ravel()[order], minlength=num_reqs)
        return np.minimum(keep, d).astype(np.int32)


class DraftGate:
    """Per-request cut of the scheduler's keep lengths by estimated survival and step cost, with re-probing.

    ``apply`` keeps, per request, ``min(keep, #(survival >= min_survival))`` drafts (a prefix: survival is
    non-increasing); with a ready ``cost`` model the drafts that do not pay for their verification are cut as well
    (:func:`~ascent.spec_decode.step_cost.cost_cut`, marginal costs times ``cost_safety``). ``keep`` is either the
    scheduler's budget (drafting follows) or, with ``drafted``, the lengths of the drafts a model-free proposer has
    already made: the runner drafts first for those (at batch 1 the scheduler's budget of ``#(survival >=
    budget_threshold)`` positions had held suffix decoding to AL 2.4 where its whole matches gave AL 3.0), and a
    request without a draft is then neither idle nor probed. A request left at 0
    drafts counts its idle steps; on the ``probe_interval``-th it gets one draft (a probe of the first position), so
    a request whose text turns repetitive is noticed again; a probe after which it is still cut doubles its interval
    (up to ``PROBE_BACKOFF`` times), drafting again restores it. Under the cost cut, due probes wait for the shared
    probe step (every ``probe_interval``-th ``apply``), which also probes the idle requests at least half-way to
    their probe (one verifying step instead of several). ``cost`` is asked for the model of each step's batch size
    (``for_batch``); while that model is not ready the step explores instead (every second one without drafts, the
    others with at most ``max(requests, EXPLORE_MIN_DRAFTS)`` of the most likely drafts; no probe bookkeeping).
    """

    def __init__(self, min_survival: float = 0.0, probe_interval: int = 16,
                 cost: StepCostModel | BatchStepCost | None = None,
                 cost_safety: float = 1.0) -> None:
        if not 0.0 <= min_survival <= 1.0 or probe_interval < 1 or not cost_safety >= 0:
            raise ValueError(f"min_survival={min_survival}, probe_interval={probe_interval}, cost_safety="
                             f"{cost_safety} are invalid: need 0 <= min_survival <= 1, probe_interval >= 1 and "
                             "cost_safety >= 0")
        self.min_survival = float(min_survival)
        self.probe_interval = probe_interval
        self.cost = cost
        self.cost_safety = float(cost_safety)
        self.num_cost_cut = 0  # drafts removed by the cost cut (telemetry)
        self.max_probe_interval = PROBE_BACKOFF * probe_interval
        self._idle: dict[str, int] = {}
        self._interval: dict[str, int] = {}  # backed-off probe intervals (absent: probe_interval)
        self._probed: set[str] = set()  # requests probed at the last apply
        self._steps = 0  # apply calls; under the cost model probes happen every probe_interval-th

    def drafting_mask(self, token_probs: np.ndarray) -> np.ndarray:
        """bool ``[B]``: the requests worth drafting for the next :meth:`apply` (``drafted``) with this batch. All of
        them, except on a ready cost model's steps that are not a shared probe step: there a request whose first
        draft cannot pay even alone, ``s_1 < cost_safety · b · B / (a + b · B + e · blocks(B))`` (the most lenient
        bar: the rate of the step without drafts), gets no draft from the cost cut whatever the proposer makes, so
        the proposer need not run for it (pass the complement as ``skipped``)."""
        probs = np.asarray(token_probs, dtype=np.float64)
        num_reqs = probs.shape[0]
        model = self.cost.for_batch(num_reqs) if self.cost is not None and num_reqs > 0 else None
        if model is None or not model.ready or (self._steps + 1) % self.probe_interval == 0:
            return np.ones(num_reqs, dtype=bool)
        return np.minimum(probs[:, 0], 1.0) >= self._first_draft_bar(model, num_reqs)

    def _first_draft_bar(self, model: StepCostModel, num_reqs: int) -> float:
        """The survival a lone first draft needs to pay at this batch size (the rate of the step without drafts)."""
        a, b, _ = model.coefficients()
        plain = a + b * num_reqs + model.row_block_cost() * row_blocks(num_reqs)
        return self.cost_safety * b * num_reqs / plain if plain > 0 else 0.0

    def apply(self, req_ids: Sequence[str], token_probs: np.ndarray, keep: np.ndarray,
              drafted: bool = False, skipped: np.ndarray | None = None) -> np.ndarray:
        """``token_probs [B, D]`` (as for :meth:`DynamicSpecScheduler.update`), ``keep [B]`` -> gated lengths
        (``drafted``: ``keep`` are the lengths of drafts already made; ``skipped``: bool ``[B]``, requests left
        undrafted by :meth:`drafting_mask`, which count as cut, not as having nothing to draft)."""
        survival = survival_of(np.asarray(token_probs, dtype=np.float64))
        keep = np.asarray(keep, dtype=np.int64)
        model = self.cost.for_batch(len(keep)) if self.cost is not None and len(keep) > 0 else None
        out = np.minimum(keep, (survival >= self.min_survival).sum(axis=1)) if self.min_survival > 0 else keep.copy()
        cut_from = out.copy()
        if model is not None and not model.ready:  # learn this batch size's costs first
            if model.exploring_plain():
                return np.zeros_like(out)
            return best_drafts(survival, out, max(len(out), EXPLORE_MIN_DRAFTS))
        costed = model is not None
        if model is not None:
            out = self._cost_cut(model, survival, cut_from, 0)
        probes: list[int] = []
        empty = (keep == 0) & ~skipped if drafted and skipped is not None else keep == 0
        for i, req_id in enumerate(req_ids):
            probed = req_id in self._probed
            self._probed.discard(req_id)
            if out[i] > 0 or (drafted and empty[i]):  # drafting, or nothing to draft: not held back
                self._idle.pop(req_id, None)
                self._interval.pop(req_id, None)
                continue
            if probed:  # its probe did not earn it drafts: wait twice as long for the next one (up to the cap)
                self._interval[req_id] = min(2 * self._interval_of(req_id), self.max_probe_interval)
            idle = self._idle.get(req_id, 0) + 1
            self._idle[req_id] = idle
            if idle >= self._interval_of(req_id):
                probes.append(i)
        self._steps += 1
        if probes and costed and self._steps % self.probe_interval:
            probes = []  # under the cost model, due probes wait for the shared probe step (one fixed cost for all)
        if probes and costed and self._first_draft_bar(model, len(keep)) > MAX_PROBE_BAR:
            probes = []  # a probe could not earn drafts that pay here: only near-certain drafts do
        if probes and costed:  # one verifying step pays the fixed cost for all: probe the half-due ones with it
            probes += [i for i, r in enumerate(req_ids) if out[i] == 0 and i not in probes
                       and self._idle.get(r, 0) >= max(1, self._interval_of(r) // 2)]
        for i in probes:
            out[i] = 1
            self._idle[req_ids[i]] = 0
            self._probed.add(req_ids[i])
        if probes and costed:  # the step verifies anyway: drafts that only failed to pay the fixed cost may pay now
            rest = cut_from.copy()
            rest[probes] = 0
            assert model is not None
            extra = self._cost_cut(model, survival, rest, len(probes))
            for i in np.flatnonzero(extra > out):
                out[i] = extra[i]
                self._idle.pop(req_ids[i], None)
        return out

    def _interval_of(self, req_id: str) -> int:
        return self._interval.get(req_id, self.probe_interval)

    def _cost_cut(self, model: StepCostModel, survival: np.ndarray, keep: np.ndarray, forced: int) -> np.ndarray:
        a, b, c = model.coefficients()
        cut = cost_cut(survival, keep, a, b, c, self.cost_safety, forced_drafts=forced, e=model.row_block_cost())
        self.num_cost_cut += int(keep.sum() - cut.sum())
        return cut

    def remove(self, req_id: str) -> None:
        self._idle.pop(req_id, None)
        self._interval.pop(req_id, None)
        self._probed.discard(req_id)
