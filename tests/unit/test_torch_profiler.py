"""TorchProfilerWrapper: a start/stop session writes a parseable Chrome trace with the profiled ops; misuse errors."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pytest
import torch

from ascent.metrics.torch_profiler import TorchProfilerWrapper


def _profile_matmul(wrapper: TorchProfilerWrapper) -> str:
    wrapper.start()
    a = torch.randn(16, 16)
    torch.mm(a, a)
    return wrapper.stop()


def _event_names(trace: dict) -> set[str]:
    return {e.get("name") for e in trace["traceEvents"]}


def test_start_stop_writes_chrome_trace(tmp_path: Path) -> None:
    wrapper = TorchProfilerWrapper(tmp_path / "traces")
    path = _profile_matmul(wrapper)
    assert Path(path).parent == tmp_path / "traces"
    assert path.endswith(".pt.trace.json") and "_pid" in Path(path).name
    trace = json.loads(Path(path).read_text())
    assert "aten::mm" in _event_names(trace)
    assert not wrapper.active
    if not torch.cuda.is_available():
        assert wrapper.last_summary_path is not None
        assert "aten::mm" in Path(wrapper.last_summary_path).read_text()


def test_one_file_per_session(tmp_path: Path) -> None:
    wrapper = TorchProfilerWrapper(tmp_path)
    first = _profile_matmul(wrapper)
    second = _profile_matmul(wrapper)
    assert first != second
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 2


def test_gzip_trace(tmp_path: Path) -> None:
    path = _profile_matmul(TorchProfilerWrapper(tmp_path, use_gzip=True))
    assert path.endswith(".pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        assert "aten::mm" in _event_names(json.load(f))


def test_profiles_the_starting_thread(tmp_path: Path) -> None:
    wrapper = TorchProfilerWrapper(tmp_path)
    paths: list[str] = []
    worker = threading.Thread(target=lambda: paths.append(_profile_matmul(wrapper)))
    worker.start()
    worker.join(timeout=60)
    assert len(paths) == 1
    assert "aten::mm" in _event_names(json.loads(Path(paths[0]).read_text()))


def test_double_start_raises(tmp_path: Path) -> None:
    wrapper = TorchProfilerWrapper(tmp_path)
    wrapper.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            wrapper.start()
    finally:
        wrapper.stop()


def test_stop_without_start_raises(tmp_path: Path) -> None:
    wrapper = TorchProfilerWrapper(tmp_path)
    with pytest.raises(RuntimeError, match="not running"):
        wrapper.stop()
    _profile_matmul(wrapper)
    with pytest.raises(RuntimeError, match="not running"):
        wrapper.stop()


def test_empty_trace_dir_rejected() -> None:
    with pytest.raises(ValueError, match="trace_dir"):
        TorchProfilerWrapper("  ")
