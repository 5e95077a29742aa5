"""Whole-stack decode on CPU: the decoder layers of a dense Llama-style model as one C++ call per step.

The CPU analogue of a captured decode graph (vLLM Ascend's ACL graph / npugraph_ex): ``DecodeStack``
(``layers/cpu_kernels/decode_stack_cpu.cpp``) runs, per layer, the same fused kernels the modules call, in the same
order, so its output equals the module path bit for bit; it only removes the per-module Python cost, which dominates
the non-GEMV time of a small-batch decode step once the weight stream has evicted the caches.

It applies when the model is built only from the stock pieces: ``DecoderLayer`` of ``RopeSelfAttention`` (with or
without Qwen3's per-head q/k RMSNorms, which run the module path's torch ops from C++), ``GatedMLP`` with SiLU,
projections the stack can call (``linear_call``: unquantized ones with AMX tiles, a plain or a oneDNN-packed
weight, quantized schemes that provide ``decode_stack_call``), tensor parallel size 1, the SDPA backend and no
captured hidden states; and when the step is decode-only with at most ``max_tokens`` tokens: for quantized
projections the range in which the module path uses the same small-M kernels (the schemes' crossovers), so the values
are the module path's; unquantized ones make the module path's per-call choice (``cpu_packing.cpu_linear``: AMX
tiles up to ``AMX_MAX_M`` rows, small-M kernel up to ``small_m_max(dtype)``, else the oneDNN-packed weight) and take
any number of tokens. Anything else runs the modules.
``ASCENT_CPU_DECODE_STACK=0`` disables it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ascent.attention.backends.sdpa import SDPAImpl, SDPAMetadata
from ascent.forward_context import get_forward_context
from ascent.layers.activation import SiluAndMul
from ascent.layers.cpu_kernels import decode_stack_ops
from ascent.layers.cpu_packing import AMX_MAX_M, small_m_max
from ascent.layers.linear import UnquantizedLinearMethod


LinearSpec = tuple[int, list[torch.Tensor], list[int]]
# Unquantized projections choose their kernel per call exactly as the modules do, so they put no bound on the step's
# tokens.
UNBOUNDED_TOKENS = 1 << 30


def max_tokens_of(kind: int) -> int:
    """Tokens per call up to which the module path itself uses this kind's small-M kernel (so the stack, which always
    does, gives the module path's values); unquantized projections make the module path's choice per call."""
    from ascent.quantization import kernels
    from ascent.quantization.wo_amx import WO_AMX_MAX_M

    limits = {0: UNBOUNDED_TOKENS, kernels.STACK_KIND_W8A16: kernels.WEIGHT_ONLY_GEMV_MAX_M[8],
              kernels.STACK_KIND_W4A16: kernels.WEIGHT_ONLY_GEMV_MAX_M[4],
              kernels.STACK_KIND_W8A8_DYNAMIC: kernels.INT8_GEMV_MAX_M,
              kernels.STACK_KIND_W8A8_DYNAMIC_AMX: UNBOUNDED_TOKENS,
              kernels.STACK_KIND_W8A8_STATIC_AMX: UNBOUNDED_TOKENS,
              kernels.STACK_KIND_W8A16_AMX: kernels.W8A16_AMX_MAX_M,
              kernels.STACK_KIND_W8A8_STATIC: kernels.INT8_GEMV_MAX_M,
              kernels.STACK_KIND_WO_NV: kernels.WO_NV_MAX_M,
              kernels.STACK_KIND_W8A8_DYNAMIC_NV: kernels.INT8_NV_MAX_M,
              kernels.STACK_KIND_W8A8_STATIC_NV: kernels.INT8_NV_MAX_M,
              kernels.STACK_KIND_WO_AMX: WO_AMX_MAX_M}
    return limits.get(kind, 0)


# The small-M row limit of a projection whose kernel takes every row count (``cpu_packing.PanelWeight``).
ALL_ROWS = 1 << 40


def linear_call(linear: nn.Module) -> LinearSpec | None:
    """How the C++ stack computes this projection: ``(kind, tensors, ints)`` as ``LinearCall`` in
    ``decode_stack_cpu.cpp`` documents, or None when the module path must run it. Kind 0 = the AMX tiles up to
    ``ints[1]`` rows (0 without them), else the small-M kernel on the plain bf16/fp16 weight up to ``ints[0]`` rows
    (0 when no plain copy is kept), else the oneDNN-packed weight: the choice ``cpu_packing.cpu_linear`` makes (the
    bias, if any, in the weight's dtype)."""
    if getattr(linear, "tp_size", 1) != 1:
        return None
    method = linear.quant_method
    if type(method) is UnquantizedLinearMethod:
        weight, bias = linear.weight, linear.bias
        packed, amx = getattr(linear, "packed_weight", None), getattr(linear, "amx_weight", None)
        panels = getattr(linear, "panel_weight", None)
        small_m = getattr(linear, "small_m_ops", None) is not None and weight.numel() > 0
        if not small_m and packed is None and amx is None:
            return None
        if bias is not None and bias.dtype is not weight.dtype:
            return None
        empty = torch.empty(0, dtype=weight.dtype)
        tensors = [weight, bias, packed, amx.packed if amx is not None else None,
                   panels.panels if panels is not None else None]
        small_m_rows = (ALL_ROWS if panels is not None else small_m_max(weight.dtype)) if small_m else 0
        return 0, [t if t is not None else empty for t in tensors], \
            [small_m_rows, AMX_MAX_M if amx is not None else 0]
    call = getattr(method, "decode_stack_call", None)
    return call(linear) if call is not None else None


def _layer_eligible(layer: nn.Module, rotary_emb: nn.Module) -> bool:
    from ascent.models.common import DecoderLayer, GatedMLP, RopeSelfAttention

    if type(layer) is not DecoderLayer or type(layer.self_attn) is not RopeSelfAttention:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if attn.rotary_emb is not rotary_emb or type(mlp) is not GatedMLP:
        return False
    if attn.qk_norm and (attn.q_norm.bias is not None or attn.k_norm.bias is not None):
        return False
    if type(mlp.act_fn) is not SiluAndMul or mlp.act_fn._fused is None:
        return False
    if not isinstance(attn.attn.impl, SDPAImpl) or attn.attn.impl._fused is None:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(n.bias is not None or n._fused is None for n in norms):
        return False
    return all(linear_call(m) is not None for m in _projections(layer))


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_norms(model: nn.Module) -> list[nn.Module]:
    norms = []
    for layer in model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.self_attn.qk_norm:
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


class CpuDecodeStack:
    """Builds the C++ stack for a ``DecoderModel`` once its KV caches are bound, and runs eligible steps."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.steps_run = 0  # decode steps served by the C++ stack (observability and tests)
        self.largest_step = 0  # most tokens of a step it served
        self.max_tokens = 0  # tokens per step the stack takes (the smallest range of its projections)
        self._stack: Any = None
        self._caches: list[torch.Tensor] = []
        self._attention: list[nn.Module] = []  # the layers' Attention modules (their kv_cache is bound later)
        self._ops = decode_stack_ops() if os.environ.get("ASCENT_CPU_DECODE_STACK", "1") != "0" else None
        self._eligible = self._ops is not None and self._model_eligible()

    def _model_eligible(self) -> bool:
        model = self.model
        if model.capture_layers or model.rotary_emb._fused is None or len(model.layers) == 0:
            return False
        if not all(_layer_eligible(layer, model.rotary_emb) for layer in model.layers):
            return False
        if len({n.eps for n in _layer_norms(model)}) != 1:
            return False
        self.max_tokens = min(max_tokens_of(linear_call(m)[0]) for layer in model.layers for m in _projections(layer))
        self._dtype = model.layers[0].input_layernorm.weight.dtype
        norm = model.norm  # the final norm joins the C++ call where the fused kernel would run it anyway
        self._final_norm = (norm.weight if getattr(norm, "bias", None) is None and getattr(norm, "_fused", None)
                            is not None and norm.weight.dtype is self._dtype else None)
        self._attention = [layer.self_attn.attn for layer in model.layers]
        return True

    def _build(self, caches: list[torch.Tensor]) -> Any:
        first = self.model.layers[0].self_attn
        impl = first.attn.impl
        stack = self._ops.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, float(impl.scale),
                                      float(self.model.layers[0].input_layernorm.eps),
                                      int(self.model.rotary_emb.rotary_dim), bool(self.model.rotary_emb.is_neox_style))
        for layer, cache in zip(self.model.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(layer.input_layernorm.weight, linear_call(attn.qkv_proj), linear_call(attn.o_proj),
                            layer.post_attention_layernorm.weight, linear_call(mlp.gate_up_proj),
                            linear_call(mlp.down_proj), cache, int(attn.attn.impl.sliding_window or 0),
                            attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None)
        return stack

    def _step_metadata(self, hidden: torch.Tensor) -> SDPAMetadata | None:
        try:
            md = get_forward_context().attn_metadata
        except RuntimeError:  # a bare forward outside the engine
            return None
        tokens = hidden.shape[0]
        if type(md) is not SDPAMetadata or tokens > self.max_tokens:
            return None
        if (md.num_decodes != tokens or md.num_actual_tokens != tokens or md.decode_rows is not None
                or md.decode_start != 0 or md.write_rows is not None or md.write_slots.shape[0] != tokens
                or md.prefills or md.multi is not None or md.decode_slots is None):
            return None
        return md

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """``hidden [T, H]`` embeddings -> the model's final hidden states ``[T, H]`` (after the last layer and
        the final norm), or None when this step must run the modules. Call inside the rotary
        ``step_cache(positions)``."""
        if not self._eligible or hidden.device.type != "cpu":
            return None
        if hidden.dtype is not self._dtype:
            return None
        md = self._step_metadata(hidden)
        if md is None:
            return None
        caches = [attention.kv_cache for attention in self._attention]
        if self._stack is None or any(a is not b for a, b in zip(caches, self._caches)):
            if any(c.numel() == 0 or c.dtype is not hidden.dtype for c in caches):
                return None
            self._stack, self._caches = self._build(caches), caches
        rows = self.model.rotary_emb._rows(positions)
        if rows.dtype is not hidden.dtype:
            return None
        hidden, residual = self._stack.forward(hidden, rows, md.write_slots, md.decode_slots, md.decode_seq_lens,
                                               self._final_norm, float(self.model.norm.eps))
        if self._final_norm is None:
            hidden, _ = self.model.norm(hidden, residual)
        self.steps_run += 1
        self.largest_step = max(self.largest_step, hidden.shape[0])
        return hidden
