"""B7 memory: the process's peak resident set against the engine's weights + KV cache.

The peak counts load-time transients (e.g. dequantizing a GGUF file) and the torch / Python runtime itself; the KV
cache counts at its full size, which is resident from start-up (``platform/prefault.py``) unless
``ASCENT_CPU_KV_PREFAULT=0`` leaves its untouched pages lazy. The bench's own buffers are not the engine's: a roofline
calibration between loading and the run (1 GiB and more) is left out by :class:`PeakWindow`, which keeps the peak
of loading and restarts the kernel's high-water mark (``/proc/self/clear_refs``) for the run. Call
``memory_report`` right after the engine's run, before a peer model is loaded.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

RSS_TARGET_RATIO = 1.3  # anchors_style_perf.md §2.4 B7: peak RSS <= 1.3 x (weights + KV)


def _tensor_bytes(tensors: Any, exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping those whose data pointer is in ``exclude``."""
    seen: set[int] = set(exclude or ())
    total = 0
    for t in tensors:
        key, nbytes = _storage(t)
        if key not in seen:  # tied weights share one storage
            seen.add(key)
            total += nbytes
    return total


def _storage(t: Any) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; an opaque tensor (e.g. oneDNN-packed) counts its own elements."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return id(t), t.numel() * t.element_size()


def _module_tensors(model: Any) -> list[Any]:
    """Every tensor the modules hold: parameters, buffers and plain attributes (packed weight copies live there), one
    level into lists, tuples, dicts and dataclass instances (``AmxWeight``, ``PanelWeight``)."""
    import dataclasses

    import torch

    found: list[Any] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, torch.Tensor))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.extend(v for f in dataclasses.fields(value) if isinstance(v := getattr(value, f.name), torch.Tensor))

    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            visit(value)
    return found


def current_rss_bytes() -> int | None:
    """Resident set size now (Linux ``/proc/self/statm``), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: Linux's ``VmHWM`` (the high-water mark ``restart_peak_rss`` resets),
    else ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def restart_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux ``clear_refs`` 5); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakWindow:
    """The engine's peak RSS without the bench's buffers in between: ``loaded()`` right after the engine is built
    records the peak so far (loading included), ``start_run()`` before the engine's run restarts the high-water mark,
    and ``peak_bytes()`` is the larger of the two peaks. Where the mark cannot be restarted the peak is the process's
    whole (``excludes_bench_buffers`` False)."""

    def __init__(self) -> None:
        self.load_peak = 0
        self.excludes_bench_buffers = False

    def loaded(self) -> None:
        self.load_peak = max(peak_rss_bytes(), current_rss_bytes() or 0)

    def start_run(self) -> None:
        self.excludes_bench_buffers = restart_peak_rss()

    def peak_bytes(self) -> int:
        return max(self.load_peak, peak_rss_bytes(), current_rss_bytes() or 0)


def memory_report(llm: Any, window: PeakWindow | None = None) -> dict[str, Any]:
    """Peak / current RSS (the peak of ``window`` when given, else the process's), the model's weight bytes (every
    tensor its modules hold, packed copies included, shared storage once; the KV cache bound to attention layers
    excluded) and the KV cache bytes; None figures for an engine whose model lives in worker processes."""
    current = current_rss_bytes()
    # the kernel updates the peak lazily, so a fresh current figure can exceed it
    peak = window.peak_bytes() if window is not None else max(peak_rss_bytes(), current or 0)
    report: dict[str, Any] = {"peak_rss_bytes": peak, "current_rss_bytes": current,
                              "peak_excludes_bench_buffers": bool(window and window.excludes_bench_buffers),
                              "weights_bytes": None, "kv_cache_bytes": None, "peak_rss_over_weights_plus_kv": None,
                              "target_ratio": RSS_TARGET_RATIO}
    try:
        runner = llm.llm_engine.engine_core.worker.model_runner
    except AttributeError:
        return report
    model = runner.model
    kv_storages = {_storage(t)[0] for t in runner.kv_caches}
    report["weights_bytes"] = _tensor_bytes(_module_tensors(model), exclude=kv_storages)
    report["kv_cache_bytes"] = _tensor_bytes(runner.kv_caches)
    report["peak_rss_over_weights_plus_kv"] = report["peak_rss_bytes"] / (report["weights_bytes"]
                                                                          + report["kv_cache_bytes"])
    return report
