"""ModelSlim quant type strings -> format-independent :class:`QuantSpec` (weights / activations per spec §2).

Every string maps to a spec (unknown ones too, with default fields) so the scheme registry is the single place
that says "unsupported" (NotImplementedError naming ``quant_type`` and ``layer_type``).
"""

from __future__ import annotations

from typing import Any

from ascent.quantization.base import QuantSpec

DEFAULT_GROUP_SIZE = 32  # W4A16 / MXFP types when the description has no "group_size"
MX_BLOCK = 32

_STATIC_A8 = dict(act_bits=8, act_type="int", act_strategy="tensor", act_dynamic=False, act_symmetric=False)
_TOKEN_A8 = dict(act_bits=8, act_type="int", act_strategy="token", act_dynamic=True, act_symmetric=True)
_TOKEN_A4 = dict(act_bits=4, act_type="int", act_strategy="token", act_dynamic=True, act_symmetric=True)
_MX_A8 = dict(act_bits=8, act_type="float", act_strategy="group", act_dynamic=True, act_group_size=MX_BLOCK)
_MX_A4 = dict(act_bits=4, act_type="float", act_strategy="group", act_dynamic=True, act_group_size=MX_BLOCK)


def _group(meta: dict[str, Any]) -> int:
    size = meta.get("group_size")
    return int(size) if size else DEFAULT_GROUP_SIZE


def _w8a16(meta: dict[str, Any]) -> dict[str, Any]:
    size = meta.get("group_size")
    if size and int(size) > 0:
        return dict(weight_strategy="group", group_size=int(size))
    return dict(weight_strategy="channel")


def _fields(quant_type: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Weight/activation keyword fields of ``QuantSpec`` for one ModelSlim type ({} = defaults)."""
    mx_w4 = dict(weight_bits=4, weight_type="float", weight_strategy="group", group_size=_group(meta))
    table: dict[str, dict[str, Any]] = {
        "W8A8": dict(_STATIC_A8),
        "W8A8S": dict(_STATIC_A8),
        "W8A8SC": dict(_STATIC_A8),
        "W8A8_MIX": dict(_STATIC_A8, extra={"mix": True}),
        "W8A8_DYNAMIC": dict(_TOKEN_A8),
        "W8A16": _w8a16(meta),
        "W4A16": dict(weight_bits=4, weight_strategy="group", group_size=_group(meta)),
        "W4A8_DYNAMIC": dict(_TOKEN_A8, weight_bits=4, extra={"packed_along": "output"}),
        "W4A4_DYNAMIC": dict(_TOKEN_A4, weight_bits=4),
        "W4A4_FLATQUANT_DYNAMIC": dict(_TOKEN_A4, weight_bits=4, extra={"transform": "flatquant"}),
        "W8A8FP8_DYNAMIC": dict(act_bits=8, act_type="float", act_strategy="token", act_dynamic=True,
                                weight_type="float"),
        "W8A8_MXFP8": dict(_MX_A8, weight_type="float", weight_strategy="group", group_size=MX_BLOCK),
        "W4A4_MXFP4": dict(_MX_A4, **mx_w4),
        "W4A4_MXFP4_FLATQUANT": dict(_MX_A4, **mx_w4, extra={
            "transform": "flatquant", "max_supported_tp": int(meta.get("max_supported_tp") or 4)}),
        "W4A8_MXFP": dict(_MX_A8, **mx_w4),
        "W4A16_MXFP4": dict(mx_w4),
    }
    return table.get(quant_type, {})


def modelslim_spec(quant_type: str, layer_type: str, meta: dict[str, Any]) -> QuantSpec:
    """The spec of one ModelSlim layer type; ``meta`` holds the description's non-tensor keys (``group_size``...)."""
    fields = _fields(quant_type, meta)
    extra = dict(fields.pop("extra", {}))
    if meta.get("version") is not None:
        extra.setdefault("version", meta["version"])
    return QuantSpec(quant_type=quant_type, layer_type=layer_type, source_format="modelslim", extra=extra, **fields)


def attention_spec(quant_type: str, meta: dict[str, Any]) -> QuantSpec:
    """KV-cache / attention quant (``C8``: int8 K/V with static per-channel scales and offsets; FA / indexer)."""
    int8_kv = quant_type in ("C8", "INT8", "INT8_DYNAMIC")
    return QuantSpec(quant_type=quant_type, layer_type="attention", source_format="modelslim",
                     weight_bits=8, weight_type="int" if int8_kv else "float", weight_strategy="channel",
                     weight_symmetric=False, extra={"kv_cache_type": meta.get("kv_cache_type")})
