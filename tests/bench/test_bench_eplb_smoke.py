"""Smoke run of ``ascent bench eplb`` on a tiny shape: JSON schema, PNG file, baseline comparison (no timing)."""

from __future__ import annotations

import argparse
import json
import struct
import zlib

import numpy as np

from ascent.benchmarks.eplb import deepseek_global, register_eplb_bench_parser
from ascent.benchmarks.eplb_traces import GENERATORS, Shape, make_trace
from ascent.benchmarks.png import encode_png
from ascent.eplb.placement import replica_counts


def test_png_roundtrip() -> None:
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    data = encode_png(rgb)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert (width, height) == (3, 2)
    assert np.array_equal(np.frombuffer(raw, dtype=np.uint8).reshape(2, 10)[:, 1:].reshape(2, 3, 3), rgb)


def test_traces_shapes() -> None:
    shape = Shape(layers=2, experts=8, ranks=2, slots=5, window=4, windows=2, tokens=64)
    for name in GENERATORS:
        trace = make_trace(name, shape, seed=1)
        assert trace.load.shape[1:] == (2, 8) and (trace.load >= 0).all(), name
        assert (replica_counts(trace.placement, 8) >= 1).all(), name
    assert deepseek_global(np.array([[8.0, 1.0, 1.0]]), 2, 2).shape == (1, 2, 2)


def test_bench_eplb_smoke(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    register_eplb_bench_parser(parser.add_subparsers())
    out_json, out_png = tmp_path / "eplb.json", tmp_path / "eplb.png"
    args = parser.parse_args(["eplb", "--traces", "zipf_1.0,drift_rotation,policy_ut", "--layers", "3",
                              "--experts", "16", "--ranks", "4", "--slots", "5", "--window", "6", "--windows", "3",
                              "--tokens-per-step", "512", "--output-json", str(out_json), "--heatmap", str(out_png)])
    args.func(args)
    data = json.loads(out_json.read_text())
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    for trace in ("zipf_1.0", "drift_rotation", "policy_ut"):
        rows = data["traces"][trace]
        assert set(rows) == {"deepseek", "default", "swift", "flashlb"}
        for name in ("default", "swift", "flashlb"):
            row = rows[name]
            assert row["imbalance_fitted"] >= 1.0 and row["imbalance_next_window"] >= 1.0
            assert row["bytes_moved"] == row["slots_moved"] * data["bytes_per_expert"]
            assert row["moves_vs_deepseek"] >= 0 and row["compute_ms_mean"] > 0
    assert data["traces"]["drift_rotation"]["deepseek"]["rebalances"] == 2
