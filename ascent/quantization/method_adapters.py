"""Adapters from schemes to the ``quant_method`` objects layers call.

``quant_method_for(config, layer, prefix)`` asks ``config.get_spec(prefix, layer_type)`` for the layer kind and
wraps the registry's scheme:

* ``LinearBase`` -> :class:`QuantLinearMethod` (a ``LinearMethodBase``); None when the spec is None, so the layer
  falls back to ``UnquantizedLinearMethod``;
* ``FusedMoE`` -> :class:`QuantMoEMethod` (exposes the scheme's ``create_weights`` / ``apply_experts`` /
  ``dequantized_weights`` / ``process_weights_after_loading``);
* attention layers -> :class:`QuantKVCacheMethod` (``create_weights`` / ``quantize_kv`` / ``dequantize_kv``);
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` -> :class:`QuantEmbeddingMethod` (vLLM Ascend's
  ``AscendEmbeddingMethod``: the *linear* scheme of the layer's quant type, e.g. a ModelSlim description with
  ``"lm_head.weight": "W8A16"`` or a compressed-tensors group targeting ``Linear`` without ``ignore: [lm_head]``).
  The lm_head runs the scheme's ``apply``; an input embedding table needs a weight-only scheme that can dequantize
  looked-up rows (``supports_embedding``: W8A16 / W4A16), any other quant type is a NotImplementedError naming
  ``quant_type`` and ``layer_type='embedding'`` (vLLM Ascend has no quantized lookup either).

The registry is ``config.registry`` when the config has one (the 310P ModelSlim config always does), else the
registry of the current hardware profile. ``W8A8SC`` is rejected with one clear ValueError for every registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ascent.layers.linear import LinearBase, LinearMethodBase
from ascent.quantization.base import (
    QuantAttentionScheme,
    QuantizationConfig,
    QuantLinearScheme,
    QuantMoEScheme,
    QuantScheme,
    QuantSpec,
)
from ascent.quantization.registry import SchemeRegistry, registry_for_profile

REJECTED_TYPES = {"W8A8SC": "W8A8SC is a 310P-only compressed format; re-export as W8A8S/W8A8"}


def registry_of(config: QuantizationConfig) -> SchemeRegistry:
    """``config.registry`` if set, else the registry of the current hardware profile."""
    registry = getattr(config, "registry", None)
    if registry is not None:
        return registry
    from ascent.platform.device_config import get_current_profile

    return registry_for_profile(get_current_profile().name)


def create_scheme(registry: SchemeRegistry, spec: QuantSpec, prefix: str = "") -> QuantScheme:
    """The registry's scheme for ``spec`` (NotImplementedError naming both keys when unsupported). Formats no
    registry can run (``REJECTED_TYPES``) are a ValueError with the re-export hint, whichever registry is asked
    (the 310P registry's own W8A8SC scheme raises the same message when constructed)."""
    try:
        cls = registry.get(spec.quant_type, spec.layer_type)
    except NotImplementedError:
        if spec.quant_type in REJECTED_TYPES:
            raise ValueError(f"{registry.label}{REJECTED_TYPES[spec.quant_type]} (quant_type={spec.quant_type!r}, "
                             f"layer_type={spec.layer_type!r}, layer {prefix!r})") from None
        raise
    return cls(spec)


class QuantLinearMethod(LinearMethodBase):
    """A ``LinearMethodBase`` that delegates to a :class:`QuantLinearScheme`."""

    def __init__(self, scheme: QuantLinearScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        weight_loader = extra_weight_attrs.pop("weight_loader")
        if extra_weight_attrs:
            raise ValueError(f"unexpected weight attributes for a quantized linear: {sorted(extra_weight_attrs)}")
        self.scheme.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                                   params_dtype, weight_loader)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply(layer, x, bias)

    def apply_logits(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of a quantized lm_head (:meth:`QuantLinearScheme.apply_logits`)."""
        return self.scheme.apply_logits(layer, x, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)

    def decode_stack_call(self, layer: nn.Module) -> Any:
        """The scheme's C++ decode-stack call (``models/decode_stack.py``), None when it has none."""
        call = getattr(self.scheme, "decode_stack_call", None)
        return call(layer) if call is not None else None

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return self.scheme.dequantized_weight(layer)

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply_reference(layer, x, bias)


class QuantMoEMethod:
    """The quant method of a ``FusedMoE`` layer, delegating to a :class:`QuantMoEScheme`."""

    def __init__(self, scheme: QuantMoEScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype, weight_loader: Any) -> None:
        self.scheme.create_weights(layer, num_local_experts, hidden_size, intermediate_size_per_partition,
                                   params_dtype, weight_loader)

    def apply_experts(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                      activation: str) -> torch.Tensor:
        return self.scheme.apply_experts(layer, x, group_list, activation)

    def dequantized_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scheme.dequantized_weights(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)

    def experts_moved(self, layer: nn.Module, slots: list[int]) -> None:
        """EPLB refilled ``slots``: let the scheme rebuild what it derived from them."""
        self.scheme.experts_moved(layer, slots)


class QuantEmbeddingMethod(QuantLinearMethod):
    """The quant method of a ``VocabParallelEmbedding`` (rows = vocab entries, K = embedding dim) or
    ``ParallelLMHead`` (``apply``: ``hidden @ W^T``), delegating to a :class:`QuantLinearScheme`."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``[*ids.shape, K]`` of the local row indices ``ids``."""
        return self.scheme.embedding_rows(layer, ids)


class QuantKVCacheMethod:
    """The quant method of an attention layer (KV-cache quantization), delegating to a :class:`QuantAttentionScheme`."""

    def __init__(self, scheme: QuantAttentionScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, num_kv_heads: int, head_size: int, params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        self.scheme.create_weights(layer, num_kv_heads, head_size, params_dtype, weight_loader)

    def quantize_kv(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scheme.quantize_kv(layer, key, value)

    def dequantize_kv(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scheme.dequantize_kv(layer, key, value)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)


def layer_type_of(layer: nn.Module) -> str | None:
    """``linear`` | ``moe`` | ``attention`` | ``embedding`` for the engine layer classes; None otherwise."""
    from ascent.attention.layer import Attention
    from ascent.layers.embed_head import VocabParallelEmbedding
    from ascent.layers.fused_moe import FusedMoE

    if isinstance(layer, LinearBase):
        return "linear"
    if isinstance(layer, FusedMoE):
        return "moe"
    if isinstance(layer, Attention) or getattr(layer, "is_attention_layer", False):
        return "attention"
    if isinstance(layer, VocabParallelEmbedding):
        return "embedding"
    return None


_WRAPPERS: dict[str, tuple[type, type]] = {
    "linear": (QuantLinearScheme, QuantLinearMethod),
    "moe": (QuantMoEScheme, QuantMoEMethod),
    "attention": (QuantAttentionScheme, QuantKVCacheMethod),
}


def quant_method_for(config: QuantizationConfig, layer: nn.Module, prefix: str) -> Any | None:
    """The quant method of ``layer`` at engine ``prefix`` (None = unquantized; see the module docstring)."""
    layer_type = layer_type_of(layer)
    if layer_type is None:
        return None
    spec = config.get_spec(prefix, layer_type)
    if spec is None:
        return None
    if layer_type == "embedding":
        return _embedding_method(config, layer, spec, prefix)
    if spec.layer_type != layer_type:
        raise ValueError(f"{prefix}: config returned a {spec.layer_type!r} spec for a {layer_type!r} layer")
    scheme = create_scheme(registry_of(config), spec, prefix)
    base, wrapper = _WRAPPERS[layer_type]
    if not isinstance(scheme, base):
        raise TypeError(f"scheme {type(scheme).__name__} for {spec.quant_type}/{layer_type} is not a {base.__name__}")
    return wrapper(scheme)


def _embedding_method(config: QuantizationConfig, layer: nn.Module, spec: QuantSpec, prefix: str
                      ) -> QuantEmbeddingMethod:
    """The linear scheme of ``spec.quant_type`` for an embedding / lm_head (see the module docstring)."""
    from ascent.layers.embed_head import ParallelLMHead

    try:
        scheme = create_scheme(registry_of(config), dataclasses.replace(spec, layer_type="linear"), prefix)
    except NotImplementedError as exc:
        raise NotImplementedError(f"Unsupported quant_type={spec.quant_type!r} for layer_type='embedding' "
                                  f"({prefix!r}): no linear scheme for it ({exc})") from None
    if not isinstance(scheme, QuantLinearScheme):
        raise TypeError(f"scheme {type(scheme).__name__} for {spec.quant_type}/embedding is not a QuantLinearScheme")
    if not isinstance(layer, ParallelLMHead) and not scheme.supports_embedding:
        raise NotImplementedError(
            f"Unsupported quant_type={spec.quant_type!r} for layer_type='embedding' ({prefix!r}): an input embedding "
            f"table can only be looked up from weight-only per-row formats (W8A16, W4A16); {spec.quant_type} is "
            f"supported on the lm_head only. Mark {prefix} FLOAT / ignore it in the quantization config")
    return QuantEmbeddingMethod(scheme)
