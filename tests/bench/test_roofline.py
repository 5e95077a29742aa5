"""Roofline arithmetic without measuring: the ceilings take the best measured rates, merged calibrations keep the
best of each rate."""

from __future__ import annotations

import pytest

from ascent.benchmarks.roofline import (RATE_KEYS, StreamProbe, ceiling_rates, merge_calibrations,
                                        paired_bandwidth_fractions, with_stream_readings)


def _calibration(**rates: float) -> dict:
    base = {k: 1.0 for k in RATE_KEYS}
    base.update(rates)
    return {"dtype": "bfloat16", "num_threads": 2, **base, **ceiling_rates(base), "sizes": {}}


def test_ceilings_take_the_best_bandwidth_and_gemm_rate():
    rates = ceiling_rates(_calibration(stream_read_gbps=30.0, gemv_gbps=15.0, gemv_fp32_gbps=17.0,
                                       gemm_gflops=10.0, gemm_fp32_gflops=40.0))
    assert rates == {"bandwidth_gbps": 30.0, "peak_gflops": 40.0}
    rates = ceiling_rates(_calibration(stream_read_gbps=12.0, gemv_gbps=16.0, gemv_fp32_gbps=14.0,
                                       gemm_gflops=400.0, gemm_fp32_gflops=150.0))
    assert rates == {"bandwidth_gbps": 16.0, "peak_gflops": 400.0}


def test_merged_calibrations_keep_the_best_of_each_rate():
    slow_phase = _calibration(stream_read_gbps=20.0, gemv_gbps=10.0, gemm_gflops=200.0, gemm_fp32_gflops=90.0)
    fast_phase = _calibration(stream_read_gbps=45.0, gemv_gbps=9.0, gemm_gflops=380.0, gemm_fp32_gflops=80.0)
    merged = merge_calibrations(slow_phase, fast_phase)
    assert merged["stream_read_gbps"] == 45.0 and merged["gemv_gbps"] == 10.0
    assert merged["gemm_gflops"] == 380.0 and merged["gemm_fp32_gflops"] == 90.0
    assert merged["bandwidth_gbps"] == 45.0 and merged["peak_gflops"] == 380.0
    assert merged["passes"] == 2 and merged["dtype"] == "bfloat16"
    assert merge_calibrations(merged, slow_phase)["passes"] == 3


def test_merge_needs_every_rate():
    partial = _calibration()
    del partial["gemv_fp32_gbps"]
    with pytest.raises(KeyError):
        merge_calibrations(partial, _calibration())


def test_stream_readings_during_a_run_can_only_raise_the_ceiling():
    calibration = _calibration(stream_read_gbps=30.0, gemv_gbps=20.0)
    assert with_stream_readings(calibration, [25.0, 28.0])["bandwidth_gbps"] == 30.0
    raised = with_stream_readings(calibration, [25.0, 36.0, 31.0])
    assert raised["stream_read_gbps"] == 36.0 and raised["bandwidth_gbps"] == 36.0
    assert raised["gemv_gbps"] == 20.0 and calibration["stream_read_gbps"] == 30.0


def test_each_iteration_is_paired_with_the_faster_of_its_neighbouring_stream_readings():
    # 1 GB read per step, 10 steps: iteration 0 moved 10 GB in 0.5 s = 20 GB/s, iteration 1 in 0.25 s = 40 GB/s
    fractions = paired_bandwidth_fractions(10**9, 10, [0.5, 0.25], [25.0, 40.0, 50.0])
    assert fractions == pytest.approx([20.0 / 40.0, 40.0 / 50.0])
    with pytest.raises(ValueError, match="3 stream readings for 3 iterations"):
        paired_bandwidth_fractions(10**9, 10, [0.5, 0.25, 0.3], [25.0, 40.0, 50.0])


def test_stream_probe_records_every_reading():
    probe = StreamProbe(1 << 20, repeats=2)
    first, second = probe.read_gbps(), probe.read_gbps()
    assert probe.readings == [first, second] and first > 0 and second > 0
    with pytest.raises(ValueError, match="repeats=0"):
        StreamProbe(1 << 20, repeats=0)


def test_memory_counts_tensors_held_in_dataclasses():
    """B7's weight bytes include copies a module holds inside dataclasses (PanelWeight, AmxWeight), once per storage."""
    import torch
    from torch import nn

    from ascent.benchmarks.memory import _module_tensors, _tensor_bytes
    from ascent.layers.cpu_packing import PanelWeight

    layer = nn.Linear(32, 16, bias=False)
    plain = _tensor_bytes(_module_tensors(layer))
    layer.panel_weight = PanelWeight(torch.zeros(1, 32, 16))
    assert _tensor_bytes(_module_tensors(layer)) == plain + 32 * 16 * 4
    layer.panel_weight.panels = None  # released
    assert _tensor_bytes(_module_tensors(layer)) == plain
