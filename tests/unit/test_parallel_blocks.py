"""``parallel_blocks.h``: a weight-block loop balanced by stealing. Every block must be taken exactly once whatever
the timing, a thread's own chunk from the front in side-by-side units, and a slow thread's chunk finished by the
others from the back."""

from __future__ import annotations

import pytest
import torch

from ascent.layers import cpu_kernels

from tests.unit.test_cpu_amx import _cpu_has_amx_bf16

pytestmark = pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="the helper lives in the AMX kernel's module")


@pytest.fixture(scope="module")
def amx():
    module = cpu_kernels.amx_ops()
    assert module is not None
    return module


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield lambda n: torch.set_num_threads(n)
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 70, 257])
@pytest.mark.parametrize("grain", [1, 8])
@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("pause_us", [0, 300])
def test_every_block_is_taken_once(amx, threads, n, grain, streams, num_threads, pause_us):
    threads(num_threads)
    trace = amx.parallel_blocks_trace(n, grain, streams, pause_us)
    assert [taken for taken, _, _ in trace] == [1] * n


def test_a_slow_threads_chunk_is_finished_from_the_back(amx, threads):
    threads(2)
    n, streams = 70, 4  # chunks [0, 35) and [35, 70): 8 side-by-side units of 4 blocks, then 3 single leftovers
    trace = amx.parallel_blocks_trace(n, 8, streams, 2000)
    assert [taken for taken, _, _ in trace] == [1] * n
    chunk0 = trace[:35]
    assert [size for _, _, size in chunk0] == [4] * 32 + [1] * 3
    # unit u of the side-by-side passes holds blocks u, 8 + u, 16 + u, 24 + u: one thread for all four
    owner = [chunk0[u][1] for u in range(8)]
    assert all(chunk0[s * 8 + u][1] == owner[u] for s in range(4) for u in range(8))
    # the slow thread 0 kept a front of its units; thread 1 took the leftovers and the last passes
    assert owner[0] == 0
    stolen = [u for u in range(8) if owner[u] == 1]
    assert stolen and stolen == list(range(8 - len(stolen), 8))
    assert all(thread == 1 for _, thread, _ in chunk0[32:])
    assert all(thread == 1 for _, thread, _ in trace[35:])


def test_one_thread_takes_every_block(amx, threads):
    threads(1)
    trace = amx.parallel_blocks_trace(64, 8, 4, 0)
    assert {thread for _, thread, _ in trace} == {0}
