"""Fast CPU (and CUDA) kernels of the quantized linear schemes, with exact integer semantics.

* int8 x int8 -> int32: ``torch._int_mm`` (CPU: any M; CUDA: M > 16 and K, N multiples of 8 — otherwise an exact
  float64 matmul, which is exact for |acc| < 2^53). The weight is kept as a column-major ``[K, N]`` view of the
  row-major int8 ``[N, K]`` checkpoint tensor (``w.t()``), the layout ``_int_mm`` is fastest with.
* Weight-only int8 / int4: ``torch._weight_int8pack_mm`` (per-channel scale, symmetric) and
  ``torch._convert_weight_to_int4pack_for_cpu`` + ``torch._weight_int4pack_mm_for_cpu`` (convention
  ``w = (u - 8) * scale + zero`` with ``u`` the unsigned nibble; N % 16 == 0, group in {32, 64, 128, 256}).
  They win at decode-sized M only; prefill-sized M uses a dequantize-once dense weight
  (``ascent.quantization.dense_weights``) — :func:`weight_only_path` picks by M.
* Small-M (decode) C++ kernels, ``ascent/layers/cpu_kernels/quant_gemv_cpu.cpp`` (``quant_ops()``): weights
  streamed once per call in their stored integer form (int8 rows, int4 nibbles, the W8A8 product via AVX512-VNNI
  with the activation quantization fused). Resolved once per layer at load (:func:`prepare_int8_gemv`,
  :func:`prepare_wo_gemv`); used for M up to :data:`INT8_GEMV_MAX_M` / :data:`WEIGHT_ONLY_GEMV_MAX_M`.
* ``ASCENT_QUANT_REFERENCE=1`` (read per call) makes every scheme use its reference path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from ascent.platform.ops_utils import symmetric_quant
from ascent.quantization.packing import unpack_from_int32
from ascent.quantization.wo_nv import NvLayout, int8_nv_applies, nv_applies, prepare_nv, w4_blocked_applies

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
# quant_gemv_cpu.cpp kernels vs the paths above, 30 SmolLM2-135M layers' linears (qkv 576x960, o 576x576, gate_up
# 576x3072, down 1536x576; 106 M weights, DRAM-resident), 1 thread on the shared 2-core host, interleaved medians, ms:
#   M=1: bf16 dense 20.5 | w8a16 kernel 6.8 vs int8pack 13.0 | w4a16 kernel 7.0 vs int4pack 7.1 | w8a8 kernel 6.2 vs
#        quantize + _int_mm 21.9;  M=2: 20.8 | 9.0 vs 17.9 | 9.2 vs 8.3 | 7.6 vs 22.0;
#   M=4: 20.7 | 15.0 vs 21.5 | 17.1 vs 12.0 | 9.2 vs 23.1;  M=8: 21.3 | 30.8 vs 35.0 | 32.9 vs 20.8 | 15.8 vs 26.5.
# Cache-resident (one layer, 2 threads) at M=16: w8a8 kernel 0.33 vs 0.43 ms. Crossovers: W8A8 16, W8A16 4 (dense
# bf16 above), W4A16 1 (int4pack at M=2, dense above).
# With the VNNI fixed-point weight-only kernels (quant_wo_vnni.h), same 30 layers, 2 threads, bf16 x, interleaved
# medians, ms (W8A16 per channel, W4A16 group 64):
#   M=1: dense 15.9 | w8a16 5.3 | w4a16 3.7 vs int4pack 8.5;  M=2: 13.1 | 5.5 | 4.3 vs 7.7;
#   M=3: 13.2 | 7.6 | 6.3 vs 8.8;  M=4: 13.2 | 8.1 | 7.0 vs 9.7;  M=8: 13.0 | 13.9 | 12.6 vs 14.9.
# Crossovers: W8A16 4, W4A16 4 (a verification step of a few drafts stays on the kernels).
INT8_GEMV_MAX_M = 16
# W8A8 dynamic on the row-interleaved layout (quant_int8_nv.h), same 30 layers, Zen 4 (AVX512-VNNI, no AMX), 2
# threads, bf16 x, interleaved minima, ms (row-layout kernel | row-interleaved | quantize + _int_mm):
#   M=1: 5.55 | 4.66 | 17.2;  M=4: 7.97 | 6.54 | 19.8;  M=16: 23.2 | 14.0 | 31.8;  M=32: 44.8 | 25.9 | 48.3;
#   M=64: 99.4 | 59.8 | 63.2.
INT8_NV_MAX_M = 48
# W8A8 dynamic on AMX-INT8 tiles (quant_amx_int8.h; bit-identical to the VNNI kernel), same 30 layers, 2 threads,
# bf16 x, interleaved medians, ms (VNNI kernel | AMX-INT8 | quantize + _int_mm):
#   M=1: 5.6 | 4.9 | 15.8;  M=4: 6.8 | 5.2 | 17.6;  M=16: 15.8 | 6.6 | 20.6;  M=32: 26.8 | 8.5 | 26.4;
#   M=64: 50.5 | 12.4 | 33.5;  M=128: 100.6 | 20.4 | 50.9.
# One row of x since runs VNNI dot products on the same packed tiles as four streams per thread (i8_gemv_range),
# bit-identical: 120 linears + a 49152 x 576 head, 2 threads, alternated in one process, 1.23x the GB/s of the
# one-row tiles (20.4 -> 25.1 GB/s).
# W8A8 (dynamic and static) takes AMX-INT8 at every M when the CPU has it: against quantize + _int_mm (static: the
# same with its offset and deq_scale), same 30 layers, 2 threads, interleaved medians, ms: M = 256 30.3 vs 63.3
# (static 29.0 vs 61.7); 512 61.7 vs 247; 1024 133 vs 420; 2048 260 vs 705; 4096 568 vs 1887 (static 515 vs 1933),
# measured while its x quantization still ran on one thread (quantize_rows_* now split the rows over the threads:
# 0.63x the time at M = 2048).
# W8A16 per channel on AMX-INT8 (16-bit x as fixed point, two tile products per weight tile) against the dequantized
# bf16 weight on oneDNN: M = 32 6.9 vs 10.6; 64 11.0 vs 15.1; 96 15.6 vs 16.9; 128 19.9 vs 18.8; 192 29.3 vs 21.6;
# 256 41.5 vs 28.5, so it takes M up to W8A16_AMX_MAX_M (its fixed-point rows on both threads since: 0.85x the time
# at M = 128, so the crossover may now sit a little higher).
W8A16_AMX_MAX_M = 128
WEIGHT_ONLY_GEMV_MAX_M = {8: 4, 4: 4}
# The row-interleaved weight-only layout (wo_nv.py) against the dense bf16 weight (oneDNN-packed), same 30 layers,
# Zen 4, 2 threads, bf16 x, interleaved minima, ms (W4A16 group 64 | W8A16 per channel | dense bf16):
#   M=4: 3.93 | 5.52 | 12.0;  M=8: 7.81 | 9.24 | 19.1;  M=16: 14.0 | 14.2 | 18.5;  M=32: 23.8 | 27.1 | 27.4.
WO_NV_MAX_M = 32
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ``decode_stack_call`` kinds (``models/decode_stack.py`` LinearSpec = (kind, tensors, ints); kind 0 is the dense
# bf16 small-M kernel): the C++ stack can include quant_gemv_cpu.cpp (ASCENT_EMBEDDED_KERNELS) and call
#   1 W8A16: ascent_quant::w8a16_linear(x, weight, scale, zero?, bias?)       tensors [weight, scale, zero, bias]
#   2 W4A16: ascent_quant::w4a16_linear(x, packed, ints[0] = K, scale, zero?, bias?)  tensors as kind 1
#   3 W8A8 dynamic: ascent_quant::w8a8_dynamic_linear(x, weight, row_sum, w_scale, bias?)
#                                                                      tensors [weight, row_sum, w_scale, bias]
# (an empty tensor stands for an absent optional operand).
#   4 W8A8 dynamic on AMX-INT8: ascent_quant::w8a8_dynamic_linear_amx(x, packed, w_scale, bias?)
#                                                                      tensors [packed, w_scale, bias, unused]
#   5 W8A8 static on AMX-INT8: ascent_quant::w8a8_static_linear_amx(x, packed, s_x, z_x, deq, quant_bias?, bias?)
#                                              tensors [packed, deq, quant_bias, bias, fp32 [s_x, z_x]]
STACK_KIND_W8A16, STACK_KIND_W4A16, STACK_KIND_W8A8_DYNAMIC = 1, 2, 3
#   6 W8A16 per channel with AMX-INT8 above the small-M range: w8a16_linear up to ints[0] rows, else
#     w8a16_linear_amx(x, packed, scale, bias?)               tensors [weight, scale, zero, bias, packed], ints [max_m]
STACK_KIND_W8A8_DYNAMIC_AMX, STACK_KIND_W8A8_STATIC_AMX, STACK_KIND_W8A16_AMX = 4, 5, 6
#   7 W8A8 static on the small-M kernel (CPUs without AMX-INT8): ascent_quant::w8a8_static_linear(x, weight, row_sum,
#     s_x, z_x, deq, quant_bias?, bias?)   tensors [weight, row_sum, deq, quant_bias, bias, fp32 [s_x, z_x]]
STACK_KIND_W8A8_STATIC = 7
#   8 weight-only on the row-interleaved layout (``wo_nv.py``): ascent_quant::wo_nv_linear_impl(x, packed, bits, N, K,
#     scale, zero?, scale_nv, zero_scale_nv?, bias?)  tensors [packed, scale, zero, scale_nv, zero_scale_nv, bias],
#     ints [bits, N, K]
STACK_KIND_WO_NV = 8
#   9 W8A8 dynamic on the row-interleaved layout: ascent_quant::w8a8_dynamic_linear_nv(x, packed, row_sum, w_scale,
#     bias?)                                                  tensors [packed, row_sum, w_scale, bias]
STACK_KIND_W8A8_DYNAMIC_NV = 9
#  10 W8A8 static on the row-interleaved layout: ascent_quant::w8a8_static_linear_nv, kind 7's operands with the
#     packed weight first
STACK_KIND_W8A8_STATIC_NV = 10
#  11 weight-only on AMX-BF16 above a row count (``wo_amx.py``): ascent_amx::amx_wo_linear(x, tiles, coef, bias?)
#     above ints[0] rows, else the inner call (kind ints[1] with the remaining tensors and ints)
#                                         tensors [tiles, coef, bias, *inner tensors], ints [min_m, inner kind, *inner ints]
STACK_KIND_WO_AMX = 11
StackSpec = tuple[int, list[torch.Tensor], list[int]]


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


def gemv_module(t: torch.Tensor) -> ModuleType | None:
    """The small-M kernel module for tensors like ``t`` (CPU only), or None when it does not apply."""
    if t.device.type != "cpu":
        return None
    from ascent.layers.cpu_kernels import quant_ops

    return quant_ops()


def gemv_fits(x: torch.Tensor, max_m: int) -> bool:
    """Whether the small-M kernels take ``x [..., K]``: CPU, fp32/bf16/fp16 and M = numel / K <= ``max_m`` (a few
    attribute reads: this runs once per linear per decode step)."""
    return x.is_cpu and x.dtype in GEMV_DTYPES and x.numel() <= max_m * x.shape[-1]


@dataclass
class Int8Gemv:
    """Operands of the W8A8 small-M kernels: ``weight`` int8 [N, K] (row-major), ``row_sum`` int32 [N]; ``nv`` the
    row-interleaved copy (``wo_nv_pack(weight, 8, offset=0)``, W8A8 dynamic on AVX512-VNNI CPUs without AMX-INT8; a
    second copy of the weight, counted by ``cpu_packing.limit_dual_layouts``) or None."""

    ops: ModuleType
    weight: torch.Tensor
    row_sum: torch.Tensor
    nv: torch.Tensor | None = None

    @property
    def max_m(self) -> int:
        """Largest M the kernel takes (:data:`INT8_NV_MAX_M` on the row-interleaved copy)."""
        return INT8_NV_MAX_M if self.nv is not None else INT8_GEMV_MAX_M


def prepare_int8_gemv(weight: torch.Tensor, nv: bool = False) -> Int8Gemv | None:
    """Int8 ``weight [N, K]`` -> kernel operands (no copy of a contiguous weight), None when not applicable. ``nv``:
    add the row-interleaved copy where the CPU has AVX512-VNNI (and ``ASCENT_QUANT_NV`` is not 0)."""
    ops = gemv_module(weight)
    if ops is None or weight.dim() != 2 or weight.shape[1] > 65536:
        return None
    w = weight.contiguous()
    packed = ops.wo_nv_pack(w, 8, 0) if nv and int8_nv_applies(ops) else None
    return Int8Gemv(ops, w, w.sum(dim=1, dtype=torch.int32), packed)


@dataclass
class Int8Amx:
    """AMX-INT8 operands of W8A8: ``packed`` int8 [N/16, K/64, 16, 64] (``w8a8_amx_pack`` of the [N, K] weight; a
    second copy of the weight, counted by ``cpu_packing.limit_dual_layouts``)."""

    ops: ModuleType
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def stack_spec(self, w_scale: torch.Tensor, bias: torch.Tensor | None) -> StackSpec:
        """The decode-stack call (:data:`STACK_KIND_W8A8_DYNAMIC_AMX`)."""
        unused = torch.empty(0, dtype=w_scale.dtype)
        return STACK_KIND_W8A8_DYNAMIC_AMX, [self.packed, w_scale, _or_empty(bias, w_scale), unused], []

    def linear(self, x: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:func:`int8_linear_dynamic` (bit-identical) on AMX-INT8 tiles."""
        return self.ops.w8a8_dynamic_linear_amx(x, self.packed, w_scale, bias)

    def static_stack_spec(self, input_scale: float, input_offset: float, deq_scale: torch.Tensor,
                          quant_bias: torch.Tensor | None, bias: torch.Tensor | None) -> StackSpec:
        """The decode-stack call of a static W8A8 linear (:data:`STACK_KIND_W8A8_STATIC_AMX`)."""
        scale_offset = torch.tensor([float(input_scale), float(input_offset)], dtype=torch.float32)
        return STACK_KIND_W8A8_STATIC_AMX, [self.packed, deq_scale, _or_empty(quant_bias, deq_scale),
                                            _or_empty(bias, deq_scale), scale_offset], []

    def linear_weight_only(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
                           ) -> torch.Tensor | None:
        """W8A16 (per-channel ``scale`` fp32 [N], no zero point) with 16-bit ``x`` on the tiles: x as 16-bit fixed
        point (as the VNNI kernel), exact integer sums over K; None when x has a NaN / inf."""
        return self.ops.w8a16_linear_amx(x, self.packed, scale, bias)

    def linear_static(self, x: torch.Tensor, input_scale: float, input_offset: float, deq_scale: torch.Tensor,
                      quant_bias: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """:func:`int8_linear_static` (bit-identical) on AMX-INT8 tiles."""
        return self.ops.w8a8_static_linear_amx(x, self.packed, float(input_scale), float(input_offset), deq_scale,
                                               quant_bias, bias)


def amx_takes(x: torch.Tensor) -> bool:
    """Whether the AMX-INT8 W8A8 kernels take ``x [..., K]`` (any number of rows): CPU and fp32/bf16/fp16."""
    return x.is_cpu and x.dtype in GEMV_DTYPES


def prepare_int8_amx(weight: torch.Tensor) -> Int8Amx | None:
    """AMX-INT8 operands for an int8 ``weight [N, K]``; None without the kernels or AMX-INT8 (or ``ASCENT_CPU_AMX=0``),
    or when N % 16, K % 64 or K > 65536."""
    ops = gemv_module(weight)
    if ops is None or os.environ.get("ASCENT_CPU_AMX", "1") == "0" or not ops.amx_int8_available():
        return None
    if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 64 or weight.shape[1] > 65536:
        return None  # (int32 sums of 127 * 128 products stay exact up to K = 2^17)
    return Int8Amx(ops, ops.w8a8_amx_pack(weight.contiguous()))


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else torch.empty(0, dtype=like.dtype)


def int8_dynamic_stack_spec(g: Int8Gemv, w_scale: torch.Tensor, bias: torch.Tensor | None) -> StackSpec:
    """The decode-stack call of a W8A8 dynamic linear (see :data:`STACK_KIND_W8A8_DYNAMIC` / ``_NV``)."""
    if g.nv is not None:
        return STACK_KIND_W8A8_DYNAMIC_NV, [g.nv, g.row_sum, w_scale, _or_empty(bias, w_scale)], []
    return STACK_KIND_W8A8_DYNAMIC, [g.weight, g.row_sum, w_scale, _or_empty(bias, w_scale)], []


def int8_static_stack_spec(g: Int8Gemv, input_scale: float, input_offset: float, deq_scale: torch.Tensor,
                           quant_bias: torch.Tensor | None, bias: torch.Tensor | None) -> StackSpec:
    """The decode-stack call of a static W8A8 linear on the small-M kernel (:data:`STACK_KIND_W8A8_STATIC`)."""
    scale_offset = torch.tensor([float(input_scale), float(input_offset)], dtype=torch.float32)
    if g.nv is not None:
        return STACK_KIND_W8A8_STATIC_NV, [g.nv, g.row_sum, deq_scale, _or_empty(quant_bias, deq_scale),
                                           _or_empty(bias, deq_scale), scale_offset], []
    return STACK_KIND_W8A8_STATIC, [g.weight, g.row_sum, deq_scale, _or_empty(quant_bias, deq_scale),
                                    _or_empty(bias, deq_scale), scale_offset], []


def int8_gemv_dynamic(g: Int8Gemv, x: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    """:func:`int8_linear_dynamic` (bit-identical) on the kernel: ``x [..., K]``, ``w_scale`` fp32 [N] -> x's dtype
    ``[..., N]``."""
    if g.nv is not None:
        return g.ops.w8a8_dynamic_linear_nv(x, g.nv, g.row_sum, w_scale, bias)
    return g.ops.w8a8_dynamic_linear(x, g.weight, g.row_sum, w_scale, bias)


def int8_gemv_static(g: Int8Gemv, x: torch.Tensor, input_scale: float, input_offset: float,
                     deq_scale: torch.Tensor, quant_bias: torch.Tensor | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int8_linear_static` (bit-identical) on the kernel (python-float ``input_scale`` / ``input_offset``,
    ``deq_scale`` fp32 [N], ``quant_bias`` int32 [N] or None): ``x [..., K]`` -> x's dtype ``[..., N]``."""
    if g.nv is not None:
        return g.ops.w8a8_static_linear_nv(x, g.nv, g.row_sum, float(input_scale), float(input_offset), deq_scale,
                                           quant_bias, bias)
    return g.ops.w8a8_static_linear(x, g.weight, g.row_sum, float(input_scale), float(input_offset), deq_scale,
                                    quant_bias, bias)


@dataclass
class WeightOnlyGemv:
    """Operands of the weight-only small-M kernels: ``weight`` int8 [N, K] (bits 8) or nibble bytes uint8
    [N, ceil(K/2)] (bits 4, ``w4a16_pack`` layout, or with ``blocked`` the AVX2 blocked layout of
    ``w4a16_block_pack``), ``scale`` fp32 [N, G], ``zero`` fp32 [N, G] or None; ``nv`` the row-interleaved layout
    (``wo_nv.py``) that 16-bit x takes when present."""

    ops: ModuleType
    bits: int
    k: int
    weight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    nv: NvLayout | None = None
    blocked: bool = False

    @property
    def max_m(self) -> int:
        """Largest M this kernel is used for (:data:`WO_NV_MAX_M` with the row-interleaved layout, else
        :data:`WEIGHT_ONLY_GEMV_MAX_M`)."""
        return WO_NV_MAX_M if self.nv is not None else WEIGHT_ONLY_GEMV_MAX_M[self.bits]

    def stack_spec(self, bias: torch.Tensor | None, amx: Int8Amx | None = None) -> StackSpec:
        """The decode-stack call of this linear (see :data:`STACK_KIND_W8A16` / :data:`STACK_KIND_W4A16`, and
        :data:`STACK_KIND_W8A16_AMX` with ``amx``)."""
        tensors = [self.weight, self.scale, _or_empty(self.zero, self.scale), _or_empty(bias, self.scale)]
        if self.nv is not None:
            nv = self.nv
            return (STACK_KIND_WO_NV, [nv.packed, self.scale, tensors[2], nv.scale, _or_empty(nv.zero_scale, nv.scale),
                                       tensors[3]], [self.bits, nv.n, self.k])
        if self.bits == 8 and amx is not None:
            return STACK_KIND_W8A16_AMX, tensors + [amx.packed], [self.max_m]
        if self.bits == 8:
            return STACK_KIND_W8A16, tensors, []
        return STACK_KIND_W4A16, tensors, [self.k, int(self.blocked)]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ ((q - zero) * scale)^T (+ bias)`` -> x's dtype ``[..., N]``."""
        nv = self.nv
        if nv is not None and x.dtype in (torch.bfloat16, torch.float16):
            return self.ops.wo_nv_linear(x, nv.packed, self.bits, nv.n, self.k, self.scale, self.zero, nv.scale,
                                         nv.zero_scale, bias)
        if self.bits == 8:
            return self.ops.w8a16_linear(x, self.weight, self.scale, self.zero, bias)
        if self.blocked:  # (x that the blocked kernel does not serve runs on the rows, restored for the call)
            return self.ops.w4a16_linear_blocked(x, self.weight, self.k, self.scale, self.zero, bias)
        return self.ops.w4a16_linear(x, self.weight, self.k, self.scale, self.zero, bias)


def prepare_wo_gemv(weight: torch.Tensor, bits: int, k: int, scale: torch.Tensor, zero: torch.Tensor | None,
                    dtype: torch.dtype | None = None, nv_copy: bool = True) -> WeightOnlyGemv | None:
    """Weight-only kernel operands, None when not applicable (non-CPU, no kernels, int4 groups not a multiple of
    32 columns). ``weight``: int8 [N, K] values (bits 8) or already-packed nibble bytes uint8 [N, ceil(K/2)]
    (bits 4; int8 [N, K] values are packed here). ``dtype``: the model's dtype (a 16-bit one lets
    :func:`~ascent.quantization.wo_nv.nv_applies` add the row-interleaved layout; for int8 values a second copy,
    made only with ``nv_copy``; and int4 weights take the blocked layout where
    :func:`~ascent.quantization.wo_nv.w4_blocked_applies`)."""
    ops = gemv_module(weight)
    groups = scale.shape[-1]
    if ops is None or (bits == 4 and groups > 1 and (k // groups) % 32):
        return None
    nv = None
    if (bits == 4 or nv_copy) and nv_applies(ops, bits, k, groups, dtype):
        # nibble bytes (little-endian words of pack_to_int32's layout) -> int8 values
        q = weight if weight.dtype == torch.int8 else unpack_from_int32(
            F.pad(weight, (0, -weight.shape[1] % 4)).contiguous().view(torch.int32), 4, k, dim=1)
        nv = prepare_nv(ops, q, bits, scale, zero)
    if bits == 4 and weight.dtype == torch.int8:
        weight = ops.w4a16_pack(weight.contiguous())
    blocked = nv is None and w4_blocked_applies(ops, bits, k, groups, dtype)
    if blocked:
        weight = ops.w4a16_block_pack(weight.contiguous())
    z = None if zero is None else zero.float().contiguous()
    return WeightOnlyGemv(ops, bits, k, weight.contiguous(), scale.float().contiguous(), z, nv, blocked)
