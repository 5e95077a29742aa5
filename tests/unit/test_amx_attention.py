"""AMX decode attention (``amx_attention.h``): rows of one request that share their keys (a speculative verification
step's expanded rows) against SDPA over explicit gathers, against the AVX512 kernels, and row by row invariant to how
rows are grouped."""

from __future__ import annotations

import pytest
import torch

from ascent.layers import cpu_kernels
from tests.unit.attention_reference import reference_decode as _reference

BLOCK = 16
ATOL = 2e-2  # one bf16 ulp of the outputs: the kernels differ in summation order (and p's 16-bit split)


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels.fused_ops()
    assert module is not None, "the CPU profile must build the fused kernels (a C++ compiler is a test requirement)"
    return module


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return " amx_bf16" in flags and " amx_tile" in flags


def _paged_slots(num_pages: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of a request whose KV lives in random pages of BLOCK consecutive slots (16-key tiles load straight)."""
    pages = torch.randperm(num_pages, generator=gen)[: (length + BLOCK - 1) // BLOCK]
    return (pages[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:length]


def _verification_batch(gen: torch.Generator, num_slots: int, width: int):
    """Rows as the SDPA backend expands them: request A (paged, 7 rows: longer than one unit for group >= 3),
    a plain decode row, request C (scattered slots, 3 rows), and two one-row requests with consecutive lengths but
    different slots (they must not be grouped)."""
    rows, lens = [], []
    a = _paged_slots(num_slots // BLOCK, width, gen)
    for t in range(7):
        rows.append(a)
        lens.append(40 + t)
    rows.append(_paged_slots(num_slots // BLOCK, width, gen))
    lens.append(29)
    c = torch.randperm(num_slots, generator=gen)[:width]
    for t in range(3):
        rows.append(c)
        lens.append(3 + t)
    for t in range(2):
        rows.append(torch.randperm(num_slots, generator=gen)[:width])
        lens.append(60 + t)
    return torch.stack(rows), torch.tensor(lens)


def test_amx_availability_follows_the_cpu(ops):
    assert ops.amx_attention_available(64, 3) == _cpu_has_amx()
    assert not ops.amx_attention_available(48, 3)  # head dims 32 / 64 / 128 only
    assert not ops.amx_attention_available(64, 17)  # more query heads per KV head than a unit's 16 columns


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [0, 7])
def test_shared_key_rows_match_sdpa_and_the_avx512_kernel(ops, d, heads, kv_heads, window):
    gen = torch.Generator().manual_seed(d * 100 + heads * 10 + kv_heads + window)
    num_slots = 320
    cache = torch.randn(2, num_slots, kv_heads, d, generator=gen).bfloat16()
    slots, lens = _verification_batch(gen, num_slots, 64)
    q = (torch.randn(len(lens), heads * d + 8, generator=gen) * 2).bfloat16()[:, : heads * d]  # row-strided view
    scale = d**-0.5
    got = ops.paged_decode_attention(q, cache, slots, lens, heads, scale, window)
    want = _reference(q, cache, slots, lens, heads, scale, window)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=ATOL)
    previous = ops.set_amx_attention(0)
    try:
        avx = ops.paged_decode_attention(q, cache, slots, lens, heads, scale, window)
    finally:
        ops.set_amx_attention(previous)
    torch.testing.assert_close(got.float(), avx.float(), atol=ATOL, rtol=ATOL)


def test_a_row_gets_the_same_output_in_any_run(ops):
    """Each column of a unit depends only on its own query and keys: rows of a verification run computed with the
    whole run, with a shorter run and one row per call are bit-identical (speculative verification and plain decode
    give a row the same attention output)."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, num_slots = 9, 3, 64, 256
    cache = torch.randn(2, num_slots, kv_heads, d, generator=gen).bfloat16()
    slot_row = _paged_slots(num_slots // BLOCK, 100, gen)
    lens = torch.arange(70, 75)
    slots = slot_row.expand(len(lens), -1).contiguous()
    q = torch.randn(len(lens), heads * d, generator=gen).bfloat16()
    whole = ops.paged_decode_attention(q, cache, slots, lens, heads, 0.125, 0)
    tail = ops.paged_decode_attention(q[3:], cache, slots[3:], lens[3:], heads, 0.125, 0)
    assert torch.equal(whole[3:], tail)
    single = torch.cat([ops.paged_decode_attention(q[i : i + 1], cache, slots[i : i + 1], lens[i : i + 1], heads,
                                                   0.125, 0) for i in range(len(lens))])
    if ops.amx_attention_available(d, heads // kv_heads):
        assert torch.equal(whole, single)
    else:
        torch.testing.assert_close(whole.float(), single.float(), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(whole, _reference(q, cache, slots, lens, heads, 0.125, 0), atol=ATOL, rtol=ATOL)


def test_rows_with_other_slots_are_not_grouped(ops):
    """Consecutive lengths alone do not make a run: a second request whose slots differ in one position keeps its
    own keys (a wrong grouping would attend to the first request's value there)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, num_slots = 6, 2, 64, 128
    cache = torch.randn(2, num_slots, kv_heads, d, generator=gen).bfloat16()
    first = torch.arange(48)
    second = first.clone()
    second[5] = 100  # one different slot inside both rows' contexts
    slots = torch.stack([first, first, second, second])
    lens = torch.tensor([20, 21, 22, 23])
    q = torch.randn(4, heads * d, generator=gen).bfloat16()
    got = ops.paged_decode_attention(q, cache, slots, lens, heads, 0.125, 0)
    torch.testing.assert_close(got, _reference(q, cache, slots, lens, heads, 0.125, 0), atol=ATOL, rtol=ATOL)


def test_amx_switch_off_by_environment():
    """ASCENT_CPU_AMX=0 turns the AMX attention off (read once per process: checked in a fresh one)."""
    import os
    import subprocess
    import sys

    code = "from ascent.layers import cpu_kernels; print(cpu_kernels.fused_ops().amx_attention_available(64, 3))"
    env = {**os.environ, "ASCENT_CPU_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
