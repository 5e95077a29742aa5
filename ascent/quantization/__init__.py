"""Quantization: configs (ModelSlim, compressed-tensors, FP8, ModelOpt MXFP8) -> specs -> registered schemes.

``get_quantization_config(method, model_dir, hf_config, profile_name)`` parses a checkpoint's description
(auto-detected by ``detect_quantization_method``); the config's ``get_quant_method(layer, prefix)`` gives each layer
its quant method (``method_adapters``) built from the scheme registered for ``(quant_type, layer_type)``.
"""

from ascent.quantization.base import (
    QuantAttentionScheme,
    QuantizationConfig,
    QuantLinearScheme,
    QuantMoEScheme,
    QuantScheme,
    QuantSpec,
    mark_optional,
)
from ascent.quantization.detect import canonical_method, detect_quantization_method, get_quantization_config
from ascent.quantization.registry import (
    DEFAULT_REGISTRY,
    REGISTRY_310P,
    SchemeRegistry,
    register_scheme,
    register_scheme_310p,
    registry_for_profile,
)

__all__ = [
    "DEFAULT_REGISTRY",
    "REGISTRY_310P",
    "QuantAttentionScheme",
    "QuantLinearScheme",
    "QuantMoEScheme",
    "QuantScheme",
    "QuantSpec",
    "QuantizationConfig",
    "SchemeRegistry",
    "canonical_method",
    "detect_quantization_method",
    "get_quantization_config",
    "mark_optional",
    "register_scheme",
    "register_scheme_310p",
    "registry_for_profile",
]
