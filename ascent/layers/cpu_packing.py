"""CPU bf16/fp16 linear weights: oneDNN-packed for GEMM-sized calls, plain rows for the small-M C++ kernel.

oneDNN re-lays-out a plain row-major bf16 weight on every matmul call; packing it once after loading removes that
traffic (measured here: a SmolLM2-shaped bf16 decode step's linears 20.8 -> 14.0 ms at batch 1, 28 -> 21 ms at
batch 64). fp32 weights are left alone (MKL's sgemv already streams at memory bandwidth). Packing is skipped when
oneDNN lacks bf16 support on this CPU or when ``ASCENT_CPU_PACK_WEIGHTS=0``.

Decode-sized calls (at most ``SMALL_M_MAX`` rows) go to ``gemv_cpu.cpp`` instead: one pybind call that streams the
plain weight with software prefetch, where oneDNN pays ~10 µs of primitive dispatch per call and AMX tiles that
small M cannot fill. That needs the plain rows *and* the packed copy; ``limit_dual_layouts`` drops the plain copies
of a model whose duplicated bytes exceed ``dual_layout_budget_bytes()`` (then every call uses the packed weight).
``ASCENT_CPU_SMALL_M_GEMV=0`` disables the kernel.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ascent.layers.cpu_kernels import gemv_ops

# Rows of x up to which the C++ small-M kernel is used (above it oneDNN's AMX path wins; see ``ascent bench``).
SMALL_M_MAX = 4

_PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def packing_supported(weight: torch.Tensor) -> bool:
    if os.environ.get("ASCENT_CPU_PACK_WEIGHTS", "1") == "0":
        return False
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` -> an opaque oneDNN tensor for ``packed_linear``, or None when packing does not apply."""
    if not packing_supported(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in]`` (the packed dtype) -> ``[..., out]``; same result as ``F.linear`` with the unpacked weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def small_m_kernel(weight: torch.Tensor) -> ModuleType | None:
    """The small-M kernel module for this plain ``weight [out, in]``, or None (disabled, unsupported dtype/device)."""
    if os.environ.get("ASCENT_CPU_SMALL_M_GEMV", "1") == "0":
        return None
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return None
    return gemv_ops()


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None,
               small_m: ModuleType | None) -> torch.Tensor:
    """``x [..., in]`` -> ``[..., out]`` through the fastest applicable path; all agree with ``F.linear`` up to fp32
    summation order. ``weight`` may be an empty placeholder when only ``packed`` is kept."""
    if (small_m is not None and x.dtype == weight.dtype and weight.numel() > 0
            and x.numel() <= SMALL_M_MAX * weight.shape[1]
            and (bias is None or bias.dtype == x.dtype)):
        return small_m.linear_small_m(x, weight, bias)
    if packed is not None and x.dtype == packed.dtype:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def dual_layout_budget_bytes() -> int:
    """Extra bytes a model may spend on plain copies beside its packed weights: ``ASCENT_CPU_DUAL_LAYOUT_BYTES``, else
    a quarter of the memory available now (Linux ``sysconf``; 0 where unknown)."""
    configured = os.environ.get("ASCENT_CPU_DUAL_LAYOUT_BYTES")
    if configured is not None:
        value = int(configured)
        if value < 0:
            raise ValueError(f"ASCENT_CPU_DUAL_LAYOUT_BYTES={configured!r} must be >= 0")
        return value
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 0


def limit_dual_layouts(model: nn.Module, budget_bytes: int | None = None) -> int:
    """After loading: if the plain copies kept beside packed weights (``layer.small_m_ops`` set) exceed the budget,
    release them all so the model costs no more memory than packed-only. Returns the bytes kept."""
    dual = [m for m in model.modules()
            if getattr(m, "small_m_ops", None) is not None and getattr(m, "packed_weight", None) is not None
            and getattr(m, "owns_plain_weight", False)]
    kept = sum(m.weight.numel() * m.weight.element_size() for m in dual)
    if kept <= (dual_layout_budget_bytes() if budget_bytes is None else budget_bytes):
        return kept
    for module in dual:
        module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        module.small_m_ops = None
    return 0
