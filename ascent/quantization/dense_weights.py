"""Dequantize-once weights of the quantized schemes for the calls their integer kernels do not take (specs §9.2).

Above a scheme's small-M range (``kernels.WEIGHT_ONLY_GEMV_MAX_M`` ...) a prefill-sized call multiplies by the
dequantized weight, built on the first such call so decode-only serving keeps only the quantized weight in memory.
Which copy serves a call follows the unquantized linear's choice (``cpu_packing.cpu_linear``): 16-bit x within the
small-M kernel's range (``small_m_max``), on CPUs whose AMX tiles do not take those bf16 rows, reads a plain copy in
x's dtype through the small-M kernel; other calls take the GEMM layout of ``pack_linear_weight`` (oneDNN-packed, or
an fp32 copy on CPUs without native 16-bit GEMM) or the plain weight. On an AVX2 CPU the fp32 copy cost a W4A16
SmolLM2-135M 16-token prefill ~100 ms, mostly MKL repacking the fp32 weight on every call; through the small-M kernel
on the bf16 copy, as the unquantized model runs it, ~51 ms. Prefills of both sizes hold both copies (2 + 4 bytes per
weight on such a CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from ascent.layers.cpu_kernels import amx_ops
from ascent.layers.cpu_packing import pack_linear_weight, packed_linear, small_m_kernel, small_m_max

SMALL_M_DTYPES = (torch.bfloat16, torch.float16)


class DenseWeightCache:
    """Dequantize-once weights per compute dtype: ``build()`` returns float32 ``[N, K]``. Per dtype a plain
    16-bit copy (for the small-M kernel) and a GEMM layout are each built at their first use."""

    def __init__(self, build: Callable[[], torch.Tensor]) -> None:
        self._build = build
        self._weights: dict[torch.dtype, tuple[torch.Tensor, bool]] = {}  # GEMM weight, oneDNN-packed or not
        self._plain: dict[torch.dtype, tuple[torch.Tensor, ModuleType] | None] = {}  # None: no small-M kernel

    def clear(self) -> None:
        self._weights.clear()
        self._plain.clear()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W^T (+ bias)`` in x's dtype."""
        b = bias.to(x.dtype) if bias is not None else None
        plain = self._small_m_copy(x)
        if plain is not None:
            weight, ops = plain
            return ops.linear_small_m(x, weight, b)
        if x.dtype not in self._weights:
            w = self._build().to(x.dtype)
            packed = pack_linear_weight(w)
            self._weights[x.dtype] = (packed, True) if packed is not None else (w.contiguous(), False)
        w, is_packed = self._weights[x.dtype]
        return packed_linear(x, w, b) if is_packed else F.linear(x, w, b)

    def _small_m_copy(self, x: torch.Tensor) -> tuple[torch.Tensor, ModuleType] | None:
        """The plain copy and kernel module for this call, or None when the GEMM layout serves it."""
        if x.dtype not in SMALL_M_DTYPES or x.device.type != "cpu" or x.numel() > small_m_max(x.dtype) * x.shape[-1]:
            return None
        if x.dtype not in self._plain:
            self._plain[x.dtype] = self._build_plain(x.dtype)
        return self._plain[x.dtype]

    def _build_plain(self, dtype: torch.dtype) -> tuple[torch.Tensor, ModuleType] | None:
        if dtype == torch.bfloat16 and amx_ops() is not None:  # the unquantized path's AMX tiles take these rows
            return None
        w = self._build().to(dtype).contiguous()
        ops = small_m_kernel(w)
        return (w, ops) if ops is not None else None
