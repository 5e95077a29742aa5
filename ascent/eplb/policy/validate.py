"""Validation of placement tables and load inputs of the EPLB policies."""

from __future__ import annotations

import numpy as np


def validate_placement(placement: np.ndarray, num_experts: int | None = None) -> int:
    """Check a ``[L, R, S]`` integer placement: ids in ``[0, E)``, every expert has >= 1 replica per layer.

    ``E`` defaults to ``max id + 1``. Returns ``E``; raises ``ValueError`` naming the bad value.
    """
    arr = np.asarray(placement)
    if arr.ndim != 3 or min(arr.shape) < 1:
        raise ValueError(f"placement shape {arr.shape} must be [layers, ranks, slots_per_rank] with all dims >= 1")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"placement dtype {arr.dtype} must be integer")
    num = int(arr.max()) + 1 if num_experts is None else int(num_experts)
    if arr.min() < 0 or arr.max() >= num:
        raise ValueError(f"placement ids span [{arr.min()}, {arr.max()}], outside [0, {num})")
    if arr.shape[1] * arr.shape[2] < num:
        raise ValueError(f"{arr.shape[1] * arr.shape[2]} slots per layer cannot hold num_experts={num}")
    flat = arr.reshape(arr.shape[0], -1)
    for layer in range(arr.shape[0]):
        present = np.bincount(flat[layer], minlength=num) > 0
        if not present.all():
            raise ValueError(f"layer {layer}: logical experts {np.flatnonzero(~present).tolist()} have no replica")
    return num


def validate_same_slots(old: np.ndarray, new: np.ndarray) -> None:
    """A new placement must keep the ranks x slots shape of the old one."""
    if np.shape(old) != np.shape(new):
        raise ValueError(f"new placement shape {np.shape(new)} != current shape {np.shape(old)}")


def normalize_load(load: np.ndarray, num_layers: int) -> np.ndarray:
    """Return the load as float64 ``[T, L, E]`` (a ``[L, E]`` sum becomes ``T = 1``); raises ``ValueError`` on a
    wrong shape, a negative or a non-finite value."""
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[1] != num_layers:
        raise ValueError(f"load shape {np.shape(load)} must be [steps, {num_layers}, experts] or [{num_layers}, "
                         "experts]")
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise ValueError("load contains negative or non-finite values")
    return arr


def check_inputs(placement: np.ndarray, load: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate both policy inputs; returns (int64 placement copy, float64 [T, L, E] load, E)."""
    arr = np.asarray(placement)
    if arr.ndim != 3:
        raise ValueError(f"placement shape {arr.shape} must be [layers, ranks, slots_per_rank]")
    series = normalize_load(load, arr.shape[0])
    num_experts = series.shape[2]
    validate_placement(arr, num_experts)
    return arr.astype(np.int64, copy=True), series, num_experts
