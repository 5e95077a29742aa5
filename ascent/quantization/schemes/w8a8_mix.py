"""W8A8_MIX (PD mix, spec §2): the W8A8 static parameter set; a KV-consumer instance
(``spec.extra["kv_consumer"]``, the decode side of PD disaggregation) runs the static path, every other instance
the dynamic per-token path over the same int8 weights with ``weight_scale`` (plus the float bias): at decode-sized M
through the AMX-INT8 or the small-M kernel (and the decode stack), as ``W8A8_DYNAMIC`` does."""

from __future__ import annotations

import torch
from torch import nn

from ascent.quantization.kernels import StackSpec
from ascent.quantization.registry import register_scheme
from ascent.quantization.schemes.common import use_reference
from ascent.quantization.schemes.w8a8_dynamic import apply_int8_dynamic, dynamic_reference, int8_dynamic_stack_call
from ascent.quantization.schemes.w8a8_static import W8A8StaticLinear


@register_scheme("W8A8_MIX", "linear")
class W8A8MixLinear(W8A8StaticLinear):
    """Static or dynamic activation quant chosen once from ``spec.extra.get("kv_consumer")``."""

    @property
    def static_path(self) -> bool:
        return bool(self.spec.extra.get("kv_consumer", False))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.w8a8_ws = layer.weight_scale.detach().float().reshape(-1).contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.static_path:
            return super().apply(layer, x, bias)
        if use_reference(self):
            return self.apply_reference(layer, x, bias)
        return apply_int8_dynamic(layer, x, bias)

    def decode_stack_call(self, layer: nn.Module) -> StackSpec | None:
        """Either path joins the decode stack with the kernel its ``apply`` takes for decode-sized M."""
        if self.static_path:
            return super().decode_stack_call(layer)
        return int8_dynamic_stack_call(layer)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.static_path:
            return super().apply_reference(layer, x, bias)
        return dynamic_reference(x, self.dequantized_weight(layer), bias)
