"""Qwen3 dense models: the Llama blocks plus per-head RMSNorm of q and k before RoPE."""

from __future__ import annotations

from ascent.models.common import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    """HF ``Qwen3ForCausalLM``: like Llama, with ``q_norm``/``k_norm`` over head_dim; honours sliding-window layers."""

    qk_norm = True
