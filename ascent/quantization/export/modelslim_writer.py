"""ModelSlim (msModelSlim) checkpoint writer: ``quant_model_weight_<type>.safetensors`` +
``quant_model_description.json`` with the tensor names and dtypes of specs/quantization.md §1.1.

Per quantized linear ``P`` (N = out, K = in; "model dtype" = the export dtype):

* W8A16, W8A8_DYNAMIC: ``weight`` int8 [N, K], ``weight_scale`` / ``weight_offset`` model dtype [N, 1];
* W4A16: ``weight`` int8 [N, K] holding int4 values, ``weight_scale`` / ``weight_offset`` [N, K / g]; the description
  has ``group_size``;
* W8A8 (static): the W8A16 set plus ``input_scale`` / ``input_offset`` model dtype [1] (asymmetric per-tensor),
  ``deq_scale`` [N] = fp32(input_scale * weight_scale) - int64 holding the fp32 bits for fp16 models, float32
  otherwise - and ``quant_bias`` int32 [N] = rint(b / deq_scale - input_offset * sum_k Wq[n, k]);
* W4A8_DYNAMIC: ``weight`` int8 [N / 2, K] (two int4 per byte along N, even row in the low nibble),
  ``weight_scale`` / ``weight_offset`` fp32 [N, 1], ``scale_bias`` fp32 = 8 * sum_k Wq[n, k] * weight_scale[n]:
  [N, 1] for column-parallel layers, [N, 16] partial sums over 16 equal K-chunks for o_proj / down_proj.

A float ``bias`` is written too when the layer has one. Every other tensor is FLOAT in the description. A quantized
``lm_head`` (``--quantize-lm-head``) is one more column-parallel linear: its tensors carry the scheme's type.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ascent.quantization.export.rtn import deq_scale_int64, pack_int4_pairs_along_n
from ascent.quantization.export.schemes import ExportScheme, LayerExport, asymmetric_input_params

DESCRIPTION_FILE = "quant_model_description.json"
DESCRIPTION_VERSION = "1.0.0"
ROW_PARALLEL_SUFFIXES = ("o_proj", "down_proj")
SCALE_BIAS_CHUNKS = 16


def weight_file_name(scheme: ExportScheme) -> str:
    """msmodelslim's default weight file name, e.g. ``quant_model_weight_w8a8_dynamic.safetensors``."""
    return f"quant_model_weight_{scheme.modelslim_type.lower()}.safetensors"


def _zeros_like(scale: torch.Tensor) -> torch.Tensor:
    return torch.zeros(scale.shape, dtype=scale.dtype)


def _w8a8_static(layer: LayerExport, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if layer.stats is None:
        raise ValueError(f"{layer.name}: W8A8 static needs calibration statistics")
    q, w_scale = layer.weight.q, layer.weight.scale
    input_scale, input_offset = asymmetric_input_params(layer.stats, dtype)
    deq = input_scale.float() * w_scale.float().reshape(-1)
    bias = layer.bias.double() if layer.bias is not None else torch.zeros(q.shape[0], dtype=torch.float64)
    row_sum = q.to(torch.int64).sum(dim=1).double()
    quant_bias = torch.round(bias / deq.double() - input_offset.double() * row_sum).to(torch.int32)
    return {
        "input_scale": input_scale, "input_offset": input_offset,
        "deq_scale": deq_scale_int64(deq) if dtype == torch.float16 else deq.contiguous(),
        "quant_bias": quant_bias,
    }


def scale_bias(layer: LayerExport) -> torch.Tensor:
    """W4A8 ``scale_bias`` (fp32): ``8 * sum_k Wq * s`` per row; 16 K-chunk partial sums for row-parallel layers."""
    q = layer.weight.q.to(torch.float64)
    scale = layer.weight.scale.to(torch.float64).reshape(-1, 1)
    n, k = q.shape
    if layer.name.rsplit(".", 1)[-1] in ROW_PARALLEL_SUFFIXES:
        if k % SCALE_BIAS_CHUNKS:
            raise ValueError(f"{layer.name}: K={k} is not divisible by {SCALE_BIAS_CHUNKS} (W4A8 scale_bias chunks)")
        sums = q.reshape(n, SCALE_BIAS_CHUNKS, k // SCALE_BIAS_CHUNKS).sum(dim=2)
    else:
        sums = q.sum(dim=1, keepdim=True)
    return (8.0 * sums * scale).to(torch.float32)


def layer_tensors(layer: LayerExport, scheme: ExportScheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors (without the ``P.`` prefix) of one quantized linear per the scheme."""
    w = layer.weight
    if scheme.modelslim_type == "W4A8_DYNAMIC":
        scale = w.scale.to(torch.float32)
        tensors = {"weight": pack_int4_pairs_along_n(w.q), "weight_scale": scale, "weight_offset": _zeros_like(scale),
                   "scale_bias": scale_bias(layer)}
    else:
        offset = w.offset.contiguous() if w.offset is not None else _zeros_like(w.scale)
        tensors = {"weight": w.q.contiguous(), "weight_scale": w.scale.contiguous(), "weight_offset": offset}
        if scheme.modelslim_type == "W8A8":
            tensors.update(_w8a8_static(layer, dtype))
    if layer.bias is not None:
        tensors["bias"] = layer.bias.to(dtype).contiguous()
    return tensors


def write_modelslim(out_dir: Path, float_tensors: dict[str, torch.Tensor], layers: list[LayerExport],
                    scheme: ExportScheme, dtype: torch.dtype, group_size: int | None) -> dict[str, object]:
    """Write the weight file and the description into ``out_dir``; returns the description."""
    tensors: dict[str, torch.Tensor] = {}
    description: dict[str, object] = {"model_quant_type": scheme.modelslim_type, "version": DESCRIPTION_VERSION}
    if scheme.grouped:
        description["group_size"] = int(group_size or 0)
    quantized = {layer.name: layer for layer in layers}
    for name, tensor in float_tensors.items():
        module = name.rsplit(".", 1)[0]
        if module in quantized:
            continue
        tensors[name] = tensor.contiguous()
        description[name] = "FLOAT"
    for layer in layers:
        for suffix, tensor in layer_tensors(layer, scheme, dtype).items():
            key = f"{layer.name}.{suffix}"
            tensors[key] = tensor
            description[key] = scheme.modelslim_type
    out_dir = Path(out_dir)
    save_file(tensors, str(out_dir / weight_file_name(scheme)), metadata={"format": "pt"})
    with open(out_dir / DESCRIPTION_FILE, "w", encoding="utf-8") as f:
        json.dump(description, f, indent=2)
        f.write("\n")
    return description
