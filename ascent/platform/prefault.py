"""Committing the CPU KV cache's memory at start-up instead of at each block's first write during serving.

A large ``torch.empty`` on CPU is a fresh anonymous mapping: no page is resident until first written. Left so, every
KV block a request receives for the first time faults its pages in while a decode step writes it. vLLM allocates its
KV cache with ``torch.zeros`` and so commits it at start-up; on most hosts that costs a fraction of a second per GiB.
In some virtual machines it costs far more: on this project's CPU (a Zen 3 VM, 2 vCPUs, THP ``madvise``) committing
fresh memory ran at ~100 MB/s (2160 MiB: 21 s, where populating memory the host had backed already took 0.24 s). The
faults then come back during serving: SmolLM2 bf16, the throughput benchmark's 64 requests with a 2160 MiB cache,
one process per setting, alternating: 37.0 / 37.6 s lazy against 34.3 / 30.4 s committed beforehand (the decode
stack's KV writes 0.86 -> 0.28 s).

``commit_caches`` therefore commits the cache when the host does it quickly and leaves it lazy where it would stretch
start-up: ``ASCENT_CPU_KV_PREFAULT`` is ``auto`` (the default: populate a probe of ``PROBE_BYTES``, time it and go on
only when the whole cache would take at most ``BUDGET_S``, piece by piece, stopping where the budget runs out), ``1`` (always: the serving-time behaviour of vLLM, for
long-running servers and benchmarks of the steady state) or ``0`` (never). Committing uses ``MADV_POPULATE_WRITE``
(Linux >= 5.14: zero pages made resident, nothing written from user space); where the kernel refuses, ``1``
zero-fills the tensors and ``auto`` leaves them lazy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ascent.platform import huge_pages

ENV = "ASCENT_CPU_KV_PREFAULT"
MODES = ("auto", "1", "0")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PROBE_BYTES = 32 << 20  # the part ``auto`` populates and times first
BUDGET_S = 2.0  # start-up seconds ``auto`` may spend on the whole cache
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>

PopulateFn = Callable[[int, int], bool]


def prefault_mode() -> str:
    """``ASCENT_CPU_KV_PREFAULT``: ``auto`` (the default), ``1`` or ``0``; ``ValueError`` naming any other value."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw not in MODES:
        raise ValueError(f"{ENV}={raw!r} must be auto (commit the KV cache at start-up where that is quick), 1 "
                         f"(always) or 0 (never: pages fault in at first use)")
    return raw


def page_interior(address: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned part of ``[address, address + nbytes)`` (``huge_pages.aligned_interior``)."""
    return huge_pages.aligned_interior(address, nbytes, PAGE_BYTES)


def populate_range(start: int, length: int) -> bool:
    """``MADV_POPULATE_WRITE`` of ``[start, start + length)`` (page aligned); True when the kernel populated it."""
    madvise = huge_pages.libc_madvise()
    return madvise is not None and madvise(start, length, _MADV_POPULATE_WRITE) == 0


def tensor_interior(tensor: Any) -> tuple[int, int]:
    """The page-aligned part of a CPU tensor's storage (its partial first and last pages fault in at first use)."""
    storage = tensor.untyped_storage()
    return page_interior(storage.data_ptr(), storage.nbytes())


def commit_caches(caches: Sequence[Any], populate: PopulateFn = populate_range,
                  clock: Callable[[], float] = time.perf_counter) -> str:
    """Commit freshly allocated zero-page CPU tensors as ``prefault_mode()`` says; returns a one-line account for the
    log. Populating writes nothing, so tensors of fresh zero pages read as zeros in every mode. Huge-page advice
    comes first where torch's allocator did not give it, so that populated pages arrive huge."""
    mode = prefault_mode()
    ranges = [r for r in (tensor_interior(t) for t in caches) if r[1] > 0]
    total = sum(length for _, length in ranges)
    if mode == "0" or total == 0:
        return f"lazy ({ENV}=0)" if mode == "0" else "nothing to commit"
    if huge_pages.enabled_from_env() and not huge_pages.torch_allocates_huge_pages():
        huge_pages.advise_ranges(huge_pages.storage_ranges(caches), collapse=False)
    if mode == "auto":
        start, length = ranges[0]
        probe = min(length, PROBE_BYTES)
        began = clock()
        if not populate(start, probe):
            return "lazy (the kernel does not populate memory on request)"
        took = max(clock() - began, 1e-9)
        if took * total / probe > BUDGET_S:
            return (f"lazy: committing {total / 2**20:.0f} MiB would take ~{took * total / probe:.0f} s here "
                    f"({probe / 2**20 / took:.0f} MiB/s probed), over the {BUDGET_S:.0f} s start-up budget; "
                    f"{ENV}=1 commits it anyway")
        return _commit_within_budget(ranges, probe, total, populate, clock, began)
    if all(populate(start, length) for start, length in ranges):
        return f"{total / 2**20:.0f} MiB committed"
    for t in caches:
        t.zero_()
    return f"{total / 2**20:.0f} MiB committed by a zero fill (the kernel does not populate memory on request)"


def _commit_within_budget(ranges: list[tuple[int, int]], probed: int, total: int, populate: PopulateFn,
                          clock: Callable[[], float], began: float) -> str:
    """``auto`` after a quick probe (its ``probed`` bytes at the start of the first range are resident): the rest in
    pieces of ``PROBE_BYTES`` while the time since ``began`` stays within ``BUDGET_S``. A VM's commit rate drifts (a
    probe that promised under 2 s once preceded 3.9 s for 2160 MiB), so the budget is checked as it goes; what is
    left stays lazy, committed at each block's first write."""
    committed = probed
    for index, (start, length) in enumerate(ranges):
        offset = probed if index == 0 else 0
        while offset < length:
            if clock() - began > BUDGET_S:
                return (f"{committed / 2**20:.0f} of {total / 2**20:.0f} MiB committed within the {BUDGET_S:.0f} s "
                        f"start-up budget, the rest at first use; {ENV}=1 commits it all")
            piece = min(PROBE_BYTES, length - offset)
            if not populate(start + offset, piece):
                return f"{committed / 2**20:.0f} of {total / 2**20:.0f} MiB committed (the kernel refused the rest)"
            committed += piece
            offset += piece
    return f"{total / 2**20:.0f} MiB committed"
