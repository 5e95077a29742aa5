"""The float model a quantization export starts from: an HF directory or a GGUF file (the default SmolLM2).

GGUF weights are read through ascent's GGUF loader (dequantized, Q/K rows un-permuted, HF names), the config and the
tokenizer (with its chat template) come from the GGUF metadata, so the export directory is a complete HF model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ascent.default_model import DEFAULT_MODEL_NAME, is_gguf_path, resolve_model_path

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass
class FloatModel:
    """A float HF causal LM in eval mode with its tokenizer and generation config."""

    model: Any
    tokenizer: Any
    generation_config: Any
    source: str
    dtype: torch.dtype


def resolve_dtype(name: str | None, config: Any) -> torch.dtype:
    """``--dtype`` (``auto`` = the config's dtype, bfloat16 for GGUF sources without one) -> ``torch.dtype``."""
    if name in (None, "auto"):
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(value, str):
            value = _DTYPES.get(value)
        return value if value in _DTYPES.values() else torch.bfloat16
    key = _DTYPE_ALIASES.get(name, name)
    if key not in _DTYPES:
        raise ValueError(f"dtype={name!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


def _gguf_model(path: str, dtype_name: str | None) -> FloatModel:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from ascent.loader.gguf import gguf_to_hf_config, gguf_tokenizer, iterate_gguf_weights

    config = gguf_to_hf_config(path)
    dtype = resolve_dtype(dtype_name, config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dict(iterate_gguf_weights(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"GGUF {path!r} does not match {type(model).__name__}: missing={missing[:5]} "
                         f"unexpected={unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype).eval()
    model.config._name_or_path = os.path.splitext(os.path.basename(path))[0]
    tokenizer = gguf_tokenizer(path)
    eos = config.eos_token_id
    generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                                  pad_token_id=config.pad_token_id)
    return FloatModel(model, tokenizer, generation, path, dtype)


def _hf_model(path: str, dtype_name: str | None) -> FloatModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "quantization_config", None):
        raise ValueError(f"model {path!r} is already quantized (config.json has quantization_config)")
    dtype = resolve_dtype(dtype_name, config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    try:
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return FloatModel(model, tokenizer, generation, path, dtype)


def load_float_model(model: str | None, dtype: str | None = "auto") -> FloatModel:
    """Load ``model`` (None / ``"default"`` / the default name -> the bundled SmolLM2 GGUF; an HF directory; a
    ``.gguf`` file) as a float transformers model in ``dtype`` on CPU."""
    if model in (None, "default"):
        model = DEFAULT_MODEL_NAME
    path = resolve_model_path(model)
    if is_gguf_path(path):
        logger.info("loading float weights from GGUF %s", path)
        return _gguf_model(path, dtype)
    return _hf_model(path, dtype)
