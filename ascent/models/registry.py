"""Model registry: HF ``architectures`` name -> model class (imported lazily)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "DeepseekV2ForCausalLM": ("ascent.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("ascent.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "LlamaForCausalLM": ("ascent.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("ascent.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("ascent.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("ascent.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class of the first supported name in ``architectures``; ValueError naming them otherwise."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"supported: {', '.join(supported_architectures())}"
    )
