"""Host-RNG sampling (specdec §1.5): chi-square against exact probabilities, per-seed reproducibility, generator
mapping by source identity, the §1.5 boundary cases, all-zero rows and the u -> 1 rounding clamp."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from ascent.sample.host_rng import (
    HostGeneratorCache,
    HostRNGSampler,
    fill_exponential,
    request_uniforms,
    sample_from_cdf,
)
from ascent.sample.rng import RandomSampler, make_generator

TINY = torch.finfo(torch.float32).tiny
WEIGHTS = torch.tensor([0.31, 0.0, 0.2, 0.05, 0.25, 0.0, 0.004, 0.186])
NUM_DRAWS = 100_000


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of token counts against ``probs`` (zero-probability bins must be empty; small bins merged)."""
    counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
    expected = probs.double().numpy() / float(probs.sum()) * len(tokens)
    assert np.all(counts[expected == 0] == 0)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


@pytest.mark.parametrize("method", ["cdf", "exponential"])
def test_distribution_matches_exact_probabilities(method: str) -> None:
    sampler = HostRNGSampler(method, generator=torch.Generator().manual_seed(1234))
    unnormalised = WEIGHTS * 3.7
    tokens = sampler.sample(unnormalised.expand(NUM_DRAWS, -1).contiguous(), {})
    assert tokens.dtype == torch.int64 and tokens.shape == (NUM_DRAWS,)
    assert chi_square_pvalue(tokens, WEIGHTS) > 1e-3


def test_seeded_rows_draw_many_times_from_the_right_distribution() -> None:
    sampler = HostRNGSampler("cdf")
    source = make_generator(99, "host_cdf", "cpu")
    probs = WEIGHTS.unsqueeze(0)
    tokens = torch.cat([sampler.sample(probs, {0: source}) for _ in range(4000)])
    assert chi_square_pvalue(tokens, WEIGHTS) > 1e-3


def test_per_seed_reproducibility_batch_reorder_and_composition() -> None:
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)

    def solo(seed: int, row: int, steps: int) -> list[int]:
        sampler, gen = HostRNGSampler("cdf"), make_generator(seed, "host_cdf", "cpu")
        return [int(sampler.sample(probs[row : row + 1], {0: gen})) for _ in range(steps)]

    sampler = HostRNGSampler("cdf", generator=torch.Generator().manual_seed(5))
    gen_a, gen_b = make_generator(7, "host_cdf", "cpu"), make_generator(8, "host_cdf", "cpu")
    a, b = [], []
    for step in range(6):
        if step % 2 == 0:
            out = sampler.sample(probs, {0: gen_a, 2: gen_b})
            a.append(int(out[0]))
            b.append(int(out[2]))
        else:
            out = sampler.sample(torch.stack([probs[2], probs[1], probs[0]]), {2: gen_a, 0: gen_b})
            a.append(int(out[2]))
            b.append(int(out[0]))
    assert a == solo(7, 0, 6) and b == solo(8, 2, 6)
    assert a != solo(8, 0, 6)


def test_same_draws_as_rng_host_cdf_and_sources_are_not_consumed() -> None:
    probs = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    ours_gens = {1: make_generator(11, "host_cdf", "cpu"), 3: make_generator(12, "host_cdf", "cpu")}
    theirs_gens = {1: make_generator(11, "host_cdf", "cpu"), 3: make_generator(12, "host_cdf", "cpu")}
    states = {row: g.get_state().clone() for row, g in ours_gens.items()}
    ours = HostRNGSampler("cdf", generator=torch.Generator().manual_seed(3))
    theirs = RandomSampler("host_cdf", generator=torch.Generator().manual_seed(3))
    for _ in range(5):
        assert torch.equal(ours.sample(probs, ours_gens), theirs.sample(probs, theirs_gens))
    assert all(torch.equal(g.get_state(), states[row]) for row, g in ours_gens.items())


def test_generator_cache_identity_and_lifetime() -> None:
    cache = HostGeneratorCache()
    src = make_generator(42, "host_cdf", "cpu")
    first = cache.get(src)
    assert cache.get(src) is first and first.initial_seed() == 42
    first_draw = request_uniforms(1, {0: src}, cache)
    fresh = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(42))
    assert torch.equal(first_draw, fresh)
    second_draw = request_uniforms(1, {0: src}, cache)
    assert not torch.equal(first_draw, second_draw)
    replacement = make_generator(42, "host_cdf", "cpu")
    assert cache.get(replacement) is not first
    assert torch.equal(request_uniforms(1, {0: replacement}, cache), fresh)
    del src, replacement, first
    assert len(cache) == 0
    with pytest.raises(ValueError, match=r"generator rows \[3\]"):
        request_uniforms(2, {3: make_generator(1, "host_cdf", "cpu")}, cache)


def test_cdf_boundary_cases_of_the_310p_unit_tests() -> None:
    weights = torch.tensor([[0.0, 2, 3, 5], [1, 0, 0, 0], [0, 0, 0, 4]])
    u = torch.tensor([0.2, 0.999, TINY], dtype=torch.float64)
    assert sample_from_cdf(weights, u).tolist() == [2, 0, 3]


def test_all_zero_rows_and_u_rounding_up_to_the_total() -> None:
    zero = torch.zeros(2, 5)
    u = torch.tensor([0.3, 1 - 2**-53], dtype=torch.float64)
    assert sample_from_cdf(zero, u).tolist() == [0, 0]
    assert sample_from_cdf(zero, u, zero_row_token=4).tolist() == [4, 4]
    weights = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0]] * 3, dtype=torch.float64)
    near_one = float(np.nextafter(1.0, 0.0))
    u_high = torch.tensor([near_one, 1.0, 0.4], dtype=torch.float64)
    assert sample_from_cdf(weights, u_high).tolist() == [2, 2, 1]
    assert sample_from_cdf(weights.float(), u_high.float().double()).tolist() == [2, 2, 1]
    assert HostRNGSampler("exponential").sample(torch.zeros(3, 4), {}).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="zero_row_token 5"):
        sample_from_cdf(zero, u, zero_row_token=5)
    with pytest.raises(ValueError, match="expected weights"):
        sample_from_cdf(zero, u[:1])


def test_uniforms_are_clamped_float64() -> None:
    u = request_uniforms(10_000, {}, HostGeneratorCache(), torch.Generator().manual_seed(0))
    assert u.dtype == torch.float64 and u.device.type == "cpu"
    assert float(u.min()) >= TINY and float(u.max()) < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


def test_fill_exponential_distribution_active_mask_and_dtype() -> None:
    cache = HostGeneratorCache()
    reference = torch.empty(3, 20_000, dtype=torch.float16)
    gens = {0: make_generator(5, "host_cdf", "cpu"), 2: make_generator(6, "host_cdf", "cpu")}
    for gen in gens.values():
        cache.get(gen)
    states = {row: cache.get(g).get_state().clone() for row, g in gens.items()}
    noise = fill_exponential(reference, gens, cache, torch.tensor([True, True, False]),
                             torch.Generator().manual_seed(1))
    assert noise.dtype == torch.float16 and noise.shape == reference.shape
    assert float(noise.min()) > 0
    assert not torch.equal(cache.get(gens[0]).get_state(), states[0])
    assert torch.equal(cache.get(gens[2]).get_state(), states[2])
    expected_row0 = -torch.rand(20_000, generator=torch.Generator().manual_seed(5)).clamp_min(TINY).log()
    assert torch.equal(noise[0], expected_row0.to(torch.float16))
    for row in range(3):
        assert stats.kstest(noise[row].float().numpy(), "expon").pvalue > 1e-3
    with pytest.raises(ValueError, match="active_mask"):
        fill_exponential(reference, gens, cache, torch.tensor([True]))


def test_sampler_validation() -> None:
    with pytest.raises(ValueError, match="'gumbel'"):
        HostRNGSampler("gumbel")
    with pytest.raises(ValueError, match="probs must be"):
        HostRNGSampler().sample(torch.ones(4), {})
    assert isinstance(HostRNGSampler(), RandomSampler) and HostRNGSampler().placement == "host_cdf"
