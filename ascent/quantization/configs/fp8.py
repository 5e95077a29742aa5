"""Native HF FP8 config (``quant_method: "fp8"``): float8_e4m3fn weights with ``weight_scale_inv``.

``weight_block_size: [bn, bk]`` -> ``FP8_BLOCK`` (128x128 block scales, dynamic per-token-group activations);
no block size -> ``W8A8FP8_DYNAMIC`` with a per-tensor weight scale and dynamic per-token activations, or
``W8A8FP8`` (static per-tensor ``input_scale``) with ``activation_scheme: static``.
``ignored_layers`` / ``modules_to_not_convert`` name unquantized modules (component-anchored; fused engine layers
are unquantized when all their shards are listed, a partial listing is a ValueError).
"""

from __future__ import annotations

from typing import Any, ClassVar

from ascent.quantization.base import QuantizationConfig, QuantSpec
from ascent.quantization.configs.compressed_tensors import load_hf_quant_config
from ascent.quantization.configs.modelslim_mapping import (
    packed_modules_for,
    packed_modules_of_config,
    replace_last_component,
)
from ascent.quantization.registry import DEFAULT_REGISTRY, SchemeRegistry

ACTIVATION_SCHEMES = ("dynamic", "static")


def validate_block_size(value: Any) -> tuple[int, int] | None:
    """``[bn, bk]`` of positive ints (or None); ValueError naming a bad value."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"weight_block_size={value!r} is invalid: must be two positive integers [rows, cols]")
    return int(value[0]), int(value[1])


def name_listed(name: str, entries: list[str]) -> bool:
    """``name`` equals an entry, lies under it (``entry.``), or ends with ``.entry`` (e.g. ``lm_head``)."""
    return any(name == e or name.startswith(e + ".") or name.endswith("." + e) for e in entries)


def expand_fused(prefix: str, packed_modules: dict[str, list[str]], layer_type: str) -> list[str]:
    """Checkpoint module names of an engine layer: fused shards, or expert 0 of a MoE layer."""
    proj = prefix.split(".")[-1]
    if layer_type == "moe":
        return [prefix + ".0.gate_proj", prefix + ".0.up_proj", prefix + ".0.down_proj"]
    shards = packed_modules.get(proj)
    if not shards or proj == "experts":
        return [prefix]
    return [replace_last_component(prefix, s) for s in shards]


def all_or_none(prefix: str, flags: list[bool]) -> bool:
    if any(flags) and not all(flags):
        raise ValueError(f"some but not all shards of fused layer {prefix!r} are excluded from quantization")
    return bool(flags) and all(flags)


class Fp8Config(QuantizationConfig):
    """Parsed ``{"quant_method": "fp8", "activation_scheme": ..., "weight_block_size": [128, 128]}``."""

    name: ClassVar[str] = "fp8"

    def __init__(self, quant_config: dict[str, Any], packed_modules: dict[str, list[str]] | None = None,
                 registry: SchemeRegistry | None = None) -> None:
        self.block_size = validate_block_size(quant_config.get("weight_block_size"))
        self.activation_scheme = quant_config.get("activation_scheme", "dynamic")
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation_scheme={self.activation_scheme!r} is invalid: must be one of "
                             f"{ACTIVATION_SCHEMES}")
        fmt = quant_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fmt={fmt!r} is invalid: only e4m3 FP8 checkpoints are supported")
        self.ignored = list(quant_config.get("ignored_layers") or []) + list(
            quant_config.get("modules_to_not_convert") or [])
        self.packed_modules = packed_modules if packed_modules is not None else packed_modules_for(None)
        self.registry = registry or DEFAULT_REGISTRY

    @classmethod
    def from_model_dir(cls, model_dir: str, hf_config: Any) -> "Fp8Config":
        qc = load_hf_quant_config(model_dir, hf_config)
        if not qc or qc.get("quant_method") != "fp8":
            raise ValueError(f"{model_dir!r}: config.json has no fp8 quantization_config")
        return cls(qc, packed_modules_of_config(hf_config))

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        if layer_type in ("attention", "embedding"):
            return None
        names = expand_fused(prefix, self.packed_modules, layer_type)
        if all_or_none(prefix, [name_listed(n, self.ignored) for n in names]):
            return None
        dynamic = self.activation_scheme == "dynamic"
        if self.block_size is not None:
            if not dynamic:
                raise NotImplementedError("fp8 weight_block_size with activation_scheme='static' is not supported")
            return QuantSpec(quant_type="FP8_BLOCK", layer_type=layer_type, source_format="fp8", weight_bits=8,
                             weight_type="float", weight_strategy="block", block_structure=self.block_size,
                             act_bits=8, act_type="float", act_strategy="group", act_dynamic=True,
                             act_group_size=self.block_size[1])
        if not dynamic:  # per-tensor input_scale in the checkpoint
            return QuantSpec(quant_type="W8A8FP8", layer_type=layer_type, source_format="fp8", weight_bits=8,
                             weight_type="float", weight_strategy="tensor", act_bits=8, act_type="float",
                             act_strategy="tensor", act_dynamic=False)
        return QuantSpec(quant_type="W8A8FP8_DYNAMIC", layer_type=layer_type, source_format="fp8", weight_bits=8,
                         weight_type="float", weight_strategy="tensor", act_bits=8, act_type="float",
                         act_strategy="token", act_dynamic=True)
