"""ModelSlim (msModelSlim) config: ``quant_model_description.json`` -> a :class:`QuantSpec` per layer.

The description maps checkpoint tensor names to quant type strings (``FLOAT`` = unquantized) plus a few global keys
(``model_quant_type``, ``version``, ``group_size``, ``kv_cache_type``, ``fa_quant_type``, ``indexer_quant_type``,
``max_supported_tp``). Resolution of one engine layer prefix (spec §1.1):

* fused layers (last component in the model_type's packed mapping, e.g. ``qkv_proj``) look up every shard's
  ``<shard>.weight``; all FLOAT -> unquantized, some FLOAT -> ValueError "Detected some but not all shards", different
  types -> ValueError "Not all shards of ... are quantized with same quant type"; a missing shard -> KeyError, except
  Gemma4's k_eq_v ``v_proj`` (tolerated when ``q_proj`` and ``k_proj`` exist);
* MoE layers (``experts``) use expert 0: ``experts.0.{gate,up,down}_proj.weight``;
* plain layers: ``<prefix>.weight``; FLOAT when any key under ``<prefix>.`` (component-anchored) ending in
  ``.weight`` is FLOAT;
* a missing key: non-quantizable kinds (embeddings, lm_head, vision towers) load unquantized with a warning; a
  missing linear is a KeyError naming the key and the fix.
Anti-outlier recipes: a key containing ``norm.bias`` gives every RMSNorm a zero-initialised bias (``prepare_model``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from ascent.quantization.base import QuantizationConfig, QuantSpec
from ascent.quantization.configs.modelslim_mapping import (
    augment_description,
    first_layer_id,
    is_vision_prefix,
    lookup_candidates,
    packed_modules_for,
    packed_modules_of_config,
    replace_last_component,
)
from ascent.quantization.configs.modelslim_specs import attention_spec, modelslim_spec
from ascent.quantization.registry import DEFAULT_REGISTRY, SchemeRegistry

logger = logging.getLogger(__name__)

DESCRIPTION_FILE = "quant_model_description.json"
FLOAT = "FLOAT"
META_KEYS = ("model_quant_type", "version", "group_size", "kv_cache_type", "fa_quant_type", "indexer_quant_type",
             "max_supported_tp", "model_type")


def find_description_file(model_dir: str | Path, warn: bool = True) -> Path | None:
    """``quant_model_description.json``; else the single ``quant_model_description*.json`` (msmodelslim's default
    name, e.g. ``..._w8a8.json``) with a warning; None when there is none. Several candidates -> ValueError."""
    path = Path(model_dir)
    if not path.is_dir():
        return None
    exact = path / DESCRIPTION_FILE
    if exact.is_file():
        return exact
    candidates = sorted(path.glob("quant_model_description*.json"))
    if len(candidates) > 1:
        raise ValueError(f"{len(candidates)} ModelSlim descriptions in {str(path)!r} "
                         f"({', '.join(c.name for c in candidates)}): rename the one to use to {DESCRIPTION_FILE}")
    if candidates and warn:
        logger.warning("using ModelSlim description %s (expected name %s)", candidates[0].name, DESCRIPTION_FILE)
    return candidates[0] if candidates else None


def description_not_found(model_dir: str | Path) -> ValueError:
    """The boxed error for ``--quantization ascend`` without a description, listing the directory's JSON files."""
    path = Path(model_dir)
    files = sorted(p.name for p in path.glob("*.json")) if path.is_dir() else []
    bar = "=" * 72
    return ValueError(
        f"\n{bar}\nModelSlim Quantization Config Not Found\n{bar}\n"
        f"--quantization ascend needs {DESCRIPTION_FILE} (msmodelslim writes quant_model_description_<type>.json) "
        f"in {str(path)!r}.\nJSON files found there: {files or 'none'}\n{bar}")


class ModelSlimConfig(QuantizationConfig):
    """Parsed ModelSlim description; ``get_spec(prefix, layer_type)`` resolves one engine layer."""

    name: ClassVar[str] = "ascend"

    def __init__(self, description: dict[str, Any], model_type: str | None = None,
                 packed_modules: dict[str, list[str]] | None = None, source: str = DESCRIPTION_FILE,
                 registry: SchemeRegistry | None = None) -> None:
        self.source = source
        self.model_type = model_type
        self.meta = {k: description[k] for k in META_KEYS if k in description}
        self.description: dict[str, Any] = augment_description(description, model_type)
        self.packed_modules = packed_modules if packed_modules is not None else packed_modules_for(model_type)
        self.registry = registry or DEFAULT_REGISTRY
        self.norm_bias = any("norm.bias" in k for k in self.description)
        self.kv_cache_layers = self._layer_ids("k_proj.kv_cache_scale")
        self.fa_layers = self._layer_ids("fa_k.scale")
        self.indexer_layers = self._layer_ids("indexer.quant_type") | self._layer_ids("indexer.q_rot")

    @classmethod
    def from_model_dir(cls, model_dir: str, hf_config: Any) -> "ModelSlimConfig":
        path = find_description_file(model_dir)
        if path is None:
            raise description_not_found(model_dir)
        try:
            description = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"ModelSlim description {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(description, dict):
            raise ValueError(f"ModelSlim description {str(path)!r} must be a JSON object")
        model_type = getattr(hf_config, "model_type", None) if hf_config is not None else None
        packed = packed_modules_of_config(hf_config)
        return cls(description, model_type, packed, source=str(path))

    # -------------------------------------------------------------------------------------------- lookups
    def _layer_ids(self, marker: str) -> set[int]:
        ids = {first_layer_id(k) for k in self.description if marker in k}
        return {i for i in ids if i is not None}

    def _lookup(self, key: str) -> str | None:
        for cand in lookup_candidates(self.model_type, key):
            value = self.description.get(cand)
            if isinstance(value, str):
                return value
        return None

    def _missing(self, key: str, prefix: str, layer_type: str) -> str:
        if layer_type == "embedding" or prefix.split(".")[-1] == "lm_head" or is_vision_prefix(prefix):
            logger.warning("%s has no entry %r; loading %s unquantized", self.source, key, prefix)
            return FLOAT
        raise KeyError(
            f"{key!r} is not in the ModelSlim description {self.source}: every quantized linear layer needs an "
            f"entry. If {prefix!r} is not quantized, add \"{key}\": \"FLOAT\" to the description; if the checkpoint "
            f"names it differently, check the name mapping of model_type {self.model_type!r}.")

    def _shard_keys(self, prefix: str) -> list[str] | None:
        proj = prefix.split(".")[-1]
        shards = self.packed_modules.get(proj)
        if not shards:
            return None
        return [replace_last_component(prefix, shard) + ".weight" for shard in shards]

    def _gemma4_kv_shared(self, key: str) -> bool:
        if not (self.model_type or "").startswith("gemma4") or not key.endswith("v_proj.weight"):
            return False
        base = key[: -len("v_proj.weight")]
        return self._lookup(base + "q_proj.weight") is not None and self._lookup(base + "k_proj.weight") is not None

    def _fused_type(self, prefix: str, keys: list[str], layer_type: str) -> str:
        types: dict[str, str] = {}
        for key in keys:
            value = self._lookup(key)
            if value is None:
                if self._gemma4_kv_shared(key):
                    continue
                value = self._missing(key, prefix, layer_type)
            types[key] = value
        distinct = set(types.values())
        if FLOAT in distinct and len(distinct) > 1:
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized ({types}). All shards of "
                             f"a fused layer must have the same precision.")
        if len(distinct) > 1:
            raise ValueError(f"Not all shards of {prefix} are quantized with same quant type: {types}. "
                             f"Please check the quantization description.")
        return distinct.pop()

    def _any_float_under(self, prefix: str) -> bool:
        anchor = prefix + "."
        return any(k.startswith(anchor) and k.endswith(".weight") and v == FLOAT
                   for k, v in self.description.items())

    def quant_type_of(self, prefix: str, layer_type: str = "linear") -> str:
        """The description's type string for the engine layer ``prefix`` (``FLOAT`` when unquantized)."""
        keys = self._shard_keys(prefix)
        if keys is not None:
            return self._fused_type(prefix, keys, layer_type)
        key = prefix + ".weight"
        value = self._lookup(key)
        if value is None:
            return FLOAT if self._any_float_under(prefix) else self._missing(key, prefix, layer_type)
        if value != FLOAT and self._any_float_under(prefix):
            return FLOAT
        return value

    # ---------------------------------------------------------------------------------------- interface
    def attention_quant_type(self, prefix: str) -> str | None:
        """Per-layer ``indexer.quant_type``, else ``fa_quant_type`` / ``kv_cache_type`` (C8) / ``indexer_quant_type``
        for layers that carry the matching tensors (layer id = first ``layers.<n>`` of the key)."""
        parent = prefix.rpartition(".")[0]
        for base in (prefix, parent):
            value = self.description.get(f"{base}.indexer.quant_type") if base else None
            if isinstance(value, str) and value != FLOAT:
                return value
        layer = first_layer_id(prefix)
        if self.meta.get("fa_quant_type") and layer in self.fa_layers:
            return str(self.meta["fa_quant_type"])
        if self.meta.get("kv_cache_type") == "C8" and layer in self.kv_cache_layers:
            return "C8"
        if self.meta.get("indexer_quant_type") and layer in self.indexer_layers:
            return str(self.meta["indexer_quant_type"])
        return None

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        if layer_type == "attention":
            quant_type = self.attention_quant_type(prefix)
            return attention_spec(quant_type, self.meta) if quant_type else None
        quant_type = self.quant_type_of(prefix, layer_type)
        if quant_type == FLOAT:
            return None
        return modelslim_spec(quant_type, layer_type, self.meta)

    def prepare_model(self, model: nn.Module) -> None:
        """Anti-outlier checkpoints: give every RMSNorm a zero-initialised, optional ``bias`` (see module doc)."""
        if not self.norm_bias:
            return
        from ascent.layers.norm import RMSNorm

        for name, module in model.named_modules():
            if not isinstance(module, RMSNorm):
                continue
            if type(module).forward is not RMSNorm.forward:
                logger.warning("%s (%s) has its own forward; anti-outlier norm bias not applied", name,
                               type(module).__name__)
                continue
            module.enable_bias()
