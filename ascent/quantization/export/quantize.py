"""``quantize_model``: float model -> (optional SmoothQuant) -> RTN of every attention / MLP linear -> a complete
HF-format model directory in the ModelSlim or compressed-tensors layout (config.json, generation_config.json,
tokenizer files, safetensors; ModelSlim adds quant_model_description.json).

``quantize_lm_head=True`` also quantizes ``lm_head`` with the same scheme (calibrated like the other linears for
static activation schemes). A tied model is untied: ``model.embed_tokens.weight`` stays float, the quantized
``lm_head`` tensors are written and config.json gets ``tie_word_embeddings: false``."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascent.quantization.export.calibrate import collect_input_stats, corpus_token_ids, quantized_linear_names
from ascent.quantization.export.ct_writer import write_compressed_tensors
from ascent.quantization.export.modelslim_writer import write_modelslim
from ascent.quantization.export.schemes import (FORMATS, LayerExport, check_asymmetric, check_group_size,
                                                check_packed_width, get_scheme, quantize_layer)
from ascent.quantization.export.smoothquant import apply_smoothquant, smooth_lm_head
from ascent.quantization.export.source import FloatModel, load_float_model

logger = logging.getLogger(__name__)

DEFAULT_GROUP_SIZE = 128
DEFAULT_CALIB_TOKENS = 512


@dataclass
class ExportResult:
    """What :func:`quantize_model` wrote."""

    out_dir: Path
    scheme: str
    format: str
    dtype: torch.dtype
    quantized_layers: list[str]
    seconds: float
    smoothquant_alpha: float | None = None
    files: list[str] = field(default_factory=list)
    quantize_lm_head: bool = False


def _float_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict as HF saves it (a tied ``lm_head.weight`` is dropped)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _write_config(model: Any, out_dir: Path, dtype: torch.dtype, quant_config: dict[str, Any] | None,
                  untie: bool = False) -> None:
    """config.json of the export; ``untie`` sets ``tie_word_embeddings: false`` (top level and ``text_config``)."""
    config = model.config.to_dict()
    if untie:
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict) and "tie_word_embeddings" in config["text_config"]:
            config["text_config"]["tie_word_embeddings"] = False
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.pop("_name_or_path", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    with open(out_dir / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def check_output_dir(out_dir: str | Path) -> None:
    """ValueError unless ``out_dir`` is absent or an empty directory: writing into another export would leave the
    other format's files behind (a checkpoint neither loader reads), and into the source would overwrite it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"output directory {str(out)!r} is not empty; give a new or empty directory")


def _check_dense(model: Any) -> None:
    """ValueError for a mixture-of-experts model: the exporter quantizes nn.Linear projections only, so expert
    weights would stay float under names the MoE loaders do not take."""
    config = getattr(model, "config", None)
    experts = max((int(getattr(config, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")),
                  default=0)
    if experts > 0 or any(p.dim() > 2 for name, p in model.named_parameters() if ".layers." in f".{name}"):
        raise ValueError(f"{type(model).__name__} is a mixture-of-experts model ({experts} experts): ascent quantize "
                         "exports dense models only")


def export_float_model(fm: FloatModel, scheme_name: str, fmt: str, out_dir: str | Path,
                       group_size: int = DEFAULT_GROUP_SIZE, smoothquant: float | None = None,
                       calib_tokens: int = DEFAULT_CALIB_TOKENS, quantize_lm_head: bool = False,
                       asymmetric: bool = False) -> ExportResult:
    """Quantize the already loaded ``fm`` (modified in place when ``smoothquant`` is set) and write ``out_dir``;
    ``quantize_lm_head`` quantizes ``lm_head`` too (untying a tied model, see the module docstring);
    ``asymmetric``: min-max RTN with float offsets (weight-only schemes, ModelSlim layout; ``rtn`` module doc)."""
    start = time.perf_counter()
    scheme = get_scheme(scheme_name)
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not one of {FORMATS}")
    if asymmetric:
        check_asymmetric(scheme, fmt)
    check_output_dir(out_dir)
    model, dtype = fm.model, fm.dtype
    _check_dense(model)
    names = quantized_linear_names(model, include_lm_head=quantize_lm_head)
    if not [n for n in names if not n.endswith("lm_head")]:
        raise ValueError(f"{type(model).__name__} has no decoder-layer linears to quantize")
    modules = dict(model.named_modules())
    if scheme.grouped:
        check_group_size({n: modules[n].weight for n in names}, group_size)
    check_packed_width({n: modules[n].weight for n in names}, scheme, fmt)
    stats = None
    if scheme.activations == "static" or smoothquant is not None:
        tokens = corpus_token_ids(fm.tokenizer, calib_tokens)
        logger.info("calibrating %d linears on %d corpus tokens", len(names), len(tokens))
        stats = collect_input_stats(model, tokens, names)
        if smoothquant is not None:
            stats = apply_smoothquant(model, stats, smoothquant)
            if quantize_lm_head:
                stats.update(smooth_lm_head(model, names[-1], stats, smoothquant))
    layers = []
    for name in names:
        linear = modules[name]
        bias = linear.bias.detach().float() if linear.bias is not None else None
        layers.append(LayerExport(name, quantize_layer(name, linear.weight, scheme, dtype, group_size, asymmetric),
                                  bias,
                                  stats[name] if stats is not None and scheme.activations == "static" else None))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _float_tensors(model)
    quant_config = None
    if fmt == "modelslim":
        write_modelslim(out, tensors, layers, scheme, dtype, group_size)
    else:
        quant_config = write_compressed_tensors(out, tensors, layers, scheme, dtype, group_size)
    _write_config(model, out, dtype, quant_config, untie=quantize_lm_head)
    fm.generation_config.save_pretrained(str(out))
    fm.tokenizer.save_pretrained(str(out))
    return ExportResult(out, scheme.name, fmt, dtype, names, time.perf_counter() - start, smoothquant,
                        sorted(p.name for p in out.iterdir()), quantize_lm_head)


def quantize_model(model: str | None, scheme: str, fmt: str, out_dir: str | Path,
                   group_size: int = DEFAULT_GROUP_SIZE, smoothquant: float | None = None,
                   calib_tokens: int = DEFAULT_CALIB_TOKENS, dtype: str | None = "auto",
                   quantize_lm_head: bool = False, asymmetric: bool = False) -> ExportResult:
    """Load ``model`` (HF dir, ``.gguf`` or None/"default" = SmolLM2) in ``dtype`` and export it (see
    :func:`export_float_model`)."""
    checked = get_scheme(scheme)
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not one of {FORMATS}")
    if asymmetric:
        check_asymmetric(checked, fmt)
    check_output_dir(out_dir)  # before the model loads
    return export_float_model(load_float_model(model, dtype), scheme, fmt, out_dir, group_size, smoothquant,
                              calib_tokens, quantize_lm_head, asymmetric)
