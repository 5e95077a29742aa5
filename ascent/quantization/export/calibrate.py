"""Activation statistics for static activation scales and SmoothQuant: per-input-channel min / max of every
quantized linear's input, recorded by running the float transformers model over tokens of the local corpus."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CORPUS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "ppl_corpus.txt"
CALIB_SEQ_LEN = 512


@dataclass
class ChannelStats:
    """Running per-input-channel minimum and maximum (float32 ``[K]``) of one linear's input."""

    min: torch.Tensor
    max: torch.Tensor

    def update(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        self.min = torch.minimum(self.min, flat.amin(dim=0))
        self.max = torch.maximum(self.max, flat.amax(dim=0))

    def absmax(self) -> torch.Tensor:
        """Per-channel ``max |x|``."""
        return torch.maximum(self.min.abs(), self.max.abs())

    def scaled(self, divisor: torch.Tensor) -> "ChannelStats":
        """Statistics of ``x / divisor`` (``divisor > 0`` per channel) - exact for min / max."""
        return ChannelStats(self.min / divisor, self.max / divisor)


def lm_head_name(model: nn.Module) -> str | None:
    """Name of the output projection (the ``nn.Linear`` called ``lm_head``, e.g. ``lm_head`` or
    ``language_model.lm_head``); None when the model has none."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "lm_head"]
    return names[0] if names else None


def quantized_linear_names(model: nn.Module, include_lm_head: bool = False) -> list[str]:
    """Names of the linears an export quantizes: every ``nn.Linear`` inside the decoder layers (attention and MLP
    projections), plus ``lm_head`` (last) when ``include_lm_head``; embeddings and norms stay float.

    ValueError when ``include_lm_head`` is set and the model has no ``lm_head`` linear."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and ".layers." in f".{name}" and not name.endswith("lm_head")]
    if include_lm_head:
        head = lm_head_name(model)
        if head is None:
            raise ValueError(f"{type(model).__name__} has no lm_head linear to quantize")
        names.append(head)
    return names


def corpus_text(path: Path | str | None = None) -> str:
    """The local English / technical text set shipped with ascent (``benchmarks/data/ppl_corpus.txt``)."""
    target = Path(path) if path is not None else CORPUS_PATH
    if not target.is_file():
        raise ValueError(f"calibration corpus {str(target)!r} does not exist")
    return target.read_text(encoding="utf-8")


def corpus_token_ids(tokenizer: object, num_tokens: int | None = None, path: Path | str | None = None) -> list[int]:
    """The corpus tokenized without special tokens; the first ``num_tokens`` when given (ValueError when the corpus
    is shorter)."""
    ids = list(tokenizer.encode(corpus_text(path), add_special_tokens=False))  # type: ignore[attr-defined]
    if num_tokens is not None:
        if num_tokens < 1 or num_tokens > len(ids):
            raise ValueError(f"calib_tokens={num_tokens} must be between 1 and the corpus size {len(ids)} tokens")
        ids = ids[:num_tokens]
    return ids


@torch.no_grad()
def collect_input_stats(model: nn.Module, token_ids: list[int], names: list[str] | None = None,
                        seq_len: int = CALIB_SEQ_LEN) -> dict[str, ChannelStats]:
    """Run ``model`` over ``token_ids`` in windows of ``seq_len`` and return the input statistics of ``names``
    (default: :func:`quantized_linear_names`)."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    names = names if names is not None else quantized_linear_names(model)
    modules = dict(model.named_modules())
    stats: dict[str, ChannelStats] = {}
    handles = []
    for name in names:
        linear = modules[name]
        k = linear.in_features
        stats[name] = ChannelStats(torch.full((k,), float("inf")), torch.full((k,), float("-inf")))
        handles.append(linear.register_forward_pre_hook(lambda _m, args, n=name: stats[n].update(args[0])))
    try:
        for start in range(0, len(token_ids), seq_len):
            window = torch.tensor([token_ids[start:start + seq_len]], dtype=torch.long)
            model(input_ids=window, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats
