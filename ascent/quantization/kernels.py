"""Fast CPU (and CUDA) kernels of the quantized linear schemes, with exact integer semantics.

* int8 x int8 -> int32: ``torch._int_mm`` (CPU: any M; CUDA: M > 16 and K, N multiples of 8 — otherwise an exact
  float64 matmul, which is exact for |acc| < 2^53). The weight is kept as a column-major ``[K, N]`` view of the
  row-major int8 ``[N, K]`` checkpoint tensor (``w.t()``), the layout ``_int_mm`` is fastest with.
* Weight-only int8 / int4: ``torch._weight_int8pack_mm`` (per-channel scale, symmetric) and
  ``torch._convert_weight_to_int4pack_for_cpu`` + ``torch._weight_int4pack_mm_for_cpu`` (convention
  ``w = (u - 8) * scale + zero`` with ``u`` the unsigned nibble; N % 16 == 0, group in {32, 64, 128, 256}).
  They win at decode-sized M only; prefill-sized M uses a dequantize-once dense weight (oneDNN-packed for
  bf16/fp16) — :func:`weight_only_path` picks by M.
* ``ASCENT_QUANT_REFERENCE=1`` (read per call) makes every scheme use its reference path.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ascent.layers.cpu_packing import pack_linear_weight, packed_linear
from ascent.platform.ops_utils import symmetric_quant

REFERENCE_ENV = "ASCENT_QUANT_REFERENCE"
# Weight-only packed kernels vs the dequantize-once dense weight (bf16, oneDNN-packed), measured once on this
# project's 2-core CPU (avx512_vnni/bf16, amx_bf16/int8; torch 2.13, 2 threads, loaded machine, interleaved medians):
#   K=N=2048   M=1: int8pack 0.118 / int4pack 0.110 vs dense 0.200 ms; M=2: 0.148 / 0.140 vs 0.197;
#              M=4: 0.248 / 0.202 vs 0.198; M=8: 0.409 / 0.400 vs 0.208
#   K=576 N=1536  M=2: 0.040 / 0.041 vs 0.033; M=4: 0.051 / 0.053 vs 0.029 (weights cache-resident, AMX bf16 wins)
# (spec §9.2, K=N=4096 on an AVX512-VNNI EPYC: int8pack 2.0 vs bf16 7.3 ms at M=1, 34 vs 12-15 ms at M=32).
# Crossover: M = 2.
WEIGHT_ONLY_PACKED_MAX_M = 2
INT4PACK_GROUP_SIZES = (256, 128, 64, 32)


def reference_forced() -> bool:
    """True when ``ASCENT_QUANT_REFERENCE=1``: schemes run their reference path."""
    return os.environ.get(REFERENCE_ENV, "0") == "1"


def int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    """Whether ``torch._int_mm`` takes an ``[m, k] x [k, n]`` product on ``device``."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return m > 16 and k % 8 == 0 and n % 8 == 0
    return False


def int8_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact int8 ``a [M, K]`` x int8 ``b_t [K, N]`` -> int32 ``[M, N]``."""
    if a.dtype != torch.int8 or b_t.dtype != torch.int8:
        raise ValueError(f"int8_mm needs int8 operands, got {a.dtype} / {b_t.dtype}")
    if a.shape[0] == 0:
        return torch.zeros(0, b_t.shape[1], dtype=torch.int32, device=a.device)
    if int_mm_supported(a.shape[0], a.shape[1], b_t.shape[1], a.device):
        return torch._int_mm(a.contiguous(), b_t)
    return (a.double() @ b_t.double()).to(torch.int32)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row quant: ``s = max|x| / 127`` (fp32 ``[M]``), ``q = clamp(rint(x / s), -128, 127)``
    int8 ``[M, K]`` (all-zero rows: s = 0, q = 0)."""
    return symmetric_quant(x, torch.int8)


def quantize_static_int8(x: torch.Tensor, scale: torch.Tensor | float, offset: torch.Tensor | float
                         ) -> torch.Tensor:
    """Static per-tensor quant ``clamp(rint(x / s + z), -128, 127)`` computed in float32 -> int8."""
    return torch.round(x.float() / scale + offset).clamp_(-128, 127).to(torch.int8)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8: ``s = max|x| / 448`` (fp32 ``[M]``), ``q = e4m3(clamp(x / s, -448, 448))``."""
    return symmetric_quant(x, torch.float8_e4m3fn)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def int8_linear_dynamic(x: torch.Tensor, w_int8_t: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 dynamic: per-token int8 quant of ``x [..., K]``, ``acc = xq @ w_int8_t`` (int32, ``w_int8_t [K, N]``),
    ``y = acc * s_x[m] * w_scale[n] (+ bias)`` in float32 -> x's dtype ``[..., N]``."""
    q, s = quantize_per_token_int8(_flat(x))
    acc = int8_mm(q, w_int8_t)
    y = acc.float().mul_(s.unsqueeze(1)).mul_(w_scale.reshape(1, -1))
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear_static(x: torch.Tensor, w_int8_t: torch.Tensor, input_scale: torch.Tensor | float,
                       input_offset: torch.Tensor | float, deq_scale: torch.Tensor, quant_bias: torch.Tensor | None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 static: ``xq = clamp(rint(x / s_x + z_x))``, ``acc = xq @ w_int8_t`` (int32), ``y = d * (acc + beta)
    (+ bias)`` in float32 -> x's dtype. ``deq_scale`` fp32 ``[N]``, ``quant_bias`` int32 ``[N]`` or None."""
    q = quantize_static_int8(_flat(x), input_scale, input_offset)
    acc = int8_mm(q, w_int8_t)
    if quant_bias is not None:
        acc = acc + quant_bias
    y = acc.float().mul_(deq_scale.reshape(1, -1))
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def int8_linear_grouped_weight(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, group_size: int,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic per-token int8 activations with per-group weight scales ``w_scale [N, K/g]``: one exact int32
    product per K-group, ``y = s_x[m] * sum_g w_scale[n, g] * acc_g[m, n] (+ bias)`` -> x's dtype."""
    q, s = quantize_per_token_int8(_flat(x))
    y = torch.zeros(q.shape[0], w_int8.shape[0], dtype=torch.float32, device=x.device)
    for g in range(w_scale.shape[1]):
        cols = slice(g * group_size, (g + 1) * group_size)
        y.add_(int8_mm(q[:, cols].contiguous(), w_int8[:, cols].t()).float() * w_scale[:, g].float())
    y.mul_(s.unsqueeze(1))
    if bias is not None:
        y.add_(bias.float())
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def weight_only_path(m: int) -> str:
    """``"packed"`` (int8pack / int4pack kernels) for decode-sized M, ``"dense"`` (dequantize-once) above."""
    return "packed" if m <= WEIGHT_ONLY_PACKED_MAX_M else "dense"


def weight_int8_linear(x: torch.Tensor, w_int8: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``_weight_int8pack_mm``: ``x [..., K]`` (fp32/bf16/fp16) x ``(w_int8 [N, K] * scale [N])^T`` -> x's dtype."""
    y = torch._weight_int8pack_mm(_flat(x).contiguous(), w_int8, scale.to(x.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], -1)


def int4pack_group_size(n: int, k: int, group_size: int) -> int | None:
    """The kernel group size for an ``[n, k]`` weight with scales per ``group_size`` columns (``k`` = channel):
    ``group_size`` itself if the kernel takes it, for channel scales the largest supported divisor of k; None when
    the int4pack kernel cannot take the shape (N % 16, odd K, unsupported group)."""
    if n % 16 or k % 2 or k % group_size:
        return None
    if group_size in INT4PACK_GROUP_SIZES:
        return group_size
    if group_size == k:
        return next((g for g in INT4PACK_GROUP_SIZES if k % g == 0), None)
    return None


def prepare_int4pack(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                     kernel_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert signed int4 ``q [N, K]`` (int8 storage), ``scale [N, G]`` and optional subtractive
    ``zero_point [N, G]`` (``W = (q - zp) * scale``, G groups of ``K/G``) into the int4pack kernel's operands:
    (packed uint8 ``[N, K/2]``, fp32 ``scale_zeros [K/kernel_group, N, 2]``) with ``w = (u - 8) * scale + zero``,
    u = q + 8 and zero = -zp * scale (exact rewrite)."""
    n, k = q.shape
    packed = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 2)
    reps = (k // scale.shape[1]) // kernel_group
    s = scale.float().repeat_interleave(reps, dim=1)
    zero = torch.zeros_like(s) if zero_point is None else -zero_point.float().repeat_interleave(reps, dim=1) * s
    return packed, torch.stack([s.t(), zero.t()], dim=-1).contiguous()


def weight_int4_linear(x: torch.Tensor, packed: torch.Tensor, kernel_group: int, scale_zeros: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``_weight_int4pack_mm_for_cpu`` on ``x [..., K]`` -> ``[..., N]`` in x's dtype."""
    y = torch._weight_int4pack_mm_for_cpu(_flat(x).contiguous(), packed, kernel_group, scale_zeros.to(x.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], -1)


class DenseWeightCache:
    """Dequantize-once weights per compute dtype: ``build()`` returns float32 ``[N, K]``; bf16/fp16 copies are
    oneDNN-packed (``ascent.layers.cpu_packing``). Built lazily on the first prefill-sized call so decode-only
    serving keeps only the quantized weight in memory."""

    def __init__(self, build: Callable[[], torch.Tensor]) -> None:
        self._build = build
        self._weights: dict[torch.dtype, tuple[torch.Tensor, bool]] = {}

    def clear(self) -> None:
        self._weights.clear()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W^T (+ bias)`` in x's dtype."""
        if x.dtype not in self._weights:
            w = self._build().to(x.dtype)
            packed = pack_linear_weight(w)
            self._weights[x.dtype] = (packed, True) if packed is not None else (w.contiguous(), False)
        w, is_packed = self._weights[x.dtype]
        b = bias.to(x.dtype) if bias is not None else None
        return packed_linear(x, w, b) if is_packed else F.linear(x, w, b)
