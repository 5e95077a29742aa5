"""Committing the CPU KV cache's memory at start-up (ascent/platform/prefault.py, ModelRunner.initialize_kv_cache)."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import mmap
import os
import sys

import pytest
import torch

from ascent.platform import prefault
from ascent.worker.model_runner import LAZY_CACHE_BYTES, _allocate_cache

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore / madvise are Linux's")
MIB = 1 << 20


def resident_fraction(tensor: torch.Tensor) -> float:
    """Fraction of the pages of the tensor's page-aligned interior that are resident (``mincore``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    start, length = prefault.tensor_interior(tensor)
    pages = length // prefault.PAGE_BYTES
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages


_MAPPINGS: list[mmap.mmap] = []  # kept open: the tensors below are views of them


def fresh(nbytes: int = 64 * MIB) -> torch.Tensor:
    """A uint8 tensor over a new anonymous mapping: zero pages, none resident yet (a large ``torch.empty`` is
    usually one too, but the allocator may hand back memory a previous test used)."""
    mapping = mmap.mmap(-1, nbytes)
    _MAPPINGS.append(mapping)
    t = torch.frombuffer(mapping, dtype=torch.uint8)
    assert resident_fraction(t) == 0.0  # the premise every test below builds on
    return t


def kernel_has_populate() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


def ticking_clock(seconds_per_call: float):
    """A fake clock advancing ``seconds_per_call`` at every reading: the probe then seems to take that long."""
    counter = itertools.count()
    return lambda: next(counter) * seconds_per_call


def test_mode_from_env(monkeypatch):
    monkeypatch.delenv(prefault.ENV, raising=False)
    assert prefault.prefault_mode() == "auto"
    for value in ("1", "0", "AUTO"):
        monkeypatch.setenv(prefault.ENV, value)
        assert prefault.prefault_mode() == value.lower()
    monkeypatch.setenv(prefault.ENV, "yes")
    with pytest.raises(ValueError, match="ASCENT_CPU_KV_PREFAULT='yes'"):
        prefault.prefault_mode()


def test_page_interior():
    p = prefault.PAGE_BYTES
    assert prefault.page_interior(p, 3 * p) == (p, 3 * p)
    assert prefault.page_interior(p + 16, 3 * p) == (2 * p, 2 * p)
    assert prefault.page_interior(p + 16, p) == (2 * p, 0)


@linux_only
def test_populate_makes_fresh_pages_resident_and_keeps_them_zero():
    if not kernel_has_populate():
        pytest.skip(f"kernel {os.uname().release} has no MADV_POPULATE_WRITE (5.14+)")
    t = fresh()
    assert prefault.populate_range(*prefault.tensor_interior(t))
    assert resident_fraction(t) == 1.0 and int(t.max()) == 0


@linux_only
def test_auto_commits_when_the_probe_is_quick_and_stays_lazy_when_slow(monkeypatch):
    monkeypatch.setenv(prefault.ENV, "auto")
    quick = [fresh(), fresh()]  # 128 MiB: a probe of 32 MiB at 1 ms means ~4 ms in all
    assert prefault.commit_caches(quick, clock=ticking_clock(1e-3)) == "128 MiB committed"
    assert all(resident_fraction(t) == 1.0 for t in quick)
    slow = [fresh(), fresh()]  # the probe at 1 s means ~4 s in all, over the 2 s budget
    note = prefault.commit_caches(slow, clock=ticking_clock(1.0))
    assert note.startswith("lazy: committing 128 MiB would take ~4 s") and "ASCENT_CPU_KV_PREFAULT=1" in note
    assert resident_fraction(slow[1]) < 0.5  # only the probe's part of the first tensor was touched
    refused = [fresh()]
    note = prefault.commit_caches(refused, populate=lambda start, length: False)
    assert note.startswith("lazy") and resident_fraction(refused[0]) < 0.5


def test_auto_stops_at_the_budget_when_committing_slows_after_the_probe(monkeypatch):
    """A quick probe followed by a slow host: ``auto`` commits piece by piece and stops once the start-up budget is
    spent, leaving the rest lazy (a VM's commit rate drifts: a probe promising under 2 s preceded 3.9 s)."""
    monkeypatch.setenv(prefault.ENV, "auto")
    readings = iter([0.0, 0.001] + [0.9 * i for i in range(1, 100)])  # probe 1 ms, then 0.9 s per piece
    caches = [fresh(), fresh()]  # 128 MiB: the probe + 3 pieces of 32 MiB
    note = prefault.commit_caches(caches, clock=lambda: next(readings))
    assert note.startswith("96 of 128 MiB committed within the 2 s start-up budget"), note
    assert resident_fraction(caches[0]) == 1.0 and resident_fraction(caches[1]) == pytest.approx(0.5, abs=0.01)
    refusing = [fresh()]  # the kernel takes the probe, then refuses
    calls = iter([True, False])
    note = prefault.commit_caches(refusing, populate=lambda start, length: next(calls), clock=ticking_clock(1e-3))
    assert note == "32 of 64 MiB committed (the kernel refused the rest)"


@linux_only
def test_forced_and_disabled_modes(monkeypatch):
    monkeypatch.setenv(prefault.ENV, "1")
    forced = [fresh()]
    assert prefault.commit_caches(forced, clock=ticking_clock(100.0)) == "64 MiB committed"  # no budget
    assert resident_fraction(forced[0]) == 1.0
    refused = [fresh()]
    note = prefault.commit_caches(refused, populate=lambda start, length: False)
    assert "zero fill" in note and resident_fraction(refused[0]) == 1.0 and int(refused[0].max()) == 0
    monkeypatch.setenv(prefault.ENV, "0")
    lazy = [fresh()]
    assert prefault.commit_caches(lazy) == "lazy (ASCENT_CPU_KV_PREFAULT=0)" and resident_fraction(lazy[0]) < 0.5


def test_small_cpu_caches_are_zero_filled():
    small = _allocate_cache((2, 4, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert small.nbytes < LAZY_CACHE_BYTES and not small.any()


@linux_only
@pytest.mark.parametrize("mode", ["1", "0"])
def test_engine_commits_its_cpu_kv_cache_as_the_mode_says(monkeypatch, tiny_llama_dir, mode):
    from ascent import LLM, SamplingParams

    monkeypatch.setenv(prefault.ENV, mode)
    llm = LLM(model=tiny_llama_dir, kv_cache_memory_bytes=256 * MIB, max_model_len=128)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    big = [c for c in runner.kv_caches if c.nbytes >= LAZY_CACHE_BYTES]
    assert big, "the test needs caches on the lazy path"
    if mode == "1":
        assert runner.kv_commit.endswith("MiB committed")
        assert all(resident_fraction(c.view(-1)) == 1.0 for c in big)
    else:
        assert runner.kv_commit == "lazy (ASCENT_CPU_KV_PREFAULT=0)"
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
