"""Shared benchmark helpers: environment record, thread pinning, timers, percentiles and the JSON writer."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PERCENTILES = (10, 25, 50, 75, 90, 99)
LOAD_WARNING_FRACTION = 0.5

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def parse_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a ``--dtype`` name (``bfloat16``, ``fp32``, ...) or a ``torch.dtype`` to a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def pin_threads(num_threads: int | None) -> int:
    """Set torch's intra-op thread count when given (validated) and return the count in effect."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} must be at least 1")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """``os.getloadavg()`` as a list (zeros where the platform has none)."""
    try:
        return [float(x) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return [0.0, 0.0, 0.0]


def collect_env(dtype: torch.dtype | str, num_threads: int | None = None) -> dict[str, Any]:
    """Record the run's environment; ``load_warning`` is set when the 1-minute load exceeds 0.5 x cores."""
    import ascent

    cores = os.cpu_count() or 1
    load = load_average()
    return {
        "ascent_version": ascent.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": cores,
        "num_threads": num_threads if num_threads is not None else torch.get_num_threads(),
        "dtype": dtype if isinstance(dtype, str) else dtype_name(dtype),
        "loadavg": load,
        "load_warning": load[0] > LOAD_WARNING_FRACTION * cores,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class Timer:
    """Context manager measuring wall time with ``time.perf_counter``; ``elapsed`` is in seconds."""

    def __init__(self) -> None:
        self.start = 0.0
        self.elapsed = 0.0

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start


def best_time(fn: Any, repeats: int, warmup: int = 1) -> float:
    """Minimum wall time in seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be at least 1")
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def percentiles(values: list[float], ps: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """vLLM-style percentile dict: ``{"10": ..., "25": ..., ...}`` (JSON object keys are strings)."""
    if not values:
        raise ValueError("percentiles of an empty list")
    arr = np.asarray(values, dtype=np.float64)
    return {str(p): float(np.percentile(arr, p)) for p in ps}


def safe_ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or the denominator is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return float(num) / float(den)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return value


def to_jsonable(data: Any) -> Any:
    """Convert numpy scalars and dtypes to plain JSON values; non-finite floats become null."""
    return _jsonable(data)


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON to ``path`` (parent folders are created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(to_jsonable(data), f, indent=2, allow_nan=False)
        f.write("\n")
    return out
