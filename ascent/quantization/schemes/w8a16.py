"""Weight-only int8 (W8A16), spec §2, and the shared weight-only machinery W4A16 builds on.

Checkpoint (ModelSlim): ``weight`` int8 [N, K], ``weight_scale`` and ``weight_offset`` per-channel [N, 1] or
per-group [N, K/g] (model dtype or fp32). compressed-tensors: ``weight``, ``weight_scale`` and, asymmetric only,
``weight_zero_point``. Dequantization uses the documented *subtractive* zero point (spec §11.5):
``W = (Wq - o_w) * s_w``; ``y = x @ W^T + b``.

Fast paths (chosen by M): on CPU with the C++ kernels, ``quant_gemv_cpu.cpp``'s ``w8a16_linear`` (any group /
zero point) for M <= ``WEIGHT_ONLY_GEMV_MAX_M[8]``; int8 per channel without zero point on AMX-INT8 CPUs: the AMX
kernel (16-bit x as fixed point, a repacked copy of the weight) up to ``W8A16_AMX_MAX_M``; other bf16 weight-only
layers on AMX-BF16 CPUs (W4A16, grouped / zero-point W8A16): tiles dequantized per call (``wo_amx.py``) for M in
(``WO_AMX_MIN_M``, ``WO_AMX_MAX_M``]; else (``kernels.weight_only_path``) ``torch._weight_int8pack_mm``
for decode-sized M when the weight is per-channel and symmetric; otherwise a dequantize-once dense weight
(oneDNN-packed bf16/fp16).
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.dense_weights import DenseWeightCache
from ascent.quantization.kernels import (
    W8A16_AMX_MAX_M, StackSpec, WeightOnlyGemv, gemv_fits, prepare_int8_amx, prepare_wo_gemv, weight_int8_linear,
    weight_only_path,
)
from ascent.quantization.registry import register_scheme
from ascent.quantization.packing import pack_to_int32, unpack_from_int32
from ascent.quantization.schemes.act_order import create_g_idx, group_sorting_permutation, permute_input, uses_g_idx
from ascent.quantization.schemes.common import (
    add_param, expand_groups, group_size_of, layer_name, num_shards, use_reference,
)
from ascent.quantization.wo_amx import prepare_wo_amx


class WeightOnlyLinear(QuantLinearScheme):
    """Shared weight-only logic. Subclasses provide :meth:`int_weight` (int8 values [N, K]) and may set up a
    packed decode kernel in :meth:`prepare_packed` / :meth:`packed_linear`. After loading the layer holds
    ``wo_scale`` fp32 [N, G], ``wo_zero`` fp32 [N, G] or None (all-zero offsets), ``wo_dense`` (cache),
    ``wo_gemv`` (small-M C++ kernel operands, ``kernels.WeightOnlyGemv``, or None), ``wo_amx`` (AMX-INT8 tiles of a
    per-channel symmetric int8 weight, or None) and ``wo_amx_bf16`` (``wo_amx.WoAmx``, the AMX-BF16 operands for
    mid-sized M where ``wo_amx`` is None, or None)."""

    force_reference = False
    bits = 8

    @property
    def modelslim(self) -> bool:
        return self.spec.source_format != "compressed-tensors"

    @property
    def packed_checkpoint(self) -> bool:
        """compressed-tensors ``pack-quantized``: ``weight_packed`` int32 with 32/bits values per word along K."""
        return not self.modelslim and (self.bits < 8 or self.spec.extra.get("format") == "pack-quantized")

    @property
    def offset_name(self) -> str:
        return "weight_offset" if self.modelslim else "weight_zero_point"

    def create_scales(self, layer: nn.Module, n: int, k: int, weight_loader: WeightLoader,
                      with_offset: bool) -> None:
        """``weight_scale`` [N, G] (G = K/g, 1 for per-channel) and the float offset of the same shape."""
        groups = k // group_size_of(self.spec, k)
        dims = {"output_dim": 0, **({"input_dim": 1} if self.spec.weight_strategy == "group" else {})}
        add_param(layer, "weight_scale", (n, groups), torch.float32, weight_loader, fill=1.0, **dims)
        if with_offset:
            add_param(layer, self.offset_name, (n, groups), torch.float32, weight_loader, optional_default=0.0,
                      **dims)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        if uses_g_idx(self.spec) and not self.packed_checkpoint:
            raise NotImplementedError(f"{layer_name(layer)}: activation order (weight_g_idx) is supported for "
                                      f"pack-quantized checkpoints only")
        if self.packed_checkpoint:
            create_packed_weights(self, layer, n, k, output_partition_sizes, weight_loader)
            if uses_g_idx(self.spec):
                create_g_idx(layer, k, output_partition_sizes, weight_loader)
            return
        add_param(layer, "weight", (n, k), torch.int8, weight_loader, output_dim=0, input_dim=1)
        self.create_scales(layer, n, k, weight_loader, self.modelslim or not self.spec.weight_symmetric)

    def int_weight(self, layer: nn.Module) -> torch.Tensor:
        """Signed integer weight values, int8 [N, K]."""
        if self.packed_checkpoint:
            packed = layer.weight_packed.detach()
            return unpack_from_int32(packed, self.bits, packed.shape[1] * (32 // self.bits), dim=1)
        return layer.weight.detach()

    def zero_points(self, layer: nn.Module) -> torch.Tensor | None:
        """Subtractive zero points fp32 [N, G], or None when absent / all zero."""
        if self.packed_checkpoint:
            param = getattr(layer, "weight_zero_point", None)
            if param is None:
                return None
            zp = unpack_from_int32(param.detach(), self.bits, layer.weight_scale.shape[0], dim=0).float()
            return zp if bool((zp != 0).any()) else None
        param = getattr(layer, self.offset_name, None)
        if param is None or not bool((param.detach() != 0).any()):
            return None
        return param.detach().float()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.packed_checkpoint:
            check_weight_shape(layer)
        self.sort_columns_by_group(layer)
        layer.wo_scale = layer.weight_scale.detach().float()
        layer.wo_zero = self.zero_points(layer)
        layer.wo_dense = DenseWeightCache(lambda: self.dequantized_weight(layer))
        self.prepare_packed(layer)
        layer.wo_amx = None  # AMX-INT8 tiles for mid-sized M: int8 weights, per channel, no zero point, 16-bit model
        if (self.bits == 8 and layer.wo_zero is None and layer.wo_scale.shape[1] == 1
                and getattr(layer, "params_dtype", None) in (torch.bfloat16, torch.float16)):
            layer.wo_amx = prepare_int8_amx(self.int_weight(layer))  # None without the kernels or AMX-INT8
            layer.wo_scale_vec = layer.wo_scale.reshape(-1).contiguous()
        layer.wo_gemv = self.prepare_gemv(layer)  # (its row-interleaved int8 copy only where no AMX tiles are)
        layer.wo_amx_bf16 = None  # AMX-BF16 tiles dequantized per call (wo_amx.py) where no AMX-INT8 copy serves
        if layer.wo_amx is None:
            layer.wo_amx_bf16 = prepare_wo_amx(self.int_weight(layer), self.bits, layer.wo_scale, layer.wo_zero,
                                               getattr(layer, "params_dtype", None))

    def sort_columns_by_group(self, layer: nn.Module) -> None:
        """Activation-ordered checkpoints: store the weight with its columns sorted by group (``act_order.py``);
        sets ``layer.wo_input_perm`` (None when there is nothing to permute)."""
        layer.wo_input_perm = None
        if not uses_g_idx(self.spec):
            return
        perm = group_sorting_permutation(layer, group_size_of(self.spec, self.input_size(layer)))
        if perm is not None:
            layer.weight_packed.data = pack_to_int32(self.int_weight(layer)[:, perm], self.bits, dim=1)
            layer.wo_input_perm = perm

    def decode_stack_call(self, layer: nn.Module) -> StackSpec | None:
        """How a C++ decode stack calls this linear's small-M kernel (``kernels.STACK_KIND_*``), None without it
        (or when the layer permutes its input, which the stack does not)."""
        gemv = getattr(layer, "wo_gemv", None)
        if gemv is None or getattr(layer, "wo_input_perm", None) is not None:
            return None
        bias = getattr(layer, "bias", None)
        spec = gemv.stack_spec(bias, getattr(layer, "wo_amx", None))
        tiles = getattr(layer, "wo_amx_bf16", None)
        return tiles.stack_spec(spec, gemv.max_m, bias) if tiles is not None else spec

    def gemv_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight operand of the small-M kernel: int8 values [N, K] (shared with the int8pack operand)."""
        if layer.wo_packed is not None:
            return layer.wo_packed[0]
        return self.int_weight(layer)

    def prepare_gemv(self, layer: nn.Module) -> WeightOnlyGemv | None:
        """Small-M kernel operands (``kernels.WeightOnlyGemv``), None when the kernels do not apply."""
        return prepare_wo_gemv(self.gemv_weight(layer), self.bits, self.input_size(layer), layer.wo_scale,
                               layer.wo_zero, getattr(layer, "params_dtype", None),
                               nv_copy=getattr(layer, "wo_amx", None) is None)

    def input_size(self, layer: nn.Module) -> int:
        """K of this partition (from the stored weight)."""
        if self.packed_checkpoint:
            return layer.weight_packed.shape[1] * (32 // self.bits)
        return layer.weight.shape[1]

    def prepare_packed(self, layer: nn.Module) -> None:
        """int8pack decode kernel: per-channel symmetric only."""
        layer.wo_packed = None
        if layer.wo_zero is None and layer.wo_scale.shape[1] == 1:
            layer.wo_packed = (self.int_weight(layer).contiguous(), layer.wo_scale.reshape(-1).contiguous())

    def packed_linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w, scale = layer.wo_packed
        return weight_int8_linear(x, w, scale, bias)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        x = permute_input(layer, x)
        tiles = getattr(layer, "wo_amx_bf16", None)
        if tiles is not None and tiles.takes(x):
            return tiles.linear(x, bias)
        gemv = getattr(layer, "wo_gemv", None)
        if gemv is not None and gemv_fits(x, gemv.max_m):
            return gemv.linear(x, bias)
        amx = getattr(layer, "wo_amx", None)
        if amx is not None and x.dtype in (torch.bfloat16, torch.float16) and gemv_fits(x, W8A16_AMX_MAX_M):
            y = amx.linear_weight_only(x, layer.wo_scale_vec, bias)
            if y is not None:  # None: x has a NaN / inf, which the paths below propagate
                return y
        m = x.numel() // x.shape[-1]
        if layer.wo_packed is not None and x.device.type == "cpu" and weight_only_path(m) == "packed":
            return self.packed_linear(layer, x, bias)
        return layer.wo_dense.linear(x, bias)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return super().apply_reference(layer, permute_input(layer, x), bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight [N, K] as stored: columns in ``wo_input_perm`` order for activation-ordered layers."""
        q = self.int_weight(layer).float()
        if layer.wo_zero is not None:
            q = q - expand_groups(layer.wo_zero, q.shape[1])
        return q * expand_groups(layer.wo_scale, q.shape[1])

    supports_embedding = True

    def embedding_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Only the looked-up rows are dequantized: ``(q[ids] - zp[ids]) * s[ids]`` (per-channel scales are per
        vocab row; per-group scales per row and K-group)."""
        flat = ids.reshape(-1)
        if self.packed_checkpoint:
            packed = layer.weight_packed.detach()[flat]
            q = unpack_from_int32(packed, self.bits, packed.shape[1] * (32 // self.bits), dim=1)
        else:
            q = layer.weight.detach()[flat]
        w = q.float()
        if layer.wo_zero is not None:
            w = w - expand_groups(layer.wo_zero[flat], w.shape[1])
        w = w * expand_groups(layer.wo_scale[flat], w.shape[1])
        if getattr(layer, "wo_input_perm", None) is not None:  # back to the checkpoint's column order
            w = w[:, torch.argsort(layer.wo_input_perm)]
        return w.to(getattr(layer, "params_dtype", torch.float32)).reshape(*ids.shape, w.shape[1])


def create_packed_weights(scheme: WeightOnlyLinear, layer: nn.Module, n: int, k: int,
                          output_partition_sizes: list[int], weight_loader: WeightLoader) -> None:
    """compressed-tensors pack-quantized parameters: ``weight_packed`` int32 [N, K*bits/32], ``weight_scale``
    [N, G], ``weight_shape`` int64 (one [N, K] row per fused shard) and, asymmetric, ``weight_zero_point`` int32
    packed along N [N*bits/32, G]."""
    per_word = 32 // scheme.bits
    if k % per_word:
        raise ValueError(f"{layer_name(layer)}: pack-quantized int{scheme.bits} needs K % {per_word} == 0, got K={k}")
    add_param(layer, "weight_packed", (n, k // per_word), torch.int32, weight_loader, output_dim=0, input_dim=1,
              packed_dim=1, packed_factor=per_word)
    scheme.create_scales(layer, n, k, weight_loader, with_offset=False)
    add_param(layer, "weight_shape", (num_shards(output_partition_sizes), 2), torch.int64, weight_loader,
              per_shard_scalar=True, optional_default=0)
    if not scheme.spec.weight_symmetric:
        if n % per_word:
            raise ValueError(f"{layer_name(layer)}: packed zero points need N % {per_word} == 0, got N={n}")
        groups = k // group_size_of(scheme.spec, k)
        dims = {"input_dim": 1} if scheme.spec.weight_strategy == "group" else {}
        add_param(layer, "weight_zero_point", (n // per_word, groups), torch.int32, weight_loader, output_dim=0,
                  packed_dim=0, packed_factor=per_word, **dims)


def check_weight_shape(layer: nn.Module) -> None:
    """``weight_shape`` rows (when loaded) must name this layer's input size."""
    shapes = layer.weight_shape.detach()
    k_full = getattr(layer, "input_size", None)
    loaded = shapes[shapes[:, 1] != 0]
    if k_full is not None and loaded.numel() and bool((loaded[:, 1] != k_full).any()):
        raise ValueError(f"{layer_name(layer)}: weight_shape {shapes.tolist()} does not match input size {k_full}")


@register_scheme("W8A16", "linear")
class W8A16Linear(WeightOnlyLinear):
    """int8 weight-only."""
