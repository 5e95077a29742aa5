"""ModelOpt MXFP8 config (``quant_method`` ``modelopt_mxfp8`` / ``mxfp8``, or ``quant_algo: "MXFP8"``).

Linear, lm_head (unless excluded; it runs the linear scheme, ``method_adapters.QuantEmbeddingMethod``) and MoE layers
use ``W8A8_MXFP8`` (weight float8_e4m3fn ``[N, K]``, ``weight_scale`` uint8
E8M0 ``[N, K/32]``, dynamic MXFP8 activations); ``exclude_modules`` patterns (fnmatch wildcards or plain names) and
every vision-tower prefix stay unquantized; embeddings and the KV cache stay native.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, ClassVar

from ascent.quantization.base import QuantizationConfig, QuantSpec
from ascent.quantization.configs.compressed_tensors import load_hf_quant_config
from ascent.quantization.configs.fp8 import all_or_none, expand_fused
from ascent.quantization.configs.modelslim_mapping import packed_modules_for, packed_modules_of_config
from ascent.quantization.registry import DEFAULT_REGISTRY, SchemeRegistry

MODELOPT_METHODS = ("modelopt", "modelopt_mxfp8", "mxfp8")
VISION_MARKERS = ("vision_tower", "vision_model", "vit_large_projector")
MX_BLOCK = 32


def load_modelopt_config(model_dir: str | Path, hf_config: Any = None) -> dict[str, Any] | None:
    """The ModelOpt quantization dict: config.json's ``quantization_config`` or ``hf_quant_config.json``'s
    ``quantization`` section; None when neither describes ModelOpt MXFP8."""
    qc = load_hf_quant_config(model_dir, hf_config)
    if qc and (qc.get("quant_method") in MODELOPT_METHODS or str(qc.get("quant_algo", "")).upper() == "MXFP8"):
        return qc
    path = Path(model_dir) / "hf_quant_config.json"
    if path.is_file():
        section = json.loads(path.read_text()).get("quantization") or {}
        if str(section.get("quant_algo", "")).upper() == "MXFP8":
            return section
    return None


def excluded(name: str, patterns: list[str]) -> bool:
    """fnmatch patterns, plain names (component-anchored prefix) or suffixes such as ``lm_head``."""
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            if fnmatch.fnmatchcase(name, pattern):
                return True
        elif name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern):
            return True
    return False


class ModelOptMxfp8Config(QuantizationConfig):
    """ModelOpt / MiniMax-style MXFP8 checkpoints."""

    name: ClassVar[str] = "modelopt"

    def __init__(self, quant_config: dict[str, Any], packed_modules: dict[str, list[str]] | None = None,
                 registry: SchemeRegistry | None = None) -> None:
        algo = str(quant_config.get("quant_algo") or "MXFP8").upper()
        if algo != "MXFP8":
            raise NotImplementedError(f"ModelOpt quant_algo={algo!r} is not supported (only MXFP8)")
        self.exclude = list(quant_config.get("exclude_modules") or quant_config.get("ignore") or [])
        self.packed_modules = packed_modules if packed_modules is not None else packed_modules_for(None)
        self.registry = registry or DEFAULT_REGISTRY

    @classmethod
    def from_model_dir(cls, model_dir: str, hf_config: Any) -> "ModelOptMxfp8Config":
        qc = load_modelopt_config(model_dir, hf_config)
        if qc is None:
            raise ValueError(f"{model_dir!r}: no ModelOpt MXFP8 quantization config (config.json "
                             f"quantization_config or hf_quant_config.json)")
        return cls(qc, packed_modules_of_config(hf_config))

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        if layer_type == "attention" or any(m in prefix for m in VISION_MARKERS):
            return None
        if layer_type == "embedding" and prefix.split(".")[-1] != "lm_head":
            return None
        names = expand_fused(prefix, self.packed_modules, layer_type)
        if all_or_none(prefix, [excluded(n, self.exclude) for n in names]):
            return None
        return QuantSpec(quant_type="W8A8_MXFP8", layer_type=layer_type, source_format="modelopt", weight_bits=8,
                         weight_type="float", weight_strategy="group", group_size=MX_BLOCK, act_bits=8,
                         act_type="float", act_strategy="group", act_dynamic=True, act_group_size=MX_BLOCK)
