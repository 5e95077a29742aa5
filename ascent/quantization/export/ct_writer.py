"""compressed-tensors checkpoint writer (the layout LLM-Compressor saves with ``save_compressed=True``).

``config.json`` gets a ``quantization_config`` (``quant_method: compressed-tensors``, one ``config_groups`` entry
targeting ``Linear``, ``ignore: ["lm_head"]`` - empty when the lm_head is quantized too (``--quantize-lm-head``) -
``quantization_status: compressed``); tensors per quantized linear ``P``:

* ``int-quantized`` (w8a8, w8a8_dynamic, w4a8): ``weight`` int8 [N, K] (int4 values one per int8),
  ``weight_scale`` model dtype [N, 1]; w8a8 static adds ``input_scale`` [1] (symmetric per-tensor, absmax / 127);
* ``pack-quantized`` (w8a16, w4a16): ``weight_packed`` int32 [N, ceil(K * bits / 32)] (compressed-tensors >= 0.20
  dense LSB-first layout, see ``rtn.pack_rows_int32``), ``weight_scale`` [N, 1] or [N, K / g],
  ``weight_shape`` int64 [2] = [N, K].

Activation scales use absmax / 127 (the integer range [-127, 127] is hit exactly by the calibrated maximum); the
compressed-tensors decompressor only needs ``weight * weight_scale``, which is format-independent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ascent.quantization.export.rtn import pack_rows_int32
from ascent.quantization.export.schemes import ExportScheme, LayerExport, symmetric_input_scale

CT_VERSION = "0.20.1"
WEIGHTS_FILE = "model.safetensors"


def ct_format(scheme: ExportScheme) -> str:
    """``pack-quantized`` for weight-only schemes (as LLM-Compressor infers), ``int-quantized`` otherwise."""
    return "pack-quantized" if scheme.activations is None else "int-quantized"


def _args(num_bits: int, strategy: str, dynamic: bool, group_size: int | None = None) -> dict[str, Any]:
    """A serialized ``QuantizationArgs`` as compressed-tensors 0.20 ``model_dump`` writes it (unset optional fields
    - actorder, block_structure, scale_dtype, observer, zp_dtype, empty observer_kwargs - are omitted)."""
    return {"dynamic": dynamic, "group_size": group_size, "num_bits": num_bits, "strategy": strategy,
            "symmetric": True, "type": "int"}


def quantization_config(scheme: ExportScheme, group_size: int | None,
                        quantize_lm_head: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` block of ``config.json`` for ``scheme`` (``lm_head`` ignored unless
    ``quantize_lm_head``: the ``Linear`` target then covers it)."""
    fmt = ct_format(scheme)
    weights = (_args(scheme.weight_bits, "group", False, group_size) if scheme.grouped
               else _args(scheme.weight_bits, "channel", False))
    acts = None
    if scheme.activations == "static":
        acts = _args(8, "tensor", False)
    elif scheme.activations == "dynamic":
        acts = _args(8, "token", True)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
             "format": fmt}
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": [] if quantize_lm_head else ["lm_head"],
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def layer_tensors(layer: LayerExport, scheme: ExportScheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors (without the ``P.`` prefix) of one quantized linear."""
    w = layer.weight
    if ct_format(scheme) == "pack-quantized":
        tensors = {"weight_packed": pack_rows_int32(w.q, w.bits), "weight_scale": w.scale.contiguous(),
                   "weight_shape": torch.tensor(list(w.q.shape), dtype=torch.int64)}
    else:
        tensors = {"weight": w.q.contiguous(), "weight_scale": w.scale.contiguous()}
        if scheme.activations == "static":
            if layer.stats is None:
                raise ValueError(f"{layer.name}: static activation quantization needs calibration statistics")
            tensors["input_scale"] = symmetric_input_scale(layer.stats, dtype)
    if layer.bias is not None:
        tensors["bias"] = layer.bias.to(dtype).contiguous()
    return tensors


def write_compressed_tensors(out_dir: Path, float_tensors: dict[str, torch.Tensor], layers: list[LayerExport],
                             scheme: ExportScheme, dtype: torch.dtype, group_size: int | None) -> dict[str, Any]:
    """Write ``model.safetensors`` into ``out_dir``; returns the ``quantization_config`` for ``config.json`` (the
    ``ignore`` list drops ``lm_head`` when ``layers`` contain it)."""
    quantized = {layer.name: layer for layer in layers}
    tensors = {name: t.contiguous() for name, t in float_tensors.items() if name.rsplit(".", 1)[0] not in quantized}
    for layer in layers:
        for suffix, tensor in layer_tensors(layer, scheme, dtype).items():
            tensors[f"{layer.name}.{suffix}"] = tensor
    save_file(tensors, str(Path(out_dir) / WEIGHTS_FILE), metadata={"format": "pt"})
    head_quantized = any(name.rsplit(".", 1)[-1] == "lm_head" for name in quantized)
    return quantization_config(scheme, group_size if scheme.grouped else None, head_quantized)
