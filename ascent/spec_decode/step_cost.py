"""Online step-cost model ``t_step ≈ a + b · num_tokens + c · [step verifies drafts] + e · ⌈num_tokens / 16⌉`` and the
cost-aware draft cut.

:class:`StepCostModel` fits the wall time of an engine step as an affine function of the tokens it computes plus a
fixed verification overhead ``c`` paid by any step that carries drafts (multi-token attention paths, logits of every
verified position, the rejection sampler), with an exponentially weighted least-squares fit (weights halve every
``half_life`` observations; O(1) memory: the 4×4 weighted normal equations). The fourth term ``e`` charges every
started block of ``ROW_BLOCK`` (16) tokens: the GEMMs run in 16-row tiles, so a step of 17 tokens costs a second tile
pass over every weight (measured on SmolLM2 with AMX, 2 threads: 8.8 ms at 14-16 rows, 10.0 ms at 17), a jump an affine
fit spreads over all tokens. Robustness: the first ``min_samples`` observations are buffered and fitted after dropping
those above ``3 ×`` their median (compilation, first-touch); afterwards every residual is winsorized to ``outlier_scale
×`` an exponentially weighted mean absolute residual (at least ``5 %`` of the prediction), so an idle gap or a hiccup
of a shared machine moves the fit by a bounded amount while a real shift of the cost is still followed within a few
half-lives. ``b``, ``c``, ``e`` are ridge-shrunk towards 0 (``prior_weight``, negligible once the data vary) and all
coefficients are kept ``>= 0``: while the data cannot tell (constant token count, or every step verifying), drafts are
assumed free, which keeps speculation on until variation shows what it costs.

:func:`cost_cut` is the throughput-optimal draft allocation for a step under that model. With ``B`` requests, the step
emits ``G = B + Σ s`` tokens in expectation (``s``: cumulative acceptance survival of each kept draft) and costs ``T =
a + b · N + c · [any draft] + e · ⌈N / 16⌉`` (``N = B + #drafts``). Without ``c`` a draft raises the throughput ``G /
T`` iff ``s ≥ b · G / (a + b · N)``: the expected output of one more verified token must cover its marginal cost in the
step's current output per unit time. For a given number of drafts the best ones are the most likely (cost depends on
the count only), so the cut scans the drafts by decreasing survival and keeps the count with the best ``G / T`` (0
included: a few low-survival drafts do not pay for ``c``, nor for a row block they would start); per request the kept
drafts are a prefix, since survival is non-increasing along a draft. At batch 1 on a memory-bound step (``a ≫ b``)
nearly every draft is kept; on a compute-bound step with many requests (``a ≲ b · B``) only near-certain drafts
survive. ``safety`` multiplies the marginal costs of the drafts (> 1: keep fewer, a margin for a noisy fit or
optimistic acceptance estimates).

:class:`BatchStepCost` keeps one model per batch-size bucket (``num_reqs.bit_length()``: 1, 2-3, 4-7, 8-15, ...):
the cost of a token is not one number over all batch sizes (a step of a few requests streams the weights and tokens
are nearly free; at 16 requests on 2 cores each token costs real GEMM time), and one affine fit over a draining
batch mixed both. Until a bucket's model is ready the gate explores it (:meth:`StepCostModel.exploring_plain`):
alternate steps carry no drafts and at most ``max(requests, EXPLORE_MIN_DRAFTS)`` drafts, so the fit sees how the
step's time moves with its tokens at that batch size before it decides; the former single model, ready after a few
warm-up steps at batch 1-2, had let the first steps of a 16-request batch verify 30 drafts each at 3x a plain step's
time.
"""

from __future__ import annotations

import math

import numpy as np

ROW_BLOCK = 16  # tokens per row block of the step's GEMMs (AMX tiles: a 17th row starts a second tile pass)
EXPLORE_MIN_DRAFTS = ROW_BLOCK  # an exploring step may carry up to max(requests, this) drafts


class StepCostModel:
    """Exponentially weighted, outlier-robust least squares ``seconds ≈ a + b · num_tokens + c · verify``."""

    def __init__(self, half_life: float = 64.0, min_samples: int = 8, outlier_scale: float = 4.0,
                 prior_weight: float = 1.0) -> None:
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0 \
                or not math.isfinite(half_life):
            raise ValueError(f"half_life={half_life!r} is invalid: must be a finite number > 0 (steps)")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
            raise ValueError(f"min_samples={min_samples!r} is invalid: must be an integer >= 2")
        if not outlier_scale > 0 or not prior_weight >= 0:
            raise ValueError(f"outlier_scale={outlier_scale!r}, prior_weight={prior_weight!r} are invalid: need "
                             "outlier_scale > 0 and prior_weight >= 0")
        self.decay = 0.5 ** (1.0 / float(half_life))
        self.min_samples = min_samples
        self.outlier_scale = float(outlier_scale)
        self.prior_weight = float(prior_weight)
        self.num_observed = 0
        self.num_clipped = 0
        self._warmup: list[tuple[float, float, float]] = []
        self._xtx = np.zeros((4, 4))  # EW sums of f fᵀ, f = (1, num_tokens, verify, row blocks)
        self._xty = np.zeros(4)  # EW sums of f · seconds
        self._coef: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self._abs_resid = 0.0  # EW mean absolute residual (winsorized)
        self._explored = 0  # exploration decisions made before ready (exploring_plain)

    # ------------------------------------------------------------------------------------------------ updates
    def observe(self, num_tokens: float, seconds: float, verify: bool = False) -> None:
        """One step that computed ``num_tokens`` tokens in ``seconds``; ``verify``: it carried drafts (non-finite
        or negative samples are ignored)."""
        x, y, d = float(num_tokens), float(seconds), 1.0 if verify else 0.0
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
        self.num_observed += 1
        if not self.ready:
            self._warmup.append((x, y, d))
            if len(self._warmup) >= self.min_samples:
                self._initialize()
            return
        pred = self.predict(x, bool(d))
        limit = self.outlier_scale * max(self._abs_resid, 0.05 * pred, 1e-9)
        resid = y - pred
        if abs(resid) > limit:
            self.num_clipped += 1
            resid = math.copysign(limit, resid)
        self._abs_resid = self.decay * self._abs_resid + (1.0 - self.decay) * abs(resid)
        self._add(x, pred + resid, d)
        self._solve()

    def _initialize(self) -> None:
        median = float(np.median([y for _, y, _ in self._warmup]))
        kept = [s for s in self._warmup if s[1] <= 3.0 * median] or self._warmup
        self.num_clipped += len(self._warmup) - len(kept)
        self._warmup = []
        for x, y, d in kept:
            self._add(x, y, d)
        self._solve()
        self._abs_resid = float(np.mean([abs(y - self.predict(x, bool(d))) for x, y, d in kept]))

    def _add(self, x: float, y: float, d: float) -> None:
        f = np.array([1.0, x, d, row_blocks(x)])
        self._xtx *= self.decay
        self._xty *= self.decay
        self._xtx += np.outer(f, f)
        self._xty += f * y

    def _solve(self) -> None:
        """Ridge least squares with ``a, b, c >= 0`` (a coefficient that comes out negative is fixed at 0 and the
        others refitted)."""
        free = [0, 1, 2, 3]
        coef = np.zeros(4)
        ridge = np.diag([0.0, self.prior_weight, self.prior_weight, self.prior_weight])
        while free:
            idx = np.array(free)
            m = self._xtx[np.ix_(idx, idx)] + ridge[np.ix_(idx, idx)] + 1e-12 * np.eye(len(idx))
            try:  # symmetric positive definite (normal equations + ridge): a direct solve, 5x cheaper than lstsq
                sol = np.linalg.solve(m, self._xty[idx])
            except np.linalg.LinAlgError:
                sol = np.linalg.lstsq(m, self._xty[idx], rcond=None)[0]
            if (sol >= 0).all():
                coef[idx] = sol
                break
            free.remove(free[int(np.argmin(sol))])
        self._coef = (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))

    # ------------------------------------------------------------------------------------------------ queries
    def for_batch(self, num_reqs: int) -> "StepCostModel":
        """The model for steps of ``num_reqs`` requests: this one (:class:`BatchStepCost` keeps one per bucket)."""
        return self

    def exploring_plain(self) -> bool:
        """Before ``ready``: whether the next step should carry no drafts (every second decision, starting with a
        drafting step), so the fit sees steps with and without drafts at the same batch size."""
        self._explored += 1
        return self._explored % 2 == 0

    @property
    def ready(self) -> bool:
        """True once ``min_samples`` observations were fitted."""
        return self._xtx[0, 0] > 0.0

    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)``: seconds per step, per token, and per verifying step; all ``>= 0`` (zeros before
        ``ready``)."""
        return self._coef[:3]

    def row_block_cost(self) -> float:
        """``e``: seconds per started block of ``ROW_BLOCK`` tokens (``>= 0``; 0 before ``ready``)."""
        return self._coef[3]

    def predict(self, num_tokens: float, verify: bool = False) -> float:
        """Predicted seconds of a step with ``num_tokens`` tokens (``verify``: carrying drafts)."""
        a, b, c, e = self._coef
        return a + b * float(num_tokens) + (c if verify else 0.0) + e * row_blocks(num_tokens)

    def marginal_ratio(self, num_tokens: float) -> float:
        """``b / (a + b · num_tokens)``: one more token's cost as a fraction of a step (0 before ``ready``)."""
        a, b, _, _ = self._coef
        total = a + b * float(num_tokens)
        return b / total if total > 0 else 0.0


def row_blocks(num_tokens: float) -> float:
    """Started blocks of ``ROW_BLOCK`` tokens: ``⌈num_tokens / ROW_BLOCK⌉``."""
    return float(math.ceil(float(num_tokens) / ROW_BLOCK))


def batch_bucket(num_reqs: int) -> int:
    """Batch-size bucket ``num_reqs.bit_length()``: 1, 2-3, 4-7, 8-15, ... (0 for an empty batch)."""
    return max(int(num_reqs), 0).bit_length()


class BatchStepCost:
    """One :class:`StepCostModel` per batch-size bucket ``num_reqs.bit_length()`` (module docstring), created on
    first use with the same parameters."""

    def __init__(self, **model_kwargs: float | int) -> None:
        StepCostModel(**model_kwargs)  # validate now, not at the first step
        self._kwargs = model_kwargs
        self.models: dict[int, StepCostModel] = {}

    def for_batch(self, num_reqs: int) -> StepCostModel:
        """The model of ``num_reqs``'s bucket (a fresh, unready one the first time)."""
        bucket = batch_bucket(num_reqs)
        model = self.models.get(bucket)
        if model is None:
            model = self.models[bucket] = StepCostModel(**self._kwargs)  # type: ignore[arg-type]
        return model

    @property
    def num_observed(self) -> int:
        return sum(m.num_observed for m in self.models.values())


def ranked_drafts(survival: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept drafts (``keep [B]`` per row of ``survival [B, D]``) as (rows, survival values), by decreasing
    survival, ties to the earlier column then row: any leading count of them is a prefix of every row."""
    width = survival.shape[1]
    rows_idx, cols_idx = np.nonzero(np.arange(width)[None, :] < keep[:, None])
    values = survival[rows_idx, cols_idx]
    order = np.lexsort((rows_idx, cols_idx, -values))
    return rows_idx[order], values[order]


def best_drafts(survival: np.ndarray, keep: np.ndarray, count: int) -> np.ndarray:
    """int64 ``[B]``: the ``count`` most likely of the kept drafts (all of them when fewer), a prefix per row."""
    keep = np.minimum(np.maximum(np.asarray(keep, dtype=np.int64), 0), survival.shape[1])
    rows_idx, _ = ranked_drafts(np.asarray(survival, dtype=np.float64), keep)
    return np.bincount(rows_idx[:max(int(count), 0)], minlength=len(keep)).astype(np.int64)


def cost_cut(survival: np.ndarray, keep: np.ndarray, a: float, b: float, c: float = 0.0, safety: float = 1.0,
             forced_drafts: int = 0, e: float = 0.0) -> np.ndarray:
    """Throughput-optimal cut of the per-request draft lengths ``keep [B]`` given cumulative acceptance survival
    ``survival [B, D]`` and the step cost ``a + b · tokens + c · [drafts] + e · row_blocks(tokens)`` (module
    docstring). ``forced_drafts``: drafts the step carries regardless (probes), so ``c`` is paid anyway. Returns int64
    ``[B]`` with ``0 <= out <= keep``; free drafts (``b, c, e <= 0``) return ``keep`` unchanged."""
    survival = np.asarray(survival, dtype=np.float64)
    if survival.ndim != 2 or survival.shape[0] != np.asarray(keep).shape[0]:
        raise ValueError(f"survival shape {survival.shape} and keep shape {np.asarray(keep).shape} are inconsistent")
    keep = np.minimum(np.maximum(np.asarray(keep, dtype=np.int64), 0), survival.shape[1])
    if (not b > 0 and not c > 0 and not e > 0) or keep.sum() == 0:
        return keep.copy()
    num_reqs = survival.shape[0]
    rows_idx, values = ranked_drafts(survival, keep)
    count = np.arange(len(values) + 1, dtype=np.float64)
    gain = num_reqs + np.concatenate(([0.0], np.cumsum(values)))
    scale = max(float(safety), 0.0)
    verify = np.where(count > 0, scale * max(c, 0.0), 0.0) if forced_drafts <= 0 else np.zeros_like(count)
    base = num_reqs + forced_drafts
    blocks = np.ceil((base + count) / ROW_BLOCK) - math.ceil(base / ROW_BLOCK)  # blocks the drafts start
    cost = a + b * base + max(e, 0.0) * row_blocks(base) + scale * (max(b, 0.0) * count + max(e, 0.0) * blocks) \
        + verify
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(cost > 0, gain / cost, np.inf)
    best = int(np.argmax(rate))  # first maximum: the fewest drafts among equally good counts
    out = np.zeros(num_reqs, dtype=np.int64)
    np.add.at(out, rows_idx[:best], 1)
    bad = out > keep  # cannot happen for non-increasing survival rows; defensive
    out[bad] = keep[bad]
    return out
