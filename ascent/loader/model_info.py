"""Model metadata: HF config, EOS ids, generation defaults, dtype and max model length resolution.

Works on a local HF-format directory or a ``.gguf`` file (see ``ascent.default_model.resolve_model_path``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from ascent.default_model import is_gguf_path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys that become default sampling parameters (vLLM's list).
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# Rope types whose ``factor`` does not extend the usable context beyond max_position_embeddings (vLLM's rule).
_ROPE_TYPES_NOT_EXTENDING = ("default", "llama3", "longrope", "su", "mrope")
_FALLBACK_MAX_LEN = 2048


def load_hf_config(model_path: str) -> Any:
    """``transformers.PretrainedConfig`` for a local directory (``config.json``, no hub access) or a ``.gguf`` file.

    Raises ValueError when the path is neither, the config cannot be read, or it names no ``architectures``.
    """
    if is_gguf_path(model_path):
        from ascent.loader.gguf import gguf_to_hf_config

        config = gguf_to_hf_config(model_path)
    elif os.path.isdir(model_path):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read the model config in {model_path!r}: {exc}") from exc
    else:
        raise ValueError(f"model path {model_path!r} is neither a directory nor a .gguf file")
    if not getattr(config, "architectures", None):
        raise ValueError(f"model config in {model_path!r} has no 'architectures' entry")
    return config


def _text_config(hf_config: Any) -> Any:
    get_text_config = getattr(hf_config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else hf_config


def read_generation_config(model_path: str, source: str = "auto") -> dict[str, Any]:
    """Contents of ``generation_config.json``; ``source`` is vLLM's ``--generation-config``: "auto" (the model
    directory's; empty for GGUF files or when absent), "vllm" (none: empty) or a directory holding one (ValueError
    when it does not)."""
    if source == "vllm":
        return {}
    if source != "auto":
        if not os.path.isfile(os.path.join(source, GENERATION_CONFIG_FILE)):
            raise ValueError(f"generation_config={source!r} is not a directory with a {GENERATION_CONFIG_FILE}")
        model_path = source
    if not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} does not hold a JSON object")
    return data


def _as_ids(value: Any, source: str) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, (list, tuple, set)) else [value]
    ids = set()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"eos_token_id {v!r} from {source} is not a non-negative integer")
        ids.add(int(v))
    return ids


def get_eos_token_ids(model_path: str, tokenizer: Any, hf_config: Any | None = None,
                      generation_config: str = "auto") -> set[int]:
    """Stop-token set: tokenizer EOS ∪ every ``generation_config.json`` ``eos_token_id`` ∪ the config's EOS.

    For a GGUF file the config EOS is the metadata ``tokenizer.ggml.eos_token_id``. ``hf_config`` avoids re-reading
    the config when the caller already has it; ``generation_config`` as in :func:`read_generation_config`.
    """
    ids = _as_ids(getattr(tokenizer, "eos_token_id", None), "the tokenizer")
    ids |= _as_ids(read_generation_config(model_path, generation_config).get("eos_token_id"), GENERATION_CONFIG_FILE)
    config = hf_config if hf_config is not None else load_hf_config(model_path)
    ids |= _as_ids(getattr(_text_config(config), "eos_token_id", None), "the model config")
    return ids


def get_generation_defaults(model_path: str, generation_config: str = "auto",
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Default sampling values from ``generation_config.json`` (keys of ``GENERATION_DEFAULT_KEYS`` that are set),
    updated with ``overrides`` (vLLM's ``--override-generation-config``).

    Keys keep the HF names (``max_new_tokens`` is vLLM's ``max_tokens``). Empty for GGUF files.
    """
    config = {**read_generation_config(model_path, generation_config), **(overrides or {})}
    return {key: config[key] for key in GENERATION_DEFAULT_KEYS if config.get(key) is not None}


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    for config in (_text_config(hf_config), hf_config):
        value = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def get_model_dtype(hf_config: Any, requested: str | torch.dtype, device_type: str) -> torch.dtype:
    """Resolve ``--dtype`` to a torch dtype.

    Accepted: auto, float32/float/fp32, float16/half/fp16, bfloat16/bf16 (or one of those torch dtypes). ``auto`` uses
    the config's dtype when it is float16/bfloat16, except float16 -> bfloat16 on CPU (CPU fp16 GEMMs are slow);
    float32 checkpoints are served in bfloat16 (vLLM's "downcast for float32 models": half the bytes per step);
    GGUF or unknown config dtypes give bfloat16. Invalid values raise ValueError naming them.
    """
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f"device_type must be a non-empty string, got {device_type!r}")
    if isinstance(requested, torch.dtype):
        if requested not in _FLOAT_DTYPES:
            raise ValueError(f"dtype {requested!r} is not supported (use float32, float16 or bfloat16)")
        return requested
    if not isinstance(requested, str):
        raise ValueError(f"dtype {requested!r} is not supported (use auto or one of {sorted(_DTYPES)})")
    name = requested.strip().lower()
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"dtype {requested!r} is not supported (use auto or one of {sorted(_DTYPES)})")
    config_dtype = _config_dtype(hf_config)
    if config_dtype not in _FLOAT_DTYPES or config_dtype == torch.float32:
        return torch.bfloat16
    if config_dtype == torch.float16 and device_type == "cpu":
        return torch.bfloat16
    return config_dtype


def _rope_dicts(config: Any) -> list[dict[str, Any]]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        return list(rope.values())  # per-layer-type parameters
    top_level_original = getattr(config, "original_max_position_embeddings", None)
    if isinstance(top_level_original, int):  # wins over the dict's, as in rope_parameters_from_config
        rope = {**rope, "original_max_position_embeddings": top_level_original}
    return [rope]


def _rope_extended_len(config: Any, base_len: int) -> int:
    extended = base_len
    for rope in _rope_dicts(config):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if factor is None or rope_type in _ROPE_TYPES_NOT_EXTENDING:
            continue
        start = rope.get("original_max_position_embeddings", base_len) if rope_type == "yarn" else base_len
        extended = max(extended, int(start * float(factor)))
    return extended


def model_max_len(hf_config: Any) -> int:
    """Longest sequence the model supports: the smallest declared length key, extended by rope scaling."""
    config = _text_config(hf_config)
    lengths = [v for key in _MAX_LEN_KEYS if isinstance(v := getattr(config, key, None), int) and v > 0]
    if not lengths:
        logger.warning("model config declares no maximum length; assuming %d", _FALLBACK_MAX_LEN)
        return _FALLBACK_MAX_LEN
    return _rope_extended_len(config, min(lengths))


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    """``--max-model-len``: the model's limit when ``requested`` is None, else ``requested`` after validation.

    The limit is the smallest of the config's length keys (``max_position_embeddings`` ...), extended by the rope
    scaling factor (from ``original_max_position_embeddings`` for yarn) as vLLM does. ``requested`` above the limit
    or below 1 raises ValueError naming it.
    """
    limit = model_max_len(hf_config)
    if requested is None:
        return limit
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's maximum length {limit}")
    return requested
