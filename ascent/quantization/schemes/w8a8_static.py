"""W8A8 static (per-tensor static int8 activations, per-channel int8 weights), spec §2.

ModelSlim checkpoint (per layer ``P.``): ``weight`` int8 [N, K], ``weight_scale`` / ``weight_offset`` [N, 1],
``input_scale`` / ``input_offset`` [1] (one per fused shard; they must agree), ``deq_scale`` [N] (int64 holding
fp32 bits for fp16 exports, float32 for bf16 exports — decoded by the stored dtype), ``quant_bias`` int32 [N]
(loaded on TP rank 0 only for row-parallel layers). ``quant_bias`` folds the activation zero point and the float
bias: ``beta = rint(b / d - z_x * sum_k Wq[n, k])``, so a ModelSlim layer ignores the float ``bias`` argument.
compressed-tensors: ``weight``, ``weight_scale`` [N, 1], ``input_scale`` [1]; z_x = 0, ``d = s_x * s_w`` computed
at load and the float bias added after dequantization.

Forward: ``xq = clamp(rint(x / s_x + z_x), -128, 127)``, ``acc = xq @ Wq^T`` (int32), ``y = d * (acc + beta)``.
CPU decode (M <= ``Int8Gemv.max_m``): the fused quantize + VNNI kernel, on a row-interleaved copy where the CPU has
AVX512-VNNI (``quantization/wo_nv.py``; same math as ``int8_linear_static``).
"""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.base import QuantLinearScheme, WeightLoader
from ascent.quantization.kernels import (
    StackSpec, amx_takes, gemv_fits, int8_gemv_static, int8_linear_static, int8_static_stack_spec,
    prepare_int8_amx, prepare_int8_gemv, quantize_static_int8,
)
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import (
    add_param,
    check_zero_offset,
    common_shard_scalar,
    decode_deq_scale,
    deq_scale_loader,
    max_shard_scalar,
    num_shards,
    use_reference,
)


def create_int8_weight(layer: nn.Module, n: int, k: int, weight_loader: WeightLoader) -> None:
    """``weight`` int8 [N, K] and per-channel ``weight_scale`` fp32 [N, 1]."""
    add_param(layer, "weight", (n, k), torch.int8, weight_loader, output_dim=0, input_dim=1)
    add_param(layer, "weight_scale", (n, 1), torch.float32, weight_loader, fill=1.0, output_dim=0)


@register_scheme("W8A8", "linear")
class W8A8StaticLinear(QuantLinearScheme):
    """Static W8A8 linear; after loading the layer holds ``w8a8_w_t`` (int8 [K, N] column-major view),
    ``w8a8_sx`` / ``w8a8_zx`` (python floats), ``w8a8_deq`` fp32 [N], ``w8a8_beta`` int32 [N] or None and
    ``w8a8_gemv`` (small-M kernel operands, ``kernels.Int8Gemv``, or None) and ``w8a8_amx`` (AMX-INT8 operands,
    ``kernels.Int8Amx``, or None: taken at every M, bit-identical)."""

    force_reference = False

    @property
    def modelslim(self) -> bool:
        return self.spec.source_format != "compressed-tensors"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        n, k, s = sum(output_partition_sizes), input_size_per_partition, num_shards(output_partition_sizes)
        create_int8_weight(layer, n, k, weight_loader)
        add_param(layer, "input_scale", (s, 1), torch.float32, weight_loader, fill=1.0, per_shard_scalar=True)
        if not self.modelslim:
            return
        add_param(layer, "weight_offset", (n, 1), torch.float32, weight_loader, output_dim=0, optional_default=0.0)
        add_param(layer, "input_offset", (s, 1), torch.float32, weight_loader, per_shard_scalar=True)
        add_param(layer, "deq_scale", (n,), torch.int64, deq_scale_loader(weight_loader), output_dim=0)
        add_param(layer, "quant_bias", (n,), torch.int32, weight_loader, output_dim=0, row_parallel_rank0_only=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_zero_offset(layer, "weight_offset", self.quant_type)  # deq_scale / quant_bias fold no weight offset
        layer.w8a8_w_t = layer.weight.detach().t()
        s_w = layer.weight_scale.detach().float().reshape(-1)
        if self.modelslim:  # deq_scale / quant_bias were computed offline with the shards' common scale
            layer.w8a8_sx = common_shard_scalar(layer, layer.input_scale, "input_scale")
            layer.w8a8_zx = common_shard_scalar(layer, layer.input_offset, "input_offset")
            layer.w8a8_deq = decode_deq_scale(layer.deq_scale.detach())
            layer.w8a8_beta = layer.quant_bias.detach().to(torch.int32).contiguous()
        else:  # d = s_x * s_w is formed here, so the shards can share the largest scale
            layer.w8a8_sx = max_shard_scalar(layer, layer.input_scale, "input_scale")
            layer.w8a8_zx = 0.0
            layer.w8a8_deq = (torch.tensor(layer.w8a8_sx, dtype=torch.float32) * s_w).contiguous()
            layer.w8a8_beta = None
        layer.w8a8_deq = layer.w8a8_deq.float().contiguous()
        layer.w8a8_amx = prepare_int8_amx(layer.weight.detach())
        layer.w8a8_gemv = prepare_int8_gemv(layer.weight.detach(), nv=layer.w8a8_amx is None)

    def decode_stack_call(self, layer: nn.Module) -> StackSpec | None:
        """The C++ decode stack's call of the AMX-INT8 kernel (``kernels.STACK_KIND_W8A8_STATIC_AMX``), else of the
        small-M kernel (``kernels.STACK_KIND_W8A8_STATIC``), None without either."""
        amx = getattr(layer, "w8a8_amx", None)
        if amx is None:
            gemv = getattr(layer, "w8a8_gemv", None)
            if gemv is None:
                return None
            return int8_static_stack_spec(gemv, layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq, layer.w8a8_beta,
                                          self._float_bias(getattr(layer, "bias", None)))
        return amx.static_stack_spec(layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq, layer.w8a8_beta,
                                     self._float_bias(getattr(layer, "bias", None)))

    def _float_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """ModelSlim folds the float bias into quant_bias; compressed-tensors adds it after dequantization."""
        return None if self.modelslim else bias

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        amx = getattr(layer, "w8a8_amx", None)
        if amx is not None and amx_takes(x):
            return amx.linear_static(x, layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq, layer.w8a8_beta,
                                     self._float_bias(bias))
        gemv = getattr(layer, "w8a8_gemv", None)
        if gemv is not None and gemv_fits(x, gemv.max_m):
            return int8_gemv_static(gemv, x, layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq, layer.w8a8_beta,
                                    self._float_bias(bias))
        return int8_linear_static(x, layer.w8a8_w_t, layer.w8a8_sx, layer.w8a8_zx, layer.w8a8_deq,
                                  layer.w8a8_beta, self._float_bias(bias))

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.detach().float() * layer.weight_scale.detach().float().reshape(-1, 1)

    def encoded_bias(self, layer: nn.Module) -> torch.Tensor | None:
        """The float bias the integer pipeline adds: ``d * (beta + z_x * sum_k Wq)`` (ModelSlim; exact inverse of
        the offline fold up to its rounding), None for compressed-tensors."""
        if layer.w8a8_beta is None:
            return None
        row_sum = layer.weight.detach().to(torch.int64).sum(dim=1).double()
        return (layer.w8a8_deq.double() * (layer.w8a8_beta.double() + layer.w8a8_zx * row_sum)).float()

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``y = ((xq - z_x) * s_x) @ (Wq * s_w)^T + b`` in float32 (b = the bias the checkpoint encodes)."""
        xq = quantize_static_int8(x.reshape(-1, x.shape[-1]), layer.w8a8_sx, layer.w8a8_zx)
        x_deq = (xq.float() - layer.w8a8_zx) * layer.w8a8_sx
        y = x_deq @ self.dequantized_weight(layer).t()
        b = self.encoded_bias(layer) if self.modelslim else bias
        if b is not None:
            y = y + b.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)
