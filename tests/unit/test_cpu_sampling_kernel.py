"""The sampling kernels (``sampling_cpu.cpp``): the inverse-CDF draw picks exactly the token of fp64 cumsum +
searchsorted; the greedy argmax is exactly torch.argmax."""

from __future__ import annotations

import pytest
import torch

from ascent.layers import cpu_kernels
from ascent.sample import rng


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.sampling_ops()
    assert module is not None, "the sampling kernel must build on the CPU profile"
    return module


def _torch_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    last_positive = probs.shape[1] - 1 - (probs > 0).flip(dims=[1]).to(torch.int8).argmax(-1)
    return torch.minimum(idx, last_positive)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 10), (5, 1000), (9, 49152)])
def test_bit_identical_to_cumsum_searchsorted(kernels, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    probs = torch.rand(rows, vocab, generator=gen) ** 6
    probs[0, : vocab // 2] = 0.0  # zero-weight tokens must never be drawn
    for _ in range(20):
        u = torch.rand(rows, dtype=torch.float64, generator=gen).clamp_min(1e-300)
        got = kernels.inverse_cdf_sample(probs, u)
        assert torch.equal(got, _torch_inverse_cdf(probs, u))
        assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
    # u * total rounding up to total: clamped to the last positive-weight token, as the torch path does
    ones = torch.ones(rows, dtype=torch.float64)
    assert torch.equal(kernels.inverse_cdf_sample(probs, ones), _torch_inverse_cdf(probs, ones))


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_summed_together_and_block_edges_match_torch_path(kernels, threads):
    """Up to 8 rows share one summing pass and each row's crossing is rescanned from the running sum kept every 256
    tokens: targets on and beside those block edges, zero runs across blocks and groups with a partial tail."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 21, 4099
    probs = torch.rand(rows, vocab, generator=gen) ** 4
    probs[1, :700] = 0.0
    probs[2, 300:3000] = 0.0
    probs[3, :-1] = 0.0
    cdf = probs.double().cumsum(-1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (0, 255, 256, 511, 512, 767, 4095, vocab - 2):
            for nudge in (-1e-12, 0.0, 1e-12):
                u = (cdf[:, k] / cdf[:, -1] + nudge).clamp(1e-300, 1.0)
                assert torch.equal(kernels.inverse_cdf_sample(probs, u), _torch_inverse_cdf(probs, u))
    finally:
        torch.set_num_threads(previous)


def test_degenerate_rows_match_torch_path(kernels):
    probs = torch.zeros(2, 5)
    probs[1, 2] = 1.0
    u = torch.tensor([0.5, 0.999], dtype=torch.float64)
    assert torch.equal(kernels.inverse_cdf_sample(probs, u), _torch_inverse_cdf(probs, u))


def test_sampler_uses_kernel_for_cpu_float32(kernels, monkeypatch):
    probs = torch.rand(4, 300)
    u = torch.rand(4, dtype=torch.float64)
    expected = _torch_inverse_cdf(probs, u)
    assert torch.equal(rng.sample_inverse_cdf(probs, u), expected)
    monkeypatch.setenv("ASCENT_CPU_FUSED_OPS", "0")  # the torch path gives the same tokens
    assert torch.equal(rng.sample_inverse_cdf(probs, u), expected)
    assert torch.equal(rng.sample_inverse_cdf(probs.double(), u), expected)


def test_bad_inputs_raise(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.inverse_cdf_sample(torch.rand(2, 4, dtype=torch.float64), torch.rand(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float64"):
        kernels.inverse_cdf_sample(torch.rand(2, 4), torch.rand(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty"):
        kernels.inverse_cdf_sample(torch.rand(2, 0), torch.rand(2, dtype=torch.float64))


def _argmax_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(rows, vocab, generator=gen) for rows, vocab in [(1, 1), (1, 15), (3, 17), (8, 49152)]]
    ties = torch.randint(-2, 2, (6, 37), generator=gen).float()  # many equal maxima: the first one wins
    nans = torch.randn(4, 40, generator=gen)
    nans[0, 5], nans[0, 30], nans[2, 39] = float("nan"), float("nan"), float("nan")  # NaN compares greatest
    infs = torch.randn(3, 33, generator=gen)
    infs[0].fill_(-float("inf"))
    infs[1, 3], infs[1, 20] = float("inf"), float("inf")
    zeros = torch.zeros(2, 19)
    zeros[:, ::2] = -0.0  # -0.0 ties with 0.0
    tails = torch.randn(4, 43, generator=gen)  # 43 = 5 vector blocks of 8 + a scalar tail of 3
    tails[0, 42] = 9.0  # the maximum in the tail
    tails[1, 41] = float("nan")  # a NaN only in the tail
    tails[2, 3], tails[2, 41] = 9.0, 9.0  # a tie between the vector part and the tail: the first wins
    tails[3, 7], tails[3, 41] = float("nan"), float("nan")
    return [*cases, ties, nans, infs, zeros, tails, torch.randn(5, 64, generator=gen)[:, ::2]]  # last: non-contiguous


@pytest.mark.parametrize("case", range(len(_argmax_cases())))
def test_argmax_equals_torch_argmax(kernels, case):
    x = _argmax_cases()[case]
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(rng.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rejects_non_float32(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.rand(2, 4, dtype=torch.float64))
    assert torch.equal(rng.argmax_rows(torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float64)), torch.tensor([1]))
