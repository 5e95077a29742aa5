"""The AMX bf16 linear (``amx_linear_cpu.cpp``) and its place in the CPU linear dispatch (``cpu_packing``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascent.layers import cpu_kernels, cpu_packing


def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags and "amx_tile" in flags


pytestmark = pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="this CPU has no AMX-BF16 (the kernel cannot run)")


@pytest.fixture(scope="module")
def amx():
    module = cpu_kernels.amx_ops()
    assert module is not None, "a CPU with AMX-BF16 must get the AMX kernel"
    return module


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


def _assert_bf16_of(got: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (bf16) is the exact product rounded once, up to fp32 summation error: within one bf16 ulp."""
    assert got.dtype == torch.bfloat16
    tol = exact.abs() * 2.0**-8 + 1e-6 * exact.abs().max()
    assert bool(((got.double() - exact).abs() <= tol).all())


def test_pack_layout(amx):
    w = torch.randn(48, 96).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    assert wp.shape == (3, 3, 16, 32)
    for nb, kb, r, c, t in [(0, 0, 0, 0, 0), (2, 1, 5, 7, 1), (1, 2, 15, 15, 0), (2, 2, 9, 3, 1)]:
        assert wp[nb, kb, r, 2 * c + t] == w[16 * nb + c, 32 * kb + 2 * r + t]


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (96, 576)])
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 32, 33, 47, 48, 49, 64, 65, 100])
def test_linear_is_the_exact_product_rounded(amx, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    _assert_bf16_of(amx.amx_linear(x, wp, None), _exact(x, w, None))
    _assert_bf16_of(amx.amx_linear(x, wp, bias), _exact(x, w, bias))


@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_float_output_is_the_rounded_bf16_widened(amx, m):
    """``float_out`` (the lm_head's logits) stores the very bf16 values as fp32: bit-equal to converting them."""
    gen = torch.Generator().manual_seed(m)
    w = (torch.randn(96, 64, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(2, m, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    for b in (None, bias):
        got = amx.amx_linear(x, wp, b, True)
        assert got.dtype == torch.float32 and got.shape == (2, m, 96)
        assert torch.equal(got, amx.amx_linear(x, wp, b).float())
    tiles = cpu_packing.AmxWeight(amx, wp)
    via_dispatch = cpu_packing.cpu_linear(x, w, None, None, None, tiles, float_output=True)
    assert via_dispatch.dtype == torch.float32 and torch.equal(via_dispatch, amx.amx_linear(x, wp, None).float())
    plain = cpu_packing.cpu_linear(x, w, None, None, None, None, float_output=True)  # other paths: their own dtype
    assert plain.dtype == torch.bfloat16


@pytest.mark.parametrize("n,k", [(16, 32), (80, 1536), (960, 576)])
def test_one_row_takes_the_dot_product_path_on_the_same_tiles(amx, n, k):
    """A single row of x (batch-1 decode) reads the packed weight with AVX512-BF16 dot products instead of tiles: the
    exact product rounded once, for a 1-D x, an x row at an odd element offset, with bias, and as fp32 logits."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    wide = torch.randn(3, k + 3, generator=gen).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    for x in (wide[1, 1:k + 1], wide[2:3, 3:], wide[0:1, :k].contiguous()):
        exact = _exact(x.reshape(1, k), w, bias)
        got = amx.amx_linear(x, wp, bias)
        assert got.shape == (*x.shape[:-1], n)
        _assert_bf16_of(got.reshape(1, n), exact)
        assert torch.equal(amx.amx_linear(x, wp, bias, True), got.float())
    poisoned = wide[0, :k].clone()
    poisoned[k // 2] = float("nan")
    assert bool(amx.amx_linear(poisoned, wp, None).isnan().all())


@pytest.mark.parametrize("n,k", [(144, 64), (368, 96), (3200, 576)])
def test_one_row_streams_cover_every_block_in_one_order(amx, n, k):
    """Each thread reads its column blocks as four side-by-side streams plus the blocks left over one at a time: every
    block is computed (the exact product rounded once), and since a block's sums keep one order whichever stream or
    leftover pass reads it, 1, 2 and 3 threads (other cuts into parts) give the same bits."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(amx.amx_linear(x, wp, bias))
    finally:
        torch.set_num_threads(threads)
    _assert_bf16_of(outs[0], _exact(x, w, bias))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_leading_dims_strides_and_bad_inputs(amx):
    w = torch.randn(32, 64).to(torch.bfloat16)
    wp = amx.amx_pack(w)
    wide = torch.randn(2, 3, 80).to(torch.bfloat16)
    x = wide[..., 8:72]  # [2, 3, 64] non-contiguous rows
    got = amx.amx_linear(x, wp, None)
    assert got.shape == (2, 3, 32)
    _assert_bf16_of(got.reshape(6, 32), _exact(x.reshape(6, 64), w, None))
    with pytest.raises(RuntimeError, match="N % 16"):
        amx.amx_pack(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K % 32"):
        amx.amx_pack(torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dim"):
        amx.amx_linear(torch.zeros(1, 32, dtype=torch.bfloat16), wp, None)
    with pytest.raises(RuntimeError, match="bf16"):
        amx.amx_linear(torch.zeros(1, 64), wp, None)


def test_dispatch_takes_amx_up_to_its_row_limit(amx, monkeypatch):
    w = (torch.randn(64, 32) * 0.1).to(torch.bfloat16)
    tiles = cpu_packing.amx_linear_weight(w)
    assert tiles is not None and tiles.nbytes == w.numel() * 2
    packed = cpu_packing.pack_linear_weight(w)
    calls = []

    class Recorder:
        def amx_linear(self, x, wp, bias, float_out=False):
            calls.append(x.shape[0])
            return amx.amx_linear(x, wp, bias, float_out)

    recorded = cpu_packing.AmxWeight(Recorder(), tiles.packed)
    for m in (1, 7, cpu_packing.AMX_MAX_M, cpu_packing.AMX_MAX_M + 1):
        x = torch.randn(m, 32).to(torch.bfloat16)
        got = cpu_packing.cpu_linear(x, torch.empty(0, dtype=torch.bfloat16), packed, None, None, recorded)
        torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    assert calls == [1, 7, cpu_packing.AMX_MAX_M]  # above the limit: the oneDNN-packed weight
    fp32 = torch.randn(3, 32)
    with pytest.raises(RuntimeError):  # fp32 activations never reach the bf16 tiles: F.linear on the plain weight
        cpu_packing.cpu_linear(fp32, torch.empty(0, dtype=torch.bfloat16), None, None, None, recorded)
    assert calls == [1, 7, cpu_packing.AMX_MAX_M]
    monkeypatch.setenv("ASCENT_CPU_AMX", "0")
    assert cpu_packing.amx_linear_weight(w) is None
    monkeypatch.delenv("ASCENT_CPU_AMX")
    assert cpu_packing.amx_linear_weight(w.float()) is None and cpu_packing.amx_linear_weight(w[:, :16]) is None


def test_lm_head_logits_come_from_the_tiles_as_fp32(amx):
    """The lm_head's fp32 logits are the AMX tiles' bf16 values widened, straight from the kernel."""
    from ascent.layers.embed_head import ParallelLMHead

    vocab, dim = 112, 64
    table = (torch.randn(vocab, dim) * 0.1).to(torch.bfloat16)
    head = ParallelLMHead(vocab, dim, params_dtype=torch.bfloat16)
    head.weight.weight_loader(head.weight, table)
    head.process_weights_after_loading()
    assert head.amx_weight is not None
    hidden = torch.randn(5, dim).to(torch.bfloat16)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, vocab) and logits.is_contiguous()
    assert torch.equal(logits, amx.amx_linear(hidden, head.amx_weight.packed, None).float())
    _assert_bf16_of(logits.to(torch.bfloat16), _exact(hidden, table, None))
    seen = []

    class Recorder:
        def amx_linear(self, x, wp, bias, float_out=False):
            seen.append(float_out)
            return amx.amx_linear(x, wp, bias, float_out)

    head.amx_weight = cpu_packing.AmxWeight(Recorder(), head.amx_weight.packed)
    assert torch.equal(head(hidden), logits) and seen == [True]  # one pass, no separate conversion
