"""The decode stack's warm-ahead (``warm_ahead.h``): what each team thread prefetches while it waits must be the
first bytes it will read of the next projection's AMX weight stream, split exactly as the kernel's loop splits it."""

from __future__ import annotations

import pytest
import torch

from ascent.layers import cpu_kernels

from tests.unit.test_cpu_amx import _cpu_has_amx_bf16

pytestmark = pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="this CPU has no AMX-BF16 (the kernel cannot run)")

BUDGET = 512 * 1024  # bytes a thread warms per hint, over its parts


@pytest.fixture(scope="module")
def amx():
    module = cpu_kernels.amx_ops()
    assert module is not None
    return module


def _aten_split(n: int, grain: int, threads: int) -> list[tuple[int, int]]:
    """parallel_team.h's contract (ATen's OpenMP split): the [begin, end) of chunk i, chunk i on thread i."""
    if n <= grain or n == 1 or threads == 1:
        return [(0, n)]
    chunks = min(threads, -(-n // grain))
    size = -(-n // chunks)
    return [(b, min(n, b + size)) for b in range(0, n, size)]


def _kernel_loop(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """amx_linear's loop for m rows of x: (bytes per index, indices, grain, side-by-side streams per thread)."""
    block = (k // 32) * 1024  # one 16-column block of the packed weight
    if m == 1:
        return block, n // 16, 8, 4  # gemv_range: column blocks, four streams
    if 32 < m <= 64:
        return block, n // 16, 8, 1  # block_range64: column blocks front to back
    return 2 * block, (n // 16 + 1) // 2, 4, 1  # pair_range: pairs of column blocks


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 96), (576, 576), (960, 576), (3072, 576), (576, 1536),
                                 (49152, 576)])
@pytest.mark.parametrize("m", [1, 2, 32, 33, 48, 64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_thread_warms_the_start_of_its_own_part(amx, n, k, m, threads):
    wp = amx.amx_pack(torch.zeros(n, k, dtype=torch.bfloat16))
    index_bytes, count, grain, streams = _kernel_loop(m, n, k)
    ranges = _aten_split(count, grain, threads)
    plans = amx.amx_warm_plans(wp, m, threads)
    assert len(plans) == threads
    for tid, (first, part_bytes, parts, limit) in enumerate(plans):
        if tid >= len(ranges):  # a thread without a chunk warms nothing
            assert (first, limit) == (-1, 0)
            continue
        begin, end = ranges[tid]
        part = (end - begin) // streams
        want_parts = streams if part > 0 else 1
        want_part_bytes = (part if part > 0 else end - begin) * index_bytes
        assert (first, part_bytes, parts) == (begin * index_bytes, want_part_bytes, want_parts)
        assert limit == min(want_part_bytes, BUDGET // want_parts)
    # the chunks cover the whole stream once, in order
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
