"""Transparent huge pages (THP) for the engine's large host buffers: weights, the KV cache, logits.

A decode step streams every weight once and reads the KV blocks of every running request; with 4 KiB pages each such
stream takes a TLB miss per page, and in a virtual machine every miss is a two-level page walk. Measured on this
project's CPU (a Zen 4 VM, 2 vCPUs, THP mode ``madvise``):

- a plain read of random 6 KiB KV-sized blocks (software prefetch one block ahead): 12 -> 21 GB/s; a sequential
  read: 21 -> 32 GB/s (one process per setting, alternating);
- in one process, two engines alternating, one with its memory advised: SmolLM2 W8A8-dynamic batch-1 decode 1.030x
  (every one of 5 rounds faster), bf16 0.98x (noise); the decode attention kernel at 64 rows x 180 keys 1.10x.

Two mechanisms:

1. torch's own: with ``THP_MEM_ALLOC_ENABLE=1`` c10's CPU allocator advises every allocation of 2 MiB or more
   ``MADV_HUGEPAGE``. torch reads the variable once, at its first allocation, so ``import ascent`` sets it
   (``ascent/__init__.py``, before anything imports torch) when torch is not imported yet and the user did not set
   it. This covers the KV cache, logits and large activations.
2. The worker, once the model is loaded and its KV cache allocated, collapses the weights' memory onto huge pages
   (``MADV_HUGEPAGE`` then ``MADV_COLLAPSE``, Linux >= 6.1; populated memory moves, contents unchanged). Most
   projections are allocations under 2 MiB, which mechanism 1 leaves on 4 KiB pages, but they lie next to each
   other, so their merged ranges span huge pages. When torch was imported before ascent (no mechanism 1), the
   worker also advises the KV cache ``MADV_HUGEPAGE`` (its pages are faulted in lazily, so they arrive huge).

``ASCENT_CPU_HUGE_PAGES=0`` turns both off (read at import for 1, at KV-cache allocation for 2). Failures (no THP
in the kernel, mode ``never``, an old kernel without ``MADV_COLLAPSE``, no free huge pages) leave the memory as it
was; nothing here changes a tensor's contents.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from typing import Any

ENV = "ASCENT_CPU_HUGE_PAGES"
TORCH_ENV = "THP_MEM_ALLOC_ENABLE"
HUGE_PAGE_BYTES = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # <linux/mman.h>


def enabled_from_env() -> bool:
    """Whether huge pages are wanted (``ASCENT_CPU_HUGE_PAGES``: 1, the default, or 0; ``ValueError`` otherwise)."""
    raw = os.environ.get(ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV}={raw!r} must be 1 (use transparent huge pages) or 0 (off)")
    return raw == "1"


def thp_mode(path: str = THP_SETTING) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), None where the kernel has no THP."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def torch_allocates_huge_pages() -> bool:
    """Whether torch's CPU allocator advises its 2 MiB+ allocations ``MADV_HUGEPAGE`` (mechanism 1): torch read
    ``THP_MEM_ALLOC_ENABLE`` at its first allocation, which for a variable set before the process started or by
    ``import ascent`` before torch is its value now. (Probing an allocation's mapping would be fooled by heap ranges
    that earlier engines' weights left advised.)"""
    return os.environ.get(TORCH_ENV, "").strip() == "1"


def process_state() -> dict[str, Any]:
    """What holds for this process, for benchmark reports: the kernel's THP mode, whether torch's allocator advises
    its large allocations, and the ``ASCENT_CPU_HUGE_PAGES`` switch."""
    return {"kernel_mode": thp_mode(), "torch_allocator": torch_allocates_huge_pages(), "enabled": enabled_from_env()}


def libc_madvise() -> Any:
    """libc's ``madvise(addr, length, advice) -> int`` through ctypes, or None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def aligned_interior(address: int, nbytes: int, align: int) -> tuple[int, int]:
    """The ``align``-aligned part ``(start, length)`` of ``[address, address + nbytes)``; length 0 when there is
    none."""
    start = -(-address // align) * align
    end = (address + nbytes) // align * align
    return start, max(end - start, 0)


def huge_interior(address: int, nbytes: int) -> tuple[int, int]:
    """The 2 MiB-aligned part of ``[address, address + nbytes)`` (``aligned_interior``)."""
    return aligned_interior(address, nbytes, HUGE_PAGE_BYTES)


def storage_ranges(tensors: Iterable[Any]) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges of the distinct CPU storages among ``tensors``, sorted; tensors on other devices
    and opaque (oneDNN-packed) ones are skipped."""
    import torch

    ranges = set()
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return sorted(ranges)


def merge_ranges(ranges: list[tuple[int, int]], max_gap: int = 64 << 10) -> list[tuple[int, int]]:
    """Sorted ranges merged where they overlap or lie at most ``max_gap`` bytes apart: the weights of one layer are
    separate heap allocations under 2 MiB each but sit next to each other, so only their union spans huge pages."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def advise_ranges(ranges: Iterable[tuple[int, int]], collapse: bool) -> int:
    """Advise the 2 MiB-aligned interior of each range ``MADV_HUGEPAGE`` and, with ``collapse``, ``MADV_COLLAPSE``
    it now (populated memory moves onto huge pages; contents unchanged); returns the bytes the kernel accepted."""
    madvise = libc_madvise()
    if madvise is None:
        return 0
    accepted = 0
    for start, end in ranges:
        begin, length = huge_interior(start, end - start)
        if length == 0 or madvise(begin, length, _MADV_HUGEPAGE) != 0:
            continue
        if not collapse or madvise(begin, length, _MADV_COLLAPSE) == 0:
            accepted += length
    return accepted


def module_tensors(model: Any) -> list[Any]:
    """Every tensor a model holds: parameters, buffers and plain tensor attributes of its modules (packed copies)."""
    import torch

    out: list[Any] = []
    for module in model.modules():
        out.extend(module.parameters(recurse=False))
        out.extend(module.buffers(recurse=False))
        out.extend(v for v in vars(module).values() if isinstance(v, torch.Tensor))
    return out


def advise_engine_memory(weights: Iterable[Any], kv_caches: Iterable[Any]) -> str:
    """Huge pages for a loaded worker: the weights' memory (merged ranges) collapsed onto huge pages in any case (most
    projections are allocations under 2 MiB, which torch's allocator leaves on 4 KiB pages), the KV cache advised
    when torch's allocator does not do it (mechanism 2); returns a one-line description for the log."""
    if not enabled_from_env():
        return f"off ({ENV}=0)"
    mode = thp_mode()
    if mode in (None, "never"):
        return f"unavailable (kernel THP mode: {mode or 'none'})"
    collapsed = advise_ranges(merge_ranges(storage_ranges(weights)), collapse=True)
    weights_note = f"{collapsed / 2**20:.0f} MiB of weights collapsed onto huge pages"
    if torch_allocates_huge_pages():
        return f"torch allocations of 2 MiB and more ({TORCH_ENV}=1), {weights_note} (kernel mode {mode})"
    advised = advise_ranges(storage_ranges(kv_caches), collapse=False)
    return (f"{weights_note}, {advised / 2**20:.0f} MiB of KV cache advised (torch was imported before ascent, so "
            f"its allocator keeps 4 KiB pages; kernel mode {mode})")
