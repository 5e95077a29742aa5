"""Qwen2 / Qwen2.5 dense models: the Llama blocks with a bias on the q/k/v projections and none on o_proj."""

from __future__ import annotations

from ascent.models.common import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    """HF ``Qwen2ForCausalLM``: q/k/v projections with bias, o_proj without; honours sliding-window layers."""

    qk_norm = False
    attention_biases = (True, False)
