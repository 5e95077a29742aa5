"""``torch.profiler`` sessions written as Chrome traces: the portable form of the seed's NPU profiler wrapper.

A wrapper profiles the thread that starts it (the engine thread calls ``start``/``stop`` between steps). Each session
writes one ``<timestamp>_<name>_pid<pid>.pt.trace.json`` (optionally gzipped) into ``trace_dir``; CPU-only sessions
also write a ``.summary.txt`` table of the ops sorted by ``self_cpu_time_total``.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)

SUMMARY_ROWS = 50


def profiler_activities() -> list[ProfilerActivity]:
    """CPU always, plus CUDA when a CUDA device is available."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return activities


class TorchProfilerWrapper:
    """Start/stop a ``torch.profiler.profile`` session; ``stop`` exports the trace and returns its path.

    Raises ``RuntimeError`` on ``start`` while a session is active and on ``stop`` without one; ``ValueError`` for an
    empty ``trace_dir``.
    """

    def __init__(self, trace_dir: str | os.PathLike[str], name: str = "ascent", record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, with_flops: bool = False,
                 use_gzip: bool = False) -> None:
        if not str(trace_dir).strip():
            raise ValueError(f"trace_dir={trace_dir!r} must name a directory")
        self.trace_dir = Path(trace_dir)
        self.name = name
        self.use_gzip = use_gzip
        self._options = {"record_shapes": record_shapes, "profile_memory": profile_memory,
                         "with_stack": with_stack, "with_flops": with_flops}
        self._profiler: profile | None = None
        self.last_summary_path: str | None = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        """Begin a session (creates ``trace_dir``)."""
        if self._profiler is not None:
            raise RuntimeError("torch profiler is already running; call stop() first")
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        prof = profile(activities=profiler_activities(), **self._options)
        prof.start()
        self._profiler = prof
        logger.info("torch profiler started (traces go to %s)", self.trace_dir)

    def stop(self) -> str:
        """End the session, write the Chrome trace and return its path."""
        if self._profiler is None:
            raise RuntimeError("torch profiler is not running; call start() first")
        prof, self._profiler = self._profiler, None
        prof.stop()
        path = self._new_trace_path()
        prof.export_chrome_trace(str(path))
        if self.use_gzip:
            path = _gzip_file(path)
        if not torch.cuda.is_available():
            self.last_summary_path = self._write_summary(prof, path)
        logger.info("torch profiler trace written to %s", path)
        return str(path)

    def _new_trace_path(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
        base = f"{stamp}_{self.name}_pid{os.getpid()}"
        path = self.trace_dir / f"{base}.pt.trace.json"
        suffix = 1
        while path.exists() or Path(f"{path}.gz").exists():
            path = self.trace_dir / f"{base}-{suffix}.pt.trace.json"
            suffix += 1
        return path

    def _write_summary(self, prof: profile, trace_path: Path) -> str | None:
        summary = Path(str(trace_path).removesuffix(".gz").removesuffix(".pt.trace.json") + ".summary.txt")
        try:
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=SUMMARY_ROWS)
        except Exception as exc:  # the trace is what matters; a missing table is only logged
            logger.warning("could not build the profiler summary table: %s", exc)
            return None
        summary.write_text(table, encoding="utf-8")
        return str(summary)


def _gzip_file(path: Path) -> Path:
    target = Path(f"{path}.gz")
    with open(path, "rb") as src, gzip.open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return target
