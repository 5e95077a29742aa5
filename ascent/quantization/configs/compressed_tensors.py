"""compressed-tensors (LLM-Compressor) config: ``config.json`` ``quantization_config`` -> :class:`QuantSpec`.

``config_groups`` name ``targets`` (exact layer name, ``re:`` regex, or a class name: ``Linear`` also matches MoE
expert layers) with ``weights`` / ``input_activations`` QuantizationArgs and an optional per-group ``format``
overriding the global one; ``ignore`` lists names / ``re:`` regexes of unquantized layers. Names are checkpoint names:
an engine prefix such as ``model.layers.0.self_attn.qkv_proj`` is expanded to its shards (``q_proj``/``k_proj``/
``v_proj``, which must agree), a MoE layer ``<p>.experts`` is looked up as ``<p>.experts.0.gate_proj``.
Argument sets map onto ModelSlim type names (``args_to_quant_type``); unknown combinations raise NotImplementedError
naming the format and the arguments.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, ClassVar

from ascent.quantization.base import QuantizationConfig, QuantSpec
from ascent.quantization.configs.modelslim_mapping import (
    packed_modules_for,
    packed_modules_of_config,
    replace_last_component,
)
from ascent.quantization.registry import DEFAULT_REGISTRY, SchemeRegistry

logger = logging.getLogger(__name__)

FORMATS = ("int-quantized", "pack-quantized", "float-quantized", "naive-quantized", "mxfp4-pack-quantized",
           "mxfp8-quantized", "nvfp4-pack-quantized", "dense")
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
CLASS_TARGETS = {"linear": ("Linear",), "moe": ("Linear", "RoutedExperts", "FusedMoE"), "embedding": ("Embedding",)}


def load_hf_quant_config(model_dir: str | Path, hf_config: Any = None) -> dict[str, Any] | None:
    """``quantization_config`` from ``hf_config`` (attribute or dict) or ``<model_dir>/config.json``; None if absent."""
    qc = getattr(hf_config, "quantization_config", None) if hf_config is not None else None
    if qc is None and isinstance(hf_config, dict):
        qc = hf_config.get("quantization_config")
    if qc is None:
        path = Path(model_dir) / "config.json"
        if path.is_file():
            qc = json.loads(path.read_text()).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc


def _args(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Normalised QuantizationArgs (defaults of compressed-tensors) or None."""
    if raw is None:
        return None
    args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "group_size": None,
            "block_structure": None, "dynamic": False, **raw}
    if args["strategy"] not in STRATEGIES:
        raise ValueError(f"compressed-tensors strategy {args['strategy']!r} is not one of {STRATEGIES}")
    if args["strategy"] == "group" and not args["group_size"]:
        raise ValueError(f"compressed-tensors group strategy needs group_size > 0, got {args['group_size']!r}")
    return args


def _is_dynamic(args: dict[str, Any]) -> bool:
    return args["dynamic"] is True or args["dynamic"] == "local"


def args_to_quant_type(fmt: str, w: dict[str, Any], a: dict[str, Any] | None) -> str:
    """The ModelSlim-named quant type for a (format, weights, input_activations) combination."""
    wb, wt, ws = w["num_bits"], w["type"], w["strategy"]
    if fmt == "mxfp8-quantized" and a is not None and a["type"] == "float" and a["num_bits"] == 8:
        return "W8A8_MXFP8"
    if fmt == "mxfp4-pack-quantized":
        if a is None:
            return "W4A16_MXFP4"
        if a["type"] == "float" and a["num_bits"] in (4, 8):
            return "W4A4_MXFP4" if a["num_bits"] == 4 else "W4A8_MXFP"
    if fmt in ("int-quantized", "float-quantized", "naive-quantized") and a is not None:
        if not (w["symmetric"] and a["symmetric"]):  # no zero points in the activation-quantized kernels
            raise NotImplementedError(
                f"No compressed-tensors compatible quantization type for format={fmt!r}: asymmetric "
                f"{'weights' if not w['symmetric'] else 'input activations'} (zero points) are not supported with "
                f"quantized activations; weights={w}, input_activations={a}")
        a_token_dyn = a["strategy"] == "token" and _is_dynamic(a)
        if wt == "int" and wb == 8 and ws == "channel" and a["type"] == "int" and a["num_bits"] == 8:
            if a["strategy"] == "tensor" and not _is_dynamic(a):
                return "W8A8"
            if a_token_dyn:
                return "W8A8_DYNAMIC"
        if wt == "float" and wb == 8 and a["type"] == "float" and a["num_bits"] == 8:
            if ws == "block" and a["strategy"] == "group" and _is_dynamic(a):
                return "FP8_BLOCK"
            if ws in ("channel", "tensor") and a_token_dyn:
                return "W8A8FP8_DYNAMIC"
            if ws in ("channel", "tensor") and a["strategy"] == "tensor" and not _is_dynamic(a):
                return "W8A8FP8"  # llm-compressor's "FP8" preset: static per-tensor activations
        if wt == "int" and wb == 4 and ws in ("channel", "group") and a["type"] == "int" and a["num_bits"] == 8 \
                and a_token_dyn:
            return "W4A8_DYNAMIC"
    if a is None and wt == "int" and fmt in ("pack-quantized", "int-quantized", "naive-quantized"):
        if wb == 4 and ws in ("group", "channel"):
            return "W4A16"
        if wb == 8 and ws in ("group", "channel"):
            return "W8A16"
    if a is None and fmt == "float-quantized" and wt == "float" and wb == 8 and ws == "block":
        return "FP8_BLOCK"
    raise NotImplementedError(
        f"No compressed-tensors compatible quantization type for format={fmt!r}, weights={w}, "
        f"input_activations={a}")


def args_to_spec(fmt: str, w: dict[str, Any], a: dict[str, Any] | None, layer_type: str) -> QuantSpec:
    """A :class:`QuantSpec` (``source_format="compressed-tensors"``) for one matched config group."""
    quant_type = args_to_quant_type(fmt, w, a)
    block = tuple(w["block_structure"]) if w.get("block_structure") else None
    fields: dict[str, Any] = dict(
        weight_bits=w["num_bits"], weight_type=w["type"], weight_strategy=w["strategy"],
        group_size=w["group_size"] if w["strategy"] == "group" else None, block_structure=block,
        weight_symmetric=bool(w["symmetric"]))
    if a is not None:
        fields.update(act_bits=a["num_bits"], act_type=a["type"], act_strategy=a["strategy"],
                      act_dynamic=_is_dynamic(a), act_symmetric=bool(a["symmetric"]), act_group_size=a["group_size"])
    actorder = w.get("actorder")
    if actorder in ("group", "dynamic") and quant_type not in ("W4A16", "W8A16"):
        raise NotImplementedError(f"compressed-tensors actorder={actorder!r} (weight_g_idx) is supported for "
                                  f"weight-only W4A16 / W8A16 only, not {quant_type}")
    return QuantSpec(quant_type=quant_type, layer_type=layer_type, source_format="compressed-tensors",
                     extra={"format": fmt, "actorder": actorder}, **fields)


def _match_rank(name: str, target: str, class_names: tuple[str, ...]) -> int | None:
    """0 exact name, 1 regex, 2 class name; None when ``target`` does not select ``name``."""
    if target == name:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    return 2 if target in class_names else None


class CompressedTensorsConfig(QuantizationConfig):
    """Parsed ``quantization_config`` with ``quant_method == "compressed-tensors"``."""

    name: ClassVar[str] = "compressed-tensors"

    def __init__(self, quant_config: dict[str, Any], packed_modules: dict[str, list[str]] | None = None,
                 registry: SchemeRegistry | None = None) -> None:
        self.raw = quant_config
        self.format = quant_config.get("format") or "dense"
        self.ignore: list[str] = list(quant_config.get("ignore") or [])
        self.groups: list[tuple[list[str], str, dict[str, Any], dict[str, Any] | None]] = []
        for name, group in (quant_config.get("config_groups") or {}).items():
            fmt = group.get("format") or self.format
            if fmt not in FORMATS:
                raise NotImplementedError(f"compressed-tensors format {fmt!r} (group {name!r}) is not supported "
                                          f"(known: {', '.join(FORMATS)})")
            weights = _args(group.get("weights"))
            if weights is None:
                raise NotImplementedError(f"compressed-tensors group {name!r} has no weight quantization")
            self.groups.append((list(group.get("targets") or []), fmt, weights, _args(group.get("input_activations"))))
        self.kv_cache_scheme = _args(quant_config.get("kv_cache_scheme"))
        if self.kv_cache_scheme is not None:  # the attention layers do not take a quantized KV cache (yet)
            logger.warning("compressed-tensors kv_cache_scheme %s is not applied: the KV cache stays in the model "
                           "dtype and the checkpoint's k_scale / v_scale are not used", quant_config["kv_cache_scheme"])
        self.packed_modules = packed_modules if packed_modules is not None else packed_modules_for(None)
        self.registry = registry or DEFAULT_REGISTRY

    @classmethod
    def from_model_dir(cls, model_dir: str, hf_config: Any) -> "CompressedTensorsConfig":
        qc = load_hf_quant_config(model_dir, hf_config)
        if not qc or qc.get("quant_method") != "compressed-tensors":
            raise ValueError(f"{model_dir!r}: config.json has no compressed-tensors quantization_config")
        return cls(qc, packed_modules_of_config(hf_config))

    def checkpoint_names(self, prefix: str, layer_type: str) -> list[str]:
        """Checkpoint module names of an engine layer (shards of fused layers; expert 0 of a MoE layer)."""
        proj = prefix.split(".")[-1]
        if layer_type == "moe":
            return [prefix + ".0.gate_proj"] if proj == "experts" else [prefix]
        shards = self.packed_modules.get(proj)
        if not shards or proj == "experts":
            return [prefix]
        return [replace_last_component(prefix, shard) for shard in shards]

    def _ignored(self, name: str) -> bool:
        return any(_match_rank(name, t, ()) is not None for t in self.ignore)

    def _group_for(self, name: str, layer_type: str, prefix: str) -> int | None:
        classes = CLASS_TARGETS.get(layer_type, ())
        if layer_type == "embedding" and prefix.split(".")[-1] == "lm_head":
            classes = ("Linear",)
        best: tuple[int, int] | None = None
        for index, (targets, _, _, _) in enumerate(self.groups):
            ranks = [r for r in (_match_rank(name, t, classes) for t in targets) if r is not None]
            if ranks and (best is None or min(ranks) < best[0]):
                best = (min(ranks), index)
        return None if best is None else best[1]

    def _agree(self, prefix: str, values: list[Any], what: str) -> Any:
        if any(v != values[0] for v in values):
            raise ValueError(f"all shards of fused layer {prefix!r} must have the same {what}, got {values}")
        return values[0]

    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        if layer_type == "attention":
            return self._kv_spec()
        names = self.checkpoint_names(prefix, layer_type)
        if self._agree(prefix, [self._ignored(n) for n in names], "ignore status"):
            return None
        group = self._agree(prefix, [self._group_for(n, layer_type, prefix) for n in names], "config group")
        if group is None:
            return None
        _, fmt, weights, acts = self.groups[group]
        return args_to_spec(fmt, weights, acts, layer_type)

    def _kv_spec(self) -> QuantSpec | None:
        kv = self.kv_cache_scheme
        if kv is None:
            return None
        quant_type = "C8" if kv["type"] == "int" and kv["num_bits"] == 8 else f"KV_{kv['type'].upper()}{kv['num_bits']}"
        return QuantSpec(quant_type=quant_type, layer_type="attention", source_format="compressed-tensors",
                         weight_bits=kv["num_bits"], weight_type=kv["type"], weight_strategy=kv["strategy"],
                         weight_symmetric=bool(kv["symmetric"]), extra={"kv_cache_scheme": dict(kv)})
