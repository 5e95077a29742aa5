"""Model loaders, selected by ``--load-format``.

``get_model(model_path, hf_config, dtype, device, load_format)`` builds the model class named by
``hf_config.architectures`` on ``device``, fills its weights with the chosen loader, checks that every parameter was
loaded, runs the quantization methods' post-load hooks and returns the model in eval mode. Loaders that read
checkpoint files also get the checkpoint's quantization config (``quantization`` argument, auto-detected by default;
``ascent.quantization.detect``); parameters tagged ``quant_optional`` may be absent from the checkpoint.
Built-in formats: ``auto`` (``.gguf`` file -> GGUF, directory -> safetensors), ``safetensors``, ``gguf``, ``dummy``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ascent.layers.cpu_packing import limit_dual_layouts
from ascent.models.registry import get_model_class

_LOADERS: dict[str, type["ModelLoader"]] = {}


class ModelLoader(ABC):
    """Builds a model and fills its weights from one source format."""

    load_format: str = ""

    @abstractmethod
    def load_model(self, model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """A fully loaded model in eval mode, parameters on ``device`` in ``dtype``."""


class WeightsIteratorLoader(ModelLoader):
    """A loader defined by an iterator over ``(HF checkpoint name, tensor)``; the model casts and shards them."""

    @abstractmethod
    def iterate_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield every checkpoint tensor (lazily)."""

    def load_model(self, model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device,
                   quant_config: Any | None = None) -> nn.Module:
        model = build_model(hf_config, dtype, device, quant_config)
        loaded = model.load_weights(self.iterate_weights(model_path))
        check_all_loaded(model, loaded, model_path)
        return finalize_model(model)


def register_loader(name: str) -> Callable[[type[ModelLoader]], type[ModelLoader]]:
    """Class decorator registering a ``ModelLoader`` under ``--load-format name``."""

    def wrap(cls: type[ModelLoader]) -> type[ModelLoader]:
        if name in _LOADERS and _LOADERS[name] is not cls:
            raise ValueError(f"load format {name!r} is already registered by {_LOADERS[name].__name__}")
        cls.load_format = name
        _LOADERS[name] = cls
        return cls

    return wrap


def _register_builtin_loaders() -> None:
    import ascent.loader.dummy  # noqa: F401
    import ascent.loader.hf  # noqa: F401


def available_load_formats() -> list[str]:
    _register_builtin_loaders()
    return sorted(_LOADERS)


def get_model_loader(load_format: str) -> ModelLoader:
    """A loader instance for ``load_format``; ValueError naming an unknown format."""
    _register_builtin_loaders()
    if load_format not in _LOADERS:
        raise ValueError(f"unknown load format {load_format!r} (available: {', '.join(sorted(_LOADERS))})")
    return _LOADERS[load_format]()


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                quant_config: Any | None = None) -> nn.Module:
    """Instantiate ``hf_config.architectures``'s class with uninitialized parameters on ``device``."""
    cls = get_model_class(list(getattr(hf_config, "architectures", None) or []))
    kwargs = {"quant_config": quant_config} if quant_config is not None else {}
    with torch.device(device):
        model = cls(hf_config, dtype=dtype, **kwargs)
    prepare = getattr(quant_config, "prepare_model", None)
    if prepare is not None:
        with torch.device(device):
            prepare(model)  # e.g. ModelSlim anti-outlier norm biases
    return model


def check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    """ValueError listing the parameters the checkpoint did not provide (``quant_optional`` ones may be absent)."""
    required = {n for n, p in model.named_parameters() if not getattr(p, "quant_optional", False)}
    missing = sorted(required - set(loaded))
    if missing:
        shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint {source!r} is missing weights for: {shown}")


def finalize_model(model: nn.Module) -> nn.Module:
    """Run every quant method's (or module's own) ``process_weights_after_loading`` and switch to eval mode."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading()
    limit_dual_layouts(model)
    return model.eval()


def resolve_quant_config(loader: ModelLoader, model_path: str, hf_config: Any, quantization: str | None,
                         profile_name: str | None) -> Any | None:
    """The checkpoint's quantization config for loaders that read checkpoint files (``WeightsIteratorLoader``);
    other loaders (dummy) build float models and reject an explicit method. See ``ascent.quantization.detect``."""
    from ascent.quantization.detect import canonical_method, get_quantization_config

    if not isinstance(loader, WeightsIteratorLoader):
        if canonical_method(quantization) not in (None, "none"):
            raise ValueError(f"quantization={quantization!r} is not supported with load format "
                             f"{loader.load_format!r}")
        return None
    if profile_name is None:
        from ascent.platform.device_config import get_current_profile

        profile_name = get_current_profile().name
    return get_quantization_config(quantization, model_path, hf_config, profile_name)


def get_model(model_path: str, hf_config: Any, dtype: torch.dtype, device: torch.device | str,
              load_format: str = "auto", quantization: str | None = None,
              profile_name: str | None = None) -> nn.Module:
    """Build and load the model at ``model_path`` (see the module docstring). ``quantization``: None/"auto" detects
    the checkpoint's method, "none" forces float; ``profile_name`` picks the scheme registry (default: current)."""
    loader = get_model_loader(load_format)
    quant_config = resolve_quant_config(loader, model_path, hf_config, quantization, profile_name)
    if quant_config is None:
        return loader.load_model(model_path, hf_config, dtype, torch.device(device))
    return loader.load_model(model_path, hf_config, dtype, torch.device(device), quant_config=quant_config)
