"""Name mapping between engine layer prefixes and checkpoint / ModelSlim description keys.

* ``PACKED_MODULES_BY_MODEL_TYPE``: per HF ``model_type``, fused engine module name -> checkpoint shard names
  (``qkv_proj -> q_proj, k_proj, v_proj``; ``experts -> experts.0.gate_proj, ...``: expert 0 decides a MoE layer).
* Renames are anchored on dotted path components (``rename_components``), never plain substring replacement, so
  ``gate_up_proj`` can never become ``gate_gate_up_proj`` and ``mlp.gate`` never matches ``mlp.gate_proj``.
* ``lookup_candidates(model_type, key)``: the keys to try, in order, for one engine-derived key (model-specific
  aliases such as step3p5's ``language_model.model.layers`` or the ``language_model.lm_head`` alias).
* ``augment_description(desc, model_type)``: description-side aliases added once at load (DeepSeek-V4 native names,
  ``shared_head`` renames, ``weight_packed`` -> ``weight``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DENSE = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
EXPERTS = {"experts": ["experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj"]}
EXPERTS_W123 = {"experts": ["experts.0.w1", "experts.0.w2", "experts.0.w3"]}
MLA = {**DENSE, **EXPERTS, "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
QWEN3_5 = {**DENSE, "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}

PACKED_MODULES_BY_MODEL_TYPE: dict[str, dict[str, list[str]]] = {
    **{t: DENSE for t in ("llama", "mistral", "qwen2", "qwen3", "qwen2_5_vl", "qwen3_vl")},
    **{t: {**DENSE, **EXPERTS} for t in (
        "qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "glm4_moe", "glm4v_moe", "glm4v_moe_text", "gemma4", "gemma4_text",
        "step3p5", "step3p5_mtp")},
    "qwen3_omni_moe": {**DENSE, **EXPERTS, "attn_qkv_proj": ["attn_q_proj", "attn_k_proj", "attn_v_proj"]},
    "qwen2_5_omni": {**DENSE, "qkv": ["q", "k", "v"]},
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": {**QWEN3_5, **EXPERTS},
    "qwen3_next": {**DENSE, **EXPERTS, "in_proj": ["in_proj_qkvz", "in_proj_ba"]},
    **{t: MLA for t in (
        "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "pangu_ultra_moe", "pangu_ultra_moe_mtp",
        "glm_moe_dsa", "glm4_moe_lite", "longcat_flash")},
    "deepseek_v4": {"gate_up_proj": ["gate_proj", "up_proj"], **EXPERTS},
    "deepseek_mtp": {"gate_up_proj": ["gate_proj", "up_proj"], **EXPERTS},
    "minimax_m2": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], **EXPERTS_W123},
    "minimax_m3": {**DENSE, **EXPERTS_W123},
    "minimax_m3_vl": {**DENSE, **EXPERTS_W123},
    "bailing_hybrid": {**MLA, "o_proj": ["dense"]},
}
DEFAULT_PACKED_MODULES = {**DENSE, **EXPERTS}

# Engine-prefix component renames tried (in order) when the plain key is missing, per model_type.
PREFIX_RENAMES: dict[str, list[tuple[str, str]]] = {
    "step3p5_mtp": [("mtp_block", "")],
    "gemma4": [("moe.experts", "experts")],
    "gemma4_text": [("moe.experts", "experts")],
    "minimax": [("mlp", "block_sparse_moe")],
    "minimax_m2": [("mlp", "block_sparse_moe")],
    "bailing_hybrid": [("linear_attn", "attention"), ("self_attn", "attention")],
}
# Leading-prefix aliases tried when a key misses (step3p5 keeps its text model under language_model).
LEADING_ALIASES: dict[str, list[tuple[str, str]]] = {
    "step3p5": [("model.layers", "language_model.model.layers")],
    "step3p5_mtp": [("model.layers", "language_model.model.layers")],
}
# DeepSeek-V4 native checkpoint naming -> engine naming (applied to description keys).
DSV4_LEADING = [("layers", "model.layers"), ("embed", "model.embed_tokens"), ("head", "lm_head")]
DSV4_COMPONENTS = [("attn", "self_attn"), ("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"),
                   ("ffn", "mlp"), ("ffn_norm", "post_attention_layernorm"), ("attn_norm", "input_layernorm")]
# Always-on description aliases (vLLM Ascend adds them for MTP / shared-head checkpoints).
ALWAYS_LEADING = [("transformer.shared_head.output", "shared_head.head"),
                  ("transformer.shared_head.norm", "shared_head.norm")]
VISION_COMPONENTS = ("visual", "vision_tower", "vision_model", "vit_large_projector", "vision")


def rename_components(name: str, old: str, new: str) -> str:
    """Replace every run of dotted components equal to ``old`` by ``new`` (``new=""`` drops them).

    ``rename_components("a.mlp.gate", "gate", "x") == "a.mlp.x"``; ``"a.mlp.gate_proj"`` is left alone."""
    parts, old_parts = name.split("."), old.split(".")
    new_parts = new.split(".") if new else []
    out: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i:i + len(old_parts)] == old_parts:
            out.extend(new_parts)
            i += len(old_parts)
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def rename_leading(name: str, old: str, new: str) -> str:
    """Replace the leading components ``old`` by ``new`` (component-anchored); other names unchanged."""
    if name == old or name.startswith(old + "."):
        return new + name[len(old):]
    return name


def replace_last_component(prefix: str, new: str) -> str:
    """``model.layers.0.self_attn.qkv_proj`` + ``q_proj`` -> ``model.layers.0.self_attn.q_proj``."""
    parent, _, _ = prefix.rpartition(".")
    return f"{parent}.{new}" if parent else new


def packed_modules_for(model_type: str | None, model_mapping: Mapping[str, list[str]] | None = None
                       ) -> dict[str, list[str]]:
    """The fused-module mapping of ``model_type`` (default: dense + experts), merged with the model class's own
    ``packed_modules_mapping`` when given (the model's entries win)."""
    mapping = dict(PACKED_MODULES_BY_MODEL_TYPE.get(model_type or "", DEFAULT_PACKED_MODULES))
    mapping.update(model_mapping or {})
    return mapping


def model_class_packed_mapping(hf_config: Any) -> dict[str, list[str]]:
    """``packed_modules_mapping`` of the engine model class named by ``hf_config.architectures`` ({} if unknown)."""
    try:
        from ascent.models.registry import get_model_class

        cls = get_model_class(list(getattr(hf_config, "architectures", None) or []))
    except (ValueError, KeyError, ImportError):
        return {}
    return dict(getattr(cls, "packed_modules_mapping", {}) or {})


def packed_modules_of_config(hf_config: Any) -> dict[str, list[str]]:
    """The fused-module mapping for the model ``hf_config`` describes: its ``model_type``'s table merged with the
    engine model class's own ``packed_modules_mapping``."""
    model_type = getattr(hf_config, "model_type", None) if hf_config is not None else None
    return packed_modules_for(model_type, model_class_packed_mapping(hf_config))


def lookup_candidates(model_type: str | None, key: str) -> list[str]:
    """Keys to try for ``key``: itself, the model's component renames, leading aliases, the lm_head alias."""
    candidates = [key]
    for old, new in PREFIX_RENAMES.get(model_type or "", []):
        renamed = rename_components(key, old, new)
        if renamed not in candidates:
            candidates.append(renamed)
    for old, new in LEADING_ALIASES.get(model_type or "", []):
        for cand in list(candidates):
            renamed = rename_leading(cand, old, new)
            if renamed not in candidates:
                candidates.append(renamed)
    if key.startswith("lm_head."):
        candidates.append("language_model." + key)
    return candidates


def _alias(desc: dict[str, Any], name: str, value: Any) -> None:
    if name not in desc:
        desc[name] = value


def augment_description(desc: Mapping[str, Any], model_type: str | None) -> dict[str, Any]:
    """A copy of ``desc`` with the description-side aliases of vLLM Ascend added (existing keys never change):
    ``.shared_head.`` dropped, ``transformer.shared_head.*`` renames, ``weight_packed`` -> ``weight``, and the
    DeepSeek-V4 native -> engine renames when ``model_type == "deepseek_v4"`` or the description has ``hc_head_fn``."""
    out = dict(desc)
    dsv4 = model_type == "deepseek_v4" or any(k.startswith("hc_head_fn") or ".hc_head_fn" in k for k in desc)
    for key, value in desc.items():
        if "shared_head" in key.split("."):
            _alias(out, rename_components(key, "shared_head", ""), value)
        for old, new in ALWAYS_LEADING:
            _alias(out, rename_leading(key, old, new), value)
        if "weight_packed" in key:
            _alias(out, key.replace("weight_packed", "weight"), value)
        if dsv4:
            renamed = key
            for old, new in DSV4_LEADING:
                renamed = rename_leading(renamed, old, new)
            for old, new in DSV4_COMPONENTS:
                renamed = rename_components(renamed, old, new)
            _alias(out, renamed, value)
    return out


def first_layer_id(name: str) -> int | None:
    """The number after the first ``layers`` component (``model.layers.3.mlp.experts.7.w1`` -> 3), else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def is_vision_prefix(prefix: str) -> bool:
    """True for layers of a vision tower / projector (never in a text-only ModelSlim description)."""
    return any(part in VISION_COMPONENTS for part in prefix.split("."))
