"""Llama (and Llama-architecture checkpoints such as SmolLM2 and Mistral without sliding window)."""

from __future__ import annotations

from ascent.models.common import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """HF ``LlamaForCausalLM``: pre-norm decoder, fused QKV and gate/up, RoPE (all Llama rope types)."""

    qk_norm = False
