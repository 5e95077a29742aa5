"""Quantization auto-detection and the config factory behind ``--quantization``.

``detect_quantization_method(model_dir)``: a ModelSlim description (``quant_model_description*.json``) -> "ascend";
else config.json ``quantization_config.quant_method``: "compressed-tensors" -> "compressed-tensors", "fp8" -> "fp8",
ModelOpt MXFP8 (``modelopt_mxfp8`` / ``mxfp8`` / ``quant_algo: MXFP8`` / ``hf_quant_config.json``) -> "modelopt";
else None (float). Priority: ModelSlim > compressed-tensors > fp8 > modelopt.

``get_quantization_config(method, model_dir, hf_config, profile_name)``: ``None``/"auto" detects; a user-given method
wins (warning when it differs from the detected one); "none" loads float; the 310p profile gets the 310P ModelSlim
config and the 310P scheme registry. GGUF files are never quantized this way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ascent.config import QUANTIZATION_METHODS
from ascent.quantization.base import QuantizationConfig
from ascent.quantization.configs.compressed_tensors import CompressedTensorsConfig, load_hf_quant_config
from ascent.quantization.configs.fp8 import Fp8Config
from ascent.quantization.configs.modelopt import ModelOptMxfp8Config, load_modelopt_config
from ascent.quantization.configs.modelslim import ModelSlimConfig, find_description_file
from ascent.quantization.configs.modelslim_310p import ModelSlimConfig310P
from ascent.quantization.registry import registry_for_profile

logger = logging.getLogger(__name__)

ALIASES = {"modelslim": "ascend", "mxfp8": "modelopt", "modelopt_mxfp8": "modelopt"}
CONFIG_CLASSES: dict[str, type[QuantizationConfig]] = {
    "ascend": ModelSlimConfig,
    "compressed-tensors": CompressedTensorsConfig,
    "fp8": Fp8Config,
    "modelopt": ModelOptMxfp8Config,
}


def canonical_method(method: str | None) -> str | None:
    """``None``/"auto" -> None; aliases folded ("modelslim" -> "ascend", "mxfp8" -> "modelopt"); ValueError for
    an unknown name, listing the valid ones."""
    if method is None or method == "auto":
        return None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is invalid: must be one of {QUANTIZATION_METHODS}.")
    return ALIASES.get(method, method)


def detect_quantization_method(model_dir: str | Path) -> str | None:
    """The quantization method a checkpoint directory declares (see the module docstring); None = float."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    if find_description_file(path, warn=False) is not None:
        return "ascend"
    qc = load_hf_quant_config(path) or {}
    method = qc.get("quant_method")
    if method in ("compressed-tensors", "fp8"):
        return method
    if load_modelopt_config(path) is not None:
        return "modelopt"
    return None


def _declared_but_unsupported(model_dir: Path, hf_config: Any) -> str | None:
    qc = load_hf_quant_config(model_dir, hf_config) if model_dir.is_dir() else None
    method = (qc or {}).get("quant_method")
    return str(method) if method else None


def get_quantization_config(method: str | None, model_dir: str | Path, hf_config: Any = None,
                            profile_name: str = "cpu") -> QuantizationConfig | None:
    """The parsed quantization config for ``model_dir`` (None = float model); see the module docstring."""
    requested = canonical_method(method)
    path = Path(model_dir)
    if requested == "none":
        return None
    if path.is_file() and path.suffix == ".gguf":
        if requested is not None:
            raise ValueError(f"quantization={method!r} does not apply to GGUF file {str(path)!r} "
                             f"(GGUF carries its own quantization); drop --quantization")
        return None
    detected = detect_quantization_method(path)
    if requested is None:
        requested = detected
        if requested is None:
            declared = _declared_but_unsupported(path, hf_config)
            if declared:
                raise ValueError(f"{str(path)!r} declares quant_method={declared!r}, which is not supported "
                                 f"(supported: ascend/modelslim, compressed-tensors, fp8, modelopt mxfp8)")
            return None
    elif detected is not None and detected != requested:
        logger.warning("--quantization %s overrides the detected method %s for %s", requested, detected, path)
    if requested == "ascend" and profile_name == "310p":
        config: QuantizationConfig = ModelSlimConfig310P.from_model_dir(str(path), hf_config)
        config.registry = registry_for_profile(profile_name)  # type: ignore[attr-defined]
        return config
    config = CONFIG_CLASSES[requested].from_model_dir(str(path), hf_config)
    config.registry = registry_for_profile(profile_name)  # type: ignore[attr-defined]
    return config
