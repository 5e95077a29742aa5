"""The "dummy" load format: random weights from a fixed seed, no files read (benchmarks, memory profiling)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascent.loader.base import ModelLoader, build_model, finalize_model, register_loader

DUMMY_SEED = 1234


def initialize_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter deterministically: norm weights 1, other float params U(low, high), integer params
    (packed quantized weights) uniform over 0..15. Values are drawn on the CPU so every device gets the same ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.is_floating_point():
                values = torch.empty(param.shape, dtype=torch.float32).uniform_(low, high, generator=generator)
                param.copy_(values)
            else:
                param.copy_(torch.randint(0, 16, param.shape, generator=generator))


@register_loader("dummy")
class DummyModelLoader(ModelLoader):
    def load_model(self, model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
        model = build_model(hf_config, dtype, device)
        initialize_dummy_weights(model)
        return finalize_model(model)
