"""Loaders for HF checkpoints: safetensors directories (single file or sharded with an index), GGUF, and "auto"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ascent.loader.base import WeightsIteratorLoader, register_loader

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_path: str) -> list[Path]:
    """The safetensors files holding the model: those named by the index if present, else every ``*.safetensors``
    (``consolidated*.safetensors`` duplicates are dropped when HF-format files exist)."""
    path = Path(model_path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"model file {model_path!r} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"model path {model_path!r} does not exist")
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        hint = f" ({', '.join(pickles[:3])}: PyTorch pickle checkpoints are not loaded; convert them to " \
               f"safetensors)" if pickles else ""
        raise ValueError(f"no *.safetensors files in {model_path!r}{hint}")
    return hf_files or files


def iterate_safetensors_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file, one tensor at a time (CPU, checkpoint dtype)."""
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                yield name, reader.get_tensor(name)


def _iterate_gguf(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from ascent.loader.gguf import iterate_gguf_weights

    return iterate_gguf_weights(model_path)


@register_loader("safetensors")
class SafetensorsLoader(WeightsIteratorLoader):
    def iterate_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        return iterate_safetensors_weights(model_path)


@register_loader("gguf")
class GGUFLoader(WeightsIteratorLoader):
    def iterate_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        if not str(model_path).endswith(".gguf") or not Path(model_path).is_file():
            raise ValueError(f"GGUF load format needs a .gguf file path, got {model_path!r}")
        return _iterate_gguf(model_path)


@register_loader("auto")
class AutoLoader(WeightsIteratorLoader):
    """A ``.gguf`` file -> GGUF; a directory (or ``.safetensors`` file) -> safetensors."""

    def iterate_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        if str(model_path).endswith(".gguf") and Path(model_path).is_file():
            return _iterate_gguf(model_path)
        return iterate_safetensors_weights(model_path)
