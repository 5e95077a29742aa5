"""B7's peak RSS (``ascent/benchmarks/memory.py``): ``PeakWindow`` keeps the peak of loading and leaves out a bench
buffer allocated between loading and the run (the roofline calibration), where the kernel's mark can be restarted."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from ascent.benchmarks import memory

BUFFER_BYTES = 400 << 20


def _touch_and_free() -> None:
    """BUFFER_BYTES of fresh resident pages, unmapped at once. An anonymous mapping of its own, not a torch tensor:
    in a full CI run (after tests that had left a 3.9 GB peak) a 400 MiB tensor moved neither the peak nor the
    window's figures, as if an allocator served it from pages it still held resident."""
    buffer = mmap.mmap(-1, BUFFER_BYTES)
    pages = np.frombuffer(buffer, dtype=np.uint8)
    pages[::4096] = 1
    assert int(pages[::4096].sum()) == BUFFER_BYTES // 4096
    del pages
    buffer.close()


@pytest.fixture
def restartable() -> None:
    if not memory.restart_peak_rss():
        pytest.skip("this kernel cannot restart the peak-RSS mark (/proc/self/clear_refs)")


def test_window_leaves_out_a_buffer_between_loading_and_the_run(restartable) -> None:
    window = memory.PeakWindow()
    memory.restart_peak_rss()
    window.loaded()
    _touch_and_free()  # the calibration's place
    assert memory.peak_rss_bytes() >= window.load_peak + BUFFER_BYTES // 2
    window.start_run()
    assert window.excludes_bench_buffers
    assert window.peak_bytes() < window.load_peak + BUFFER_BYTES // 2


def test_window_keeps_the_peak_of_loading(restartable) -> None:
    window = memory.PeakWindow()
    memory.restart_peak_rss()
    base = memory.current_rss_bytes() or 0
    _touch_and_free()  # a load-time transient
    window.loaded()
    window.start_run()
    assert window.peak_bytes() >= base + BUFFER_BYTES // 2


def test_without_a_restart_the_peak_is_the_process_whole(restartable, monkeypatch) -> None:
    monkeypatch.setattr(memory, "restart_peak_rss", lambda: False)
    window = memory.PeakWindow()
    window.loaded()
    _touch_and_free()
    window.start_run()
    assert not window.excludes_bench_buffers
    assert window.peak_bytes() >= window.load_peak + BUFFER_BYTES // 2
