"""ModelSlim config for the 310P profile: the same description lookup, schemes from ``REGISTRY_310P``
(W8A8 / W8A8_DYNAMIC / W8A8S / W8A8SC) and embeddings (incl. lm_head) always unquantized."""

from __future__ import annotations

from typing import Any, ClassVar

from ascent.quantization.base import QuantSpec
from ascent.quantization.configs.modelslim import ModelSlimConfig
from ascent.quantization.registry import REGISTRY_310P, SchemeRegistry


class ModelSlimConfig310P(ModelSlimConfig):
    """``--quantization ascend`` under ``--hardware-profile 310p``."""

    name: ClassVar[str] = "ascend"

    def __init__(self, description: dict[str, Any], model_type: str | None = None,
                 packed_modules: dict[str, list[str]] | None = None, source: str = "quant_model_description.json",
                 registry: SchemeRegistry | None = None) -> None:
        super().__init__(description, model_type, packed_modules, source, registry or REGISTRY_310P)

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        if layer_type == "embedding":
            return None
        return super().get_spec(prefix, layer_type)
