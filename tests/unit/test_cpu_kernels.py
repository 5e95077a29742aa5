"""The fused C++ CPU kernels against the torch op sequences they replace (and SDPA over explicit gathers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascent.layers import cpu_kernels
from ascent.layers.rotary import get_rope
from tests.unit.attention_reference import reference_decode as _reference_decode

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32 results agree to rounding; half types to one ulp of the output (row reductions sum in another order)
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels.fused_ops()
    assert module is not None, "the CPU profile must build the fused kernels (a C++ compiler is a test requirement)"
    return module


@pytest.fixture(params=[0, 1, 2], ids=["scalar", "avx2", "avx512"])
def isa(ops, request):
    """Every instruction-set path of the bf16 kernels the CPU has (a level above it runs its best path)."""
    previous = ops.set_isa_limit(request.param)
    yield request.param
    ops.set_isa_limit(previous)


def test_isa_limit_rejects_bad_levels(ops):
    for level in (-1, 3):
        with pytest.raises(RuntimeError, match="isa level"):
            ops.set_isa_limit(level)
    assert ops.set_isa_limit(ops.set_isa_limit(1)) == 1


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_and_add_rms_norm_match_torch(ops, isa, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 200, generator=gen) * 3).to(dtype)
    x = wide[:, 10:170]  # row-strided view
    residual = torch.randn(rows, 160, generator=gen).to(dtype)
    weight = (torch.randn(160, generator=gen) * 0.5 + 1).to(dtype)
    _close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (160,), weight, 1e-6), dtype)
    out, total = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)  # the sum is rounded exactly as torch's add
    _close(out, F.rms_norm(x + residual, (160,), weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(ops, isa, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 2 * 300, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-3]).to(dtype)  # exp clamping and tiny values
    _close(ops.silu_and_mul(x), F.silu(x[:, :300]) * x[:, 300:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rotary_dim", [(True, 32), (True, 16), (False, 32), (False, 16)])
def test_rotary_in_place_equals_torch_rotation(ops, isa, dtype, neox, rotary_dim):
    head, tokens = 32, 6
    rope = get_rope(head, rotary_dim, 512, {"rope_theta": 10000.0}, neox, dtype)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, 7 * head, generator=gen).to(dtype)  # 4 q heads, 1 k head, then 2 heads untouched
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    want = qkv.clone()
    q, k = rope(positions, want[:, : 4 * head], want[:, 4 * head : 5 * head])
    want[:, : 4 * head], want[:, 4 * head : 5 * head] = q, k
    rows = rope.cos_sin_cache.index_select(0, positions)
    ops.rotary_(qkv[:, : 5 * head], rows, head, rotary_dim, neox)
    assert torch.equal(qkv, want)  # every product and sum rounded where torch rounds: bit-identical
    assert torch.equal(qkv[:, 5 * head :], want[:, 5 * head :])


def _paged_cache(dtype: torch.dtype, num_slots: int, kv_heads: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, num_slots, kv_heads, d, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,window", [(6, 2, 0), (4, 4, 0), (8, 1, 5)])
def test_paged_decode_attention_matches_sdpa_over_gathered_keys(ops, isa, dtype, heads, kv_heads, window):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, num_slots, n = 16, 96, 4
    cache = _paged_cache(dtype, num_slots, kv_heads, d, gen)
    lens = torch.tensor([1, 7, 23, 40])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:40] for _ in range(n)])  # scattered slots
    wide = torch.randn(n, heads * d + 8, generator=gen).to(dtype)
    q = wide[:, : heads * d]  # row-strided view, as a slice of a fused QKV output
    got = ops.paged_decode_attention(q, cache, slots, lens, heads, d**-0.5, window)
    _close(got, _reference_decode(q, cache, slots, lens, heads, d**-0.5, window), dtype)


@pytest.mark.parametrize("d,hidden", [(64, 100), (24, 576), (20, 13)])
def test_bf16_vector_paths_with_tails(ops, isa, d, hidden):
    """The AVX512 / AVX2 bf16 paths (head dims / hidden sizes that are not multiples of 16 or 8, contexts past 16
    keys)."""
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, hidden, generator=gen).bfloat16()
    residual = torch.randn(3, hidden, generator=gen).bfloat16()
    weight = torch.rand(hidden, generator=gen).bfloat16()
    _close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (hidden,), weight, 1e-6), torch.bfloat16)
    out, total = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)
    _close(out, F.rms_norm(x + residual, (hidden,), weight, 1e-6), torch.bfloat16)
    gate_up = (torch.randn(3, 2 * hidden, generator=gen) * 3).bfloat16()
    _close(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:], torch.bfloat16)
    heads, kv_heads, num_slots = 6, 2, 160
    cache = _paged_cache(torch.bfloat16, num_slots, kv_heads, d, gen)
    lens = torch.tensor([1, 17, 33, 150])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:150] for _ in range(4)])
    q = torch.randn(4, heads * d, generator=gen).bfloat16()
    for window in (0, 20):
        got = ops.paged_decode_attention(q, cache, slots, lens, heads, d**-0.5, window)
        _close(got, _reference_decode(q, cache, slots, lens, heads, d**-0.5, window), torch.bfloat16)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (4, 2), (6, 2), (8, 2), (8, 1), (5, 1), (12, 2), (7, 1)])
def test_grouped_bf16_attention_matches_sdpa(ops, isa, d, heads, kv_heads):
    """avx512_attention.h (all query heads of a KV head per pass; group * d / 16 <= 16) and, beyond that, the
    per-head AVX512 kernel; on AVX2 avx2_attention.h (groups 1 .. 8, 4- and 8-lane score rows, value passes of 1, 2
    and 4 blocks of 16 dims): contexts of 1 key, of a partial 16-key block and of several blocks (odd and even key
    counts), with and without a window."""
    gen = torch.Generator().manual_seed(d + heads)
    num_slots = 120
    cache = _paged_cache(torch.bfloat16, num_slots, kv_heads, d, gen)
    lens = torch.tensor([1, 5, 16, 47, 100])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:100] for _ in range(5)])
    q = (torch.randn(5, heads * d, generator=gen) * 2).bfloat16()
    for window in (0, 9):
        got = ops.paged_decode_attention(q, cache, slots, lens, heads, d**-0.5, window)
        _close(got, _reference_decode(q, cache, slots, lens, heads, d**-0.5, window), torch.bfloat16)


@pytest.mark.parametrize("d,heads,kv_heads", [(64, 9, 3), (128, 4, 2), (32, 4, 4), (64, 8, 2)])
def test_long_contexts_split_over_key_chunks_match_sdpa(ops, isa, d, heads, kv_heads):
    """split_attention.h: contexts past 256 keys in chunks (unnormalised partial sums merged by their maxima), on
    every ISA path (AVX512-BF16 and AVX2 chunk kernels; the scalar path runs whole contexts); around the chunk
    boundaries, with a window that keeps a row under / over the threshold, and a row's result independent of the
    rows batched with it."""
    gen = torch.Generator().manual_seed(d * heads)
    num_slots = 2200
    cache = _paged_cache(torch.bfloat16, num_slots, kv_heads, d, gen)
    lens = torch.tensor([256, 257, 600, 2049, 40])
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:2049] for _ in range(5)])
    q = (torch.randn(5, heads * d, generator=gen) * 2).bfloat16()
    scores_scale = d**-0.5
    for window in (0, 300, 200):
        got = ops.paged_decode_attention(q, cache, slots, lens, heads, scores_scale, window)
        _close(got, _reference_decode(q, cache, slots, lens, heads, scores_scale, window), torch.bfloat16)
        previous = ops.set_split_attention(0)
        try:  # the one-pass kernels on the same rows: equal up to the fp32 summation order
            _close(got, ops.paged_decode_attention(q, cache, slots, lens, heads, scores_scale, window), torch.bfloat16)
        finally:
            ops.set_split_attention(previous)
        for i in (2, 3):  # alone == batched, bit for bit
            alone = ops.paged_decode_attention(q[i : i + 1], cache, slots[i : i + 1], lens[i : i + 1], heads,
                                               scores_scale, window)
            assert torch.equal(alone[0], got[i])


def test_split_contexts_keep_peaked_and_flat_scores_exact(ops):
    """The merge weights chunks by exp(m_c - M): one key far above the rest in the last chunk takes all the weight,
    and equal keys everywhere give the plain mean of the values."""
    d, heads, kv_heads, n = 64, 2, 1, 1000
    cache = torch.zeros(2, n, kv_heads, d)
    cache[1] = torch.randn(n, kv_heads, d, generator=torch.Generator().manual_seed(3))
    q = torch.ones(1, heads * d)
    slots, lens = torch.arange(n).view(1, n), torch.tensor([n])
    flat = ops.paged_decode_attention(q.bfloat16(), cache.bfloat16(), slots, lens, heads, 1.0, 0)
    want = cache[1].bfloat16().float().mean(0).view(-1).repeat(heads)
    torch.testing.assert_close(flat.float().view(-1), want, atol=2e-3, rtol=1e-2)
    cache[0, n - 2] = 1.0  # score 64 at key n - 2: softmax puts ~all weight there
    peaked = ops.paged_decode_attention(q.bfloat16(), cache.bfloat16(), slots, lens, heads, 1.0, 0)
    assert torch.equal(peaked.view(heads, d)[0], cache[1, n - 2, 0].bfloat16())


def test_paged_decode_attention_rejects_bad_lengths_and_slots(ops):
    cache = torch.zeros(2, 8, 1, 4)
    q = torch.zeros(1, 4)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_decode_attention(q, cache, torch.zeros(1, 3, dtype=torch.int64), torch.tensor([4]), 1, 1.0, 0)
    with pytest.raises(RuntimeError, match="slot"):
        ops.paged_decode_attention(q, cache, torch.tensor([[0, 9]]), torch.tensor([2]), 1, 1.0, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kv_write_scatters_rows_to_slots(ops, dtype):
    gen = torch.Generator().manual_seed(3)
    cache = torch.zeros(2, 20, 12, dtype=dtype)
    kv = torch.randn(3, 30, generator=gen).to(dtype)
    k, v = kv[:, 2:14], kv[:, 14:26]  # adjacent column blocks of one tensor, row-strided
    slots = torch.tensor([7, 0, 19])
    ops.paged_kv_write(cache, k, v, slots)
    assert torch.equal(cache[0, slots], k) and torch.equal(cache[1, slots], v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[:, untouched].any()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_kv_write(cache, k, v, torch.tensor([1, 2, 20]))


def test_fused_ops_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("ASCENT_CPU_FUSED_OPS", "0")
    assert cpu_kernels.fused_ops() is None
    monkeypatch.setenv("ASCENT_CPU_FUSED_OPS", "1")
    assert cpu_kernels.fused_ops() is not None


def test_every_kernel_header_is_part_of_its_modules_build_hash():
    """The build hash covers the bytes of every header a source includes, found from its ``#include "..."`` lines
    (directly or through another source), so editing any header rebuilds the modules that use it."""
    from pathlib import Path

    from ascent.layers.cpu_kernels import _included

    kernel_dir = Path(_included.__code__.co_filename).parent
    headers = {p.name for p in kernel_dir.glob("*.h")}
    covered = {name for source in kernel_dir.glob("*.cpp") for name in _included(source.name)}
    assert headers <= covered, sorted(headers - covered)
    stack_sources = set(_included("decode_stack_cpu.cpp"))
    assert {"quant_wo_nv.h", "quant_int8_nv.h", "gemv_cpu.cpp", "gemv_avx2.h", "avx512_bf16.h",
            "stream_prefetch.h", "amx_prefill_attention.h", "parallel_team.h", "paged_attention_cpu.h",
            "out_rows.h", "warm_ahead.h"} <= stack_sources
    assert sorted(_included("gemv_cpu.cpp")) == ["bf16_round_avx2.h", "gemv_avx2.h", "gemv_panel_avx2.h",
                                                 "out_rows.h", "parallel_split.h", "parallel_team.h",
                                                 "stream_prefetch.h", "warm_ahead.h"]
