"""Seeded synthetic expert-load traces for ``ascent bench eplb`` (specs/eplb_moe_lora.md §4, §2.5).

Every generator returns a :class:`Trace`: ``load`` float64 [T, L, E] per-step logical token counts and the
``placement`` int64 [L, R, S] the cluster starts from. ``window`` is the rebalance interval in steps: the policy is fitted
on window k and evaluated per step on window k + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ascent.eplb.placement import initial_placement


@dataclass
class Shape:
    """Problem size: layers, logical experts, ranks, slots per rank, window length, windows, routed tokens/step."""

    layers: int = 58
    experts: int = 256
    ranks: int = 32
    slots: int = 9
    window: int = 50
    windows: int = 2
    tokens: int = 8192 * 8

    @property
    def steps(self) -> int:
        return self.window * self.windows


@dataclass
class Trace:
    name: str
    load: np.ndarray
    placement: np.ndarray
    window: int
    drifting: bool = False
    meta: dict = field(default_factory=dict)


def _sample(rng: np.random.Generator, probs: np.ndarray, tokens: int) -> np.ndarray:
    """Multinomial counts of ``tokens`` routed assignments for each [..., E] probability row."""
    probs = probs / probs.sum(axis=-1, keepdims=True)
    return rng.multinomial(tokens, probs).astype(np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _zipf_probs(rng: np.random.Generator, shape: Shape, exponent: float) -> np.ndarray:
    base = 1.0 / np.arange(1, shape.experts + 1) ** exponent
    return np.stack([base[rng.permutation(shape.experts)] for _ in range(shape.layers)])


def zipf(shape: Shape, seed: int, exponent: float) -> Trace:
    rng = np.random.default_rng(seed)
    probs = np.broadcast_to(_zipf_probs(rng, shape, exponent), (shape.steps, shape.layers, shape.experts))
    return _trace(f"zipf_{exponent:g}", _sample(rng, probs, shape.tokens), shape)


def dirichlet(shape: Shape, seed: int, alpha: float) -> Trace:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(shape.experts, alpha), size=shape.layers) + 1e-12
    probs = np.broadcast_to(probs, (shape.steps, shape.layers, shape.experts))
    return _trace(f"dirichlet_{alpha:g}", _sample(rng, probs, shape.tokens), shape)


def drift_random_walk(shape: Shape, seed: int, theta: float = 0.02, sigma: float = 0.08) -> Trace:
    """Ornstein-Uhlenbeck walk of the routing logits around a Zipf(1.0) profile."""
    rng = np.random.default_rng(seed)
    mean = np.log(_zipf_probs(rng, shape, 1.0))
    logits = np.empty((shape.steps, shape.layers, shape.experts))
    x = mean.copy()
    for t in range(shape.steps):
        x = x + theta * (mean - x) + sigma * rng.standard_normal(x.shape)
        logits[t] = x
    return _trace("drift_random_walk", _sample(rng, _softmax(logits), shape.tokens), shape, drifting=True)


def drift_regime_switch(shape: Shape, seed: int, period: int | None = None) -> Trace:
    """Two 'datasets' with different hot sets alternate every ``period`` steps (default 1.5 windows)."""
    rng = np.random.default_rng(seed)
    a, b = _zipf_probs(rng, shape, 1.0), _zipf_probs(rng, shape, 1.0)
    period = period or max(shape.window * 3 // 2, 1)
    regime = (np.arange(shape.steps) // period) % 2
    probs = np.where(regime[:, None, None] == 0, a[None], b[None])
    return _trace("drift_regime_switch", _sample(rng, probs, shape.tokens), shape, drifting=True)


def drift_rotation(shape: Shape, seed: int, experts_per_window: int = 8, hot: int = 32) -> Trace:
    """Slow rotation of the hot set of a Zipf(1.0) profile: over each window ``experts_per_window`` of the ``hot``
    hottest experts hand their popularity (linearly in time) to random colder experts."""
    rng = np.random.default_rng(seed)
    hot = max(1, min(hot, shape.experts // 2))
    experts_per_window = max(0, min(experts_per_window, hot, shape.experts - hot))
    probs = _zipf_probs(rng, shape, 1.0)
    out = np.empty((shape.steps, shape.layers, shape.experts))
    rows = np.arange(shape.layers)[:, None]
    for k in range(shape.windows):
        order = np.argsort(-probs, axis=1)
        src = np.stack([rng.choice(order[l, :hot], experts_per_window, replace=False) for l in range(shape.layers)])
        dst = np.stack([rng.choice(order[l, hot:], experts_per_window, replace=False) for l in range(shape.layers)])
        target = probs.copy()
        target[rows, src], target[rows, dst] = probs[rows, dst], probs[rows, src]
        frac = (np.arange(shape.window) + 1) / shape.window
        out[k * shape.window:(k + 1) * shape.window] = (1 - frac)[:, None, None] * probs + frac[:, None, None] * target
        probs = target
    return _trace("drift_rotation", _sample(rng, out, shape.tokens), shape, drifting=True)


def layer_correlated(shape: Shape, seed: int, rho: float = 0.9) -> Trace:
    """Adjacent layers share their hot set: logits_l = rho logits_{l-1} + sqrt(1 - rho^2) noise (scale 1.5)."""
    rng = np.random.default_rng(seed)
    logits = np.empty((shape.layers, shape.experts))
    logits[0] = rng.standard_normal(shape.experts)
    for layer in range(1, shape.layers):
        logits[layer] = rho * logits[layer - 1] + np.sqrt(1 - rho ** 2) * rng.standard_normal(shape.experts)
    probs = np.broadcast_to(_softmax(1.5 * logits), (shape.steps, shape.layers, shape.experts))
    return _trace("layer_correlated", _sample(rng, probs, shape.tokens), shape)


def policy_ut(shape: Shape, seed: int = 42, steps: int = 100) -> Trace:
    """specs §2.5: every layer holds each expert once plus R*S - E random extras, shuffled; per-slot workload
    ``rand ** 10 * 999 + 1`` for ``steps`` steps, folded onto logical experts (fit window = evaluation window)."""
    rng = np.random.default_rng(seed)
    total = shape.ranks * shape.slots
    rows = [rng.permutation(np.concatenate([np.arange(shape.experts),
                                            rng.integers(0, shape.experts, total - shape.experts)]))
            for _ in range(shape.layers)]
    placement = np.stack(rows).reshape(shape.layers, shape.ranks, shape.slots).astype(np.int64)
    slot_load = np.floor(rng.random((steps, shape.layers, total)) ** 10 * 999 + 1)
    load = np.zeros((steps, shape.layers, shape.experts))
    for layer in range(shape.layers):
        np.add.at(load[:, layer], (slice(None), placement[layer].ravel()), slot_load[:, layer])
    return Trace("policy_ut", load, placement, steps, meta={"fit_is_eval": True})


def _trace(name: str, load: np.ndarray, shape: Shape, drifting: bool = False) -> Trace:
    placement = initial_placement(shape.layers, shape.experts, shape.ranks, shape.slots)
    return Trace(name, load, placement, shape.window, drifting)


GENERATORS: dict[str, Callable[[Shape, int], Trace]] = {
    "zipf_0.8": lambda s, seed: zipf(s, seed, 0.8),
    "zipf_1.0": lambda s, seed: zipf(s, seed, 1.0),
    "zipf_1.2": lambda s, seed: zipf(s, seed, 1.2),
    "dirichlet_0.1": lambda s, seed: dirichlet(s, seed, 0.1),
    "dirichlet_0.3": lambda s, seed: dirichlet(s, seed, 0.3),
    "dirichlet_1": lambda s, seed: dirichlet(s, seed, 1.0),
    "drift_random_walk": drift_random_walk,
    "drift_regime_switch": drift_regime_switch,
    "drift_rotation": drift_rotation,
    "layer_correlated": layer_correlated,
    "policy_ut": lambda s, seed: policy_ut(s, 42 + seed),
}


TRACE_NAMES = (*GENERATORS, "recorded")  # "recorded": loads of our own MoE model (ascent.benchmarks.eplb_recorded)


def make_trace(name: str, shape: Shape, seed: int = 0, recorded: Any = None) -> Trace:
    """Build the named trace; raises ``ValueError`` for an unknown name. ``recorded`` (a ``RecordedSpec``, default
    spec if None) sizes the ``recorded`` trace, which keeps its own layers / experts / ranks and ``shape.windows``."""
    if name == "recorded":
        from ascent.benchmarks.eplb_recorded import RecordedSpec, recorded_trace

        return recorded_trace(recorded or RecordedSpec(), seed, shape.windows)
    if name not in GENERATORS:
        raise ValueError(f"unknown trace {name!r}; expected one of {sorted(TRACE_NAMES)}")
    return GENERATORS[name](shape, seed)
