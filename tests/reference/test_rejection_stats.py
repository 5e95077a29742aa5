"""Rejection sampling preserves the target distribution: exact float64 enumeration + chi-square (specdec spec §2.8).

Toy models: a target and a draft model over a vocabulary of V tokens whose next-token distributions depend on the
whole prefix (one random row per prefix of length <= k). The test draws N requests: drafts from the draft model
(or a deterministic proposer: the draft model's argmax), target logits rows at each drafted prefix, then runs the
:class:`RejectionSampler` once on the whole batch.

Independent reference (numpy, written from the algorithms, not from our code):
- ``emitted_standard`` / ``emitted_block`` enumerate every draft sequence and integrate the uniforms analytically
  (token level: accept w.p. ``min(1, p/q)``; block: ``P(τ = i) = h_i Π_{j>i} (1 - h_j)``), giving the exact
  distribution of the emitted sequence (accepted drafts + final token);
- ``lossless_error``: emitted prefix continued by target sampling vs the target joint (must be ~0 in float64).
Empirical checks per configuration: the first emitted token ~ target, the emitted sequence ~ the exact enumeration,
and the emitted sequence completed to ``k + 1`` tokens by target sampling ~ the target joint
(``scipy.stats.chisquare``, bins with expected count < 5 merged, p > 1e-3, never a draw outside the support).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ascent.sample.metadata import SamplingMetadata
from ascent.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from ascent.sample.rng import RNG_PLACEMENTS, make_generator
from ascent.sampling_params import SamplingParams

torch.set_num_threads(1)
CPU = torch.device("cpu")
NUM_REQUESTS = 24_000
CONFIGS = [(v, k, t) for v in (4, 8) for k in (1, 2, 3) for t in (0.7, 1.0)]


@dataclass
class ToyModels:
    """Prefix-dependent target / draft models. Row ``index(prefix)`` of each table is the next-token distribution.

    logits: float32 ``[C, V]`` (what the sampler gets); probs: float64 exact target at ``temperature``; draft:
    float64 draft distributions (``draft32`` is what the sampler gets); det: deterministic draft per prefix or None.
    """

    vocab: int
    k: int
    temperature: float
    logits: np.ndarray
    probs: np.ndarray
    draft: np.ndarray
    draft32: np.ndarray
    det: np.ndarray | None

    def index(self, prefix: tuple[int, ...]) -> int:
        code = 0
        for t in prefix:
            code = code * self.vocab + t
        return sum(self.vocab**j for j in range(len(prefix))) + code

    def p(self, prefix: tuple[int, ...]) -> np.ndarray:
        return self.probs[self.index(prefix)]

    def q(self, prefix: tuple[int, ...]) -> np.ndarray:
        if self.det is None:
            return self.draft[self.index(prefix)]
        return np.eye(self.vocab)[self.det[self.index(prefix)]]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def make_models(vocab: int, k: int, temperature: float, seed: int, deterministic: bool = False) -> ToyModels:
    rng = np.random.default_rng(seed)
    contexts = sum(vocab**j for j in range(k + 1))
    logits = rng.normal(0.0, 1.5, size=(contexts, vocab)).astype(np.float32)
    draft32 = _softmax(0.6 * logits.astype(np.float64) + rng.normal(0.0, 1.0, size=logits.shape)).astype(np.float32)
    draft = draft32.astype(np.float64) / draft32.astype(np.float64).sum(axis=1, keepdims=True)
    det = draft.argmax(axis=1) if deterministic else None
    probs = _softmax(logits.astype(np.float64) / temperature)
    return ToyModels(vocab, k, temperature, logits, probs, draft, draft32, det)


def toy_models(method_k: int = 2) -> ToyModels:
    """The paper's motivating example: context-free binary models, M_b = (1/3, 2/3), M_s = (2/3, 1/3)."""
    contexts = 2**(method_k + 1) - 1
    probs = np.tile([1 / 3, 2 / 3], (contexts, 1))
    draft = np.tile([2 / 3, 1 / 3], (contexts, 1))
    return ToyModels(2, method_k, 1.0, np.log(probs).astype(np.float32), probs, draft, draft.astype(np.float32), None)


# ----------------------------------------------------------------------------------------------- exact reference


def _add(out: dict, prefix: tuple[int, ...], weights: np.ndarray) -> None:
    for y in np.flatnonzero(weights > 0):
        out[prefix + (int(y),)] += float(weights[y])


def emitted_standard(m: ToyModels) -> dict[tuple[int, ...], float]:
    """Exact distribution of the emitted sequence under token-level verification."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def visit(prefix: tuple[int, ...], mass: float) -> None:
        p = m.p(prefix)
        if len(prefix) == m.k:
            _add(out, prefix, mass * p)
            return
        q = m.q(prefix)
        for x in range(m.vocab):
            if min(p[x], q[x]) > 0:
                visit(prefix + (x,), mass * min(p[x], q[x]))
        _add(out, prefix, mass * np.maximum(p - q, 0.0))

    visit((), 1.0)
    return out


def _block_h(m: ToyModels, drafts: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """Algorithm 2's prefix weights p_0..p_k and acceptance weights h_1..h_k (index 0 unused)."""
    weights, h = [1.0], [1.0]
    for i in range(1, m.k + 1):
        prev = drafts[: i - 1]
        weights.append(min(1.0, weights[-1] * m.p(prev)[drafts[i - 1]] / m.q(prev)[drafts[i - 1]]))
    for i in range(1, m.k):
        mass = np.maximum(weights[i] * m.p(drafts[:i]) - m.q(drafts[:i]), 0.0).sum()
        denom = mass + 1.0 - weights[i]
        h.append(mass / denom if denom > 0 else 1.0)
    h.append(weights[m.k])
    return weights, h


def emitted_block(m: ToyModels) -> dict[tuple[int, ...], float]:
    """Exact distribution of the emitted sequence under block verification (every draft block enumerated)."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for drafts in itertools.product(range(m.vocab), repeat=m.k):
        prob = float(np.prod([m.q(drafts[:i])[drafts[i]] for i in range(m.k)]))
        if prob == 0:
            continue
        weights, h = _block_h(m, drafts)
        for tau in range(m.k + 1):
            p_tau = h[tau] * float(np.prod([1.0 - h[j] for j in range(tau + 1, m.k + 1)]))
            if p_tau == 0:
                continue
            prefix = drafts[:tau]
            if tau == m.k:
                final = m.p(prefix)
            else:
                residual = np.maximum(weights[tau] * m.p(prefix) - m.q(prefix), 0.0)
                final = residual / residual.sum() if residual.sum() > 0 else m.p(prefix)
            _add(out, prefix, prob * p_tau * final)
    return out


def lossless_error(m: ToyModels, emitted: dict[tuple[int, ...], float]) -> float:
    """max |P(emitted prefix, then target continuation = z) - P_target(z)| over all z of length k + 1."""
    extended, target = {(): 0.0}, {(): 1.0}
    for _ in range(m.k + 1):
        extended_next, target_next = {}, {}
        for prefix in target:
            p = m.p(prefix)
            for y in range(m.vocab):
                z = prefix + (y,)
                extended_next[z] = extended[prefix] * p[y] + emitted.get(z, 0.0)
                target_next[z] = target[prefix] * p[y]
        extended, target = extended_next, target_next
    return max(abs(extended[z] - target[z]) for z in target)


def target_joint(m: ToyModels) -> np.ndarray:
    """P_target of every length-(k + 1) sequence, indexed by its base-V code."""
    joint = np.ones(1)
    for length in range(m.k + 1):
        codes = np.arange(m.vocab**length)
        rows = sum(m.vocab**j for j in range(length)) + codes
        joint = (joint[:, None] * m.probs[rows]).reshape(-1)
    return joint


# ----------------------------------------------------------------------------------------------- sampling harness


def _inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.minimum((probs.cumsum(axis=1) <= u[:, None]).sum(axis=1), probs.shape[1] - 1)


def draw_requests(m: ToyModels, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafts int64 ``[n, k]`` from the draft model and the context row of each target position ``[n, k + 1]``."""
    rng = np.random.default_rng(seed)
    drafts = np.empty((n, m.k), dtype=np.int64)
    contexts = np.zeros((n, m.k + 1), dtype=np.int64)
    code = np.zeros(n, dtype=np.int64)
    for j in range(m.k):
        idx = contexts[:, j]
        drafts[:, j] = m.det[idx] if m.det is not None else _inverse_cdf(m.draft[idx], rng.random(n))
        code = code * m.vocab + drafts[:, j]
        contexts[:, j + 1] = sum(m.vocab**i for i in range(j + 1)) + code
    return drafts, contexts


def run_sampler(m: ToyModels, method: str, n: int, seed: int, placement: str = "device",
                params: list[SamplingParams] | None = None, seeded: bool = False) -> list[list[int]]:
    drafts, contexts = draw_requests(m, n, seed)
    spec = SpecDecodeMetadata(drafts.tolist())
    logits = torch.from_numpy(m.logits[contexts.reshape(-1)])
    draft_probs = None if m.det is not None else torch.from_numpy(m.draft32[contexts[:, : m.k].reshape(-1)])
    params = params or [SamplingParams(temperature=m.temperature)] * n
    gens = {r: make_generator(seed * 100_003 + r, placement, CPU) for r in range(n)} if seeded else {}
    md = SamplingMetadata.from_requests(params, [[]] * n, [[]] * n, gens, m.vocab, CPU)
    sampler = RejectionSampler(method, placement, torch.Generator().manual_seed(seed))
    return sampler(spec, draft_probs, logits, md, deterministic_proposer=m.det is not None)


def complete_to_full(m: ToyModels, outputs: list[list[int]], seed: int) -> np.ndarray:
    """Continue each emitted sequence with target samples to length k + 1; returns base-V codes ``[n]``."""
    rng = np.random.default_rng(seed)
    n = len(outputs)
    seq = np.full((n, m.k + 1), -1, dtype=np.int64)
    for i, out in enumerate(outputs):
        seq[i, : len(out)] = out
    code = np.zeros(n, dtype=np.int64)
    for j in range(m.k + 1):
        ctx = sum(m.vocab**i for i in range(j)) + code
        need = seq[:, j] < 0
        seq[need, j] = _inverse_cdf(m.probs[ctx[need]], rng.random(int(need.sum())))
        code = code * m.vocab + seq[:, j]
    return code


def assert_chisquare(observed: np.ndarray, probs: np.ndarray) -> None:
    """No draws outside the support; Pearson chi-square p > 1e-3 with expected < 5 bins merged."""
    support = probs > 0
    assert observed[~support].sum() == 0
    expected = probs[support] * observed.sum() / probs[support].sum()
    obs = observed[support].astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    assert len(expected) >= 2
    pvalue = chisquare(obs, expected).pvalue
    assert pvalue > 1e-3, pvalue


def assert_sequences_match(emitted: dict[tuple[int, ...], float], outputs: list[list[int]]) -> None:
    counts = Counter(tuple(o) for o in outputs)
    assert set(counts) <= set(emitted), set(counts) - set(emitted)
    cells = sorted(emitted)
    assert_chisquare(np.array([counts.get(c, 0) for c in cells]), np.array([emitted[c] for c in cells]))


def check_all(m: ToyModels, emitted: dict, outputs: list[list[int]], seed: int) -> None:
    first = np.bincount([o[0] for o in outputs], minlength=m.vocab)
    assert_chisquare(first, m.p(()))
    assert_sequences_match(emitted, outputs)
    full = np.bincount(complete_to_full(m, outputs, seed + 1), minlength=m.vocab ** (m.k + 1))
    assert_chisquare(full, target_joint(m))


EXACT = {"standard": emitted_standard, "block": emitted_block}


# ----------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("vocab,k,temperature", CONFIGS)
def test_exact_enumeration_is_lossless(vocab: int, k: int, temperature: float, method: str,
                                       deterministic: bool) -> None:
    m = make_models(vocab, k, temperature, seed=vocab * 10 + k, deterministic=deterministic)
    emitted = EXACT[method](m)
    assert abs(sum(emitted.values()) - 1.0) < 1e-12
    assert lossless_error(m, emitted) < 1e-12


def test_paper_example_block_accepts_more() -> None:
    """arXiv 2403.10444 §1: token verification accepts 10/9 tokens per step, block verification 11/9."""
    m = toy_models(2)
    for method, expected in (("standard", 10 / 9), ("block", 11 / 9)):
        emitted = EXACT[method](m)
        assert abs(sum(w * (len(s) - 1) for s, w in emitted.items()) - expected) < 1e-12
        assert lossless_error(m, emitted) < 1e-12


def test_block_never_accepts_fewer_in_expectation() -> None:
    for vocab, k, temperature in CONFIGS:
        m = make_models(vocab, k, temperature, seed=vocab * 10 + k)
        mean = {name: sum(w * (len(s) - 1) for s, w in fn(m).items()) for name, fn in EXACT.items()}
        assert mean["block"] >= mean["standard"] - 1e-12


@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("vocab,k,temperature", CONFIGS)
def test_sampler_reproduces_target(vocab: int, k: int, temperature: float, method: str) -> None:
    seed = vocab * 100 + k * 10 + int(temperature * 10)
    m = make_models(vocab, k, temperature, seed=seed)
    outputs = run_sampler(m, method, NUM_REQUESTS, seed)
    check_all(m, EXACT[method](m), outputs, seed)


@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("vocab,k", [(4, 2), (8, 3)])
def test_no_draft_probs_path_reproduces_target(vocab: int, k: int, method: str) -> None:
    m = make_models(vocab, k, 0.8, seed=7 + vocab + k, deterministic=True)
    outputs = run_sampler(m, method, NUM_REQUESTS, seed=31 + k)
    check_all(m, EXACT[method](m), outputs, seed=31 + k)


@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("placement", RNG_PLACEMENTS)
def test_rng_placements_reproduce_target(placement: str, method: str) -> None:
    """"host_cdf" is the 310p profile's host-RNG variant (host uniforms + float64 inverse CDF)."""
    m = make_models(8, 3, 0.7, seed=99)
    outputs = run_sampler(m, method, NUM_REQUESTS, seed=5, placement=placement)
    check_all(m, EXACT[method](m), outputs, seed=5)


@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("placement", ["device", "host_cdf"])
def test_seeded_requests_reproduce_target(placement: str, method: str) -> None:
    m = make_models(4, 2, 1.0, seed=12)
    outputs = run_sampler(m, method, 10_000, seed=8, placement=placement, seeded=True)
    check_all(m, EXACT[method](m), outputs, seed=8)


@pytest.mark.parametrize("method", sorted(EXACT))
def test_paper_example_sampled(method: str) -> None:
    m = toy_models(2)
    outputs = run_sampler(m, method, NUM_REQUESTS, seed=3)
    check_all(m, EXACT[method](m), outputs, seed=3)
    mean = np.mean([len(o) - 1 for o in outputs])
    expected = 11 / 9 if method == "block" else 10 / 9
    assert abs(mean - expected) < 4 * np.std([len(o) - 1 for o in outputs]) / np.sqrt(len(outputs))


@pytest.mark.parametrize("method", sorted(EXACT))
def test_mixed_greedy_and_random_rows(method: str) -> None:
    """Even rows greedy (exact argmax chain), odd rows random (chi-square), one batch."""
    m = make_models(8, 3, 1.0, seed=21)
    n = 2 * 12_000
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(n)]
    outputs = run_sampler(m, method, n, seed=13, params=params)
    drafts, _ = draw_requests(m, n, 13)
    for i in range(0, n, 2):
        expected: list[int] = []
        for j in range(m.k + 1):
            best = int(np.argmax(m.logits[m.index(tuple(drafts[i, :j].tolist()))]))
            expected.append(best)
            if j == m.k or drafts[i, j] != best:
                break
        assert outputs[i] == expected
    check_all(m, EXACT[method](m), outputs[1::2], seed=13)


def test_placeholder_drafts_always_rejected() -> None:
    m = make_models(8, 2, 0.7, seed=4)
    n = NUM_REQUESTS
    spec = SpecDecodeMetadata([[-1, 3]] * n)
    rows = [m.index(()), m.index((0,)), m.index((0, 3))]
    logits = torch.from_numpy(np.tile(m.logits[rows], (n, 1)))
    md = SamplingMetadata.from_requests([SamplingParams(temperature=0.7)] * n, [[]] * n, [[]] * n, {}, 8, CPU)
    for method in sorted(EXACT):
        probs = torch.from_numpy(np.tile(m.draft32[rows[:2]], (n, 1)))
        outputs = RejectionSampler(method, generator=torch.Generator().manual_seed(1))(spec, probs, logits, md, False)
        assert all(len(o) == 1 for o in outputs)
        assert_chisquare(np.bincount([o[0] for o in outputs], minlength=8), m.p(()))
