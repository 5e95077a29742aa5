"""The export schemes (``--scheme``), the per-layer quantization they imply and the static activation parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascent.quantization.export.calibrate import ChannelStats
from ascent.quantization.export.rtn import (QuantizedWeight, qmax_for, quantize_asymmetric, quantize_per_channel,
                                            quantize_per_group)

FORMATS = ("modelslim", "compressed-tensors")


@dataclass(frozen=True)
class ExportScheme:
    """One ``--scheme``: ModelSlim type string, weight bits, grouping, activation quantization
    (``"static"`` per-tensor, ``"dynamic"`` per-token, None = weight-only)."""

    name: str
    modelslim_type: str
    weight_bits: int
    grouped: bool
    activations: str | None


SCHEMES: dict[str, ExportScheme] = {
    "w8a8": ExportScheme("w8a8", "W8A8", 8, False, "static"),
    "w8a8_dynamic": ExportScheme("w8a8_dynamic", "W8A8_DYNAMIC", 8, False, "dynamic"),
    "w8a16": ExportScheme("w8a16", "W8A16", 8, False, None),
    "w4a16": ExportScheme("w4a16", "W4A16", 4, True, None),
    "w4a8": ExportScheme("w4a8", "W4A8_DYNAMIC", 4, False, "dynamic"),
}


def get_scheme(name: str) -> ExportScheme:
    """The scheme called ``name`` (ValueError listing the choices otherwise)."""
    if name not in SCHEMES:
        raise ValueError(f"scheme={name!r} is not one of {sorted(SCHEMES)}")
    return SCHEMES[name]


@dataclass
class LayerExport:
    """One quantized linear: module ``name``, its RTN weight, float ``bias`` (or None) and input statistics (for
    static activation scales; None otherwise)."""

    name: str
    weight: QuantizedWeight
    bias: torch.Tensor | None
    stats: ChannelStats | None


def check_group_size(weights: dict[str, torch.Tensor], group_size: int) -> None:
    """ValueError naming the first layer whose input size is not divisible by ``group_size``."""
    for name, weight in weights.items():
        n, k = weight.shape
        if group_size < 1 or k % group_size:
            raise ValueError(f"{name}: input size K={k} is not divisible by group_size={group_size} "
                             f"(weight shape [{n}, {k}]); choose a --group-size that divides {k}")


def check_packed_width(weights: dict[str, torch.Tensor], scheme: ExportScheme, fmt: str) -> None:
    """compressed-tensors pack-quantized (weight-only schemes): ValueError naming the first layer whose K does not
    fill whole int32 words (ascent's loader reads the packed rows as K * bits / 8 contiguous bytes)."""
    if fmt != "compressed-tensors" or scheme.activations is not None:
        return
    per_word = 32 // scheme.weight_bits
    for name, weight in weights.items():
        if weight.shape[1] % per_word:
            raise ValueError(f"{name}: input size K={weight.shape[1]} is not a multiple of {per_word}, which "
                             f"pack-quantized int{scheme.weight_bits} needs here; use --format modelslim")


def check_asymmetric(scheme: ExportScheme, fmt: str) -> None:
    """Asymmetric export: weight-only schemes, ModelSlim layout (its ``weight_offset`` holds float offsets;
    compressed-tensors zero points are integers). ValueError naming the scheme / format otherwise."""
    if scheme.activations is not None:
        raise ValueError(f"asymmetric weights are for the weight-only schemes (w8a16, w4a16), not {scheme.name!r}")
    if fmt != "modelslim":
        raise ValueError(f"asymmetric weights need format='modelslim' (float weight_offset), got format={fmt!r}: "
                         "compressed-tensors zero points are integers")


def quantize_layer(name: str, weight: torch.Tensor, scheme: ExportScheme, scale_dtype: torch.dtype,
                   group_size: int, asymmetric: bool = False) -> QuantizedWeight:
    """RTN of one linear weight per the scheme (per-group for grouped schemes, per-channel otherwise), symmetric
    or (``asymmetric``, see :func:`check_asymmetric`) min-max with float offsets."""
    if asymmetric:
        return quantize_asymmetric(weight, scheme.weight_bits, group_size if scheme.grouped else None, scale_dtype,
                                   name=name)
    if scheme.grouped:
        return quantize_per_group(weight, scheme.weight_bits, group_size, scale_dtype, name=name)
    return quantize_per_channel(weight, scheme.weight_bits, scale_dtype)


def asymmetric_input_params(stats: ChannelStats, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelSlim W8A8 static per-tensor activation parameters ``(input_scale [1], input_offset [1])`` in ``dtype``.

    The calibrated range is widened to include 0; ``scale = (max - min) / 255`` (rounded to ``dtype`` first) and
    ``offset = rint(-128 - min / scale)`` clamped to int8, so ``xq = clamp(rint(x / scale + offset), -128, 127)``
    maps ``min`` to -128 and ``max`` to 127."""
    lo = min(float(stats.min.min()), 0.0)
    hi = max(float(stats.max.max()), 0.0)
    scale = torch.tensor([(hi - lo) / 255.0 if hi > lo else 1.0], dtype=torch.float64).to(dtype)
    offset = torch.round(torch.tensor([-128.0]) - lo / scale.double()).clamp(-128, 127)
    return scale, offset.to(dtype)


def symmetric_input_scale(stats: ChannelStats, dtype: torch.dtype, bits: int = 8) -> torch.Tensor:
    """compressed-tensors static per-tensor symmetric activation scale ``[1]``: ``absmax / 127``."""
    absmax = float(stats.absmax().max())
    value = absmax / qmax_for(bits) if absmax > 0 else 1.0
    return torch.tensor([value], dtype=torch.float64).to(dtype)
