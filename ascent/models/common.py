"""Shared decoder blocks for Llama-style dense models (Llama, Qwen3, Mistral-like variants).

A model is ``DecoderForCausalLM`` plus a few class attributes (e.g. ``qk_norm`` for Qwen3). Layers are
tensor-parallel aware; projections are fused (QKV, gate/up) and the residual add is fused into the norms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ascent.attention.layer import Attention
from ascent.layers.activation import get_act_and_mul
from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from ascent.layers.norm import RMSNorm
from ascent.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from ascent.models.decode_stack import CpuDecodeStack

logger = logging.getLogger(__name__)

SKIPPED_CHECKPOINT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# ModelSlim C8 KV-cache scales live on the k/v projections in the checkpoint and on the attention layer in the engine.
KV_SCALE_RENAMES = tuple((f".{kv}_proj.kv_cache_{what}", f".attn.{kv}_cache_{what}")
                         for kv in "kv" for what in ("scale", "offset"))


def join_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def build_rope(config: Any, dtype: torch.dtype) -> RotaryEmbedding:
    """The model's RoPE (shared by all layers) from ``config.rope_parameters`` / legacy rope fields."""
    params = rope_parameters_from_config(config)
    head_dim = head_dim_of(config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return get_rope(head_dim, rotary_dim, config.max_position_embeddings, params, True, dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate/up fused in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, dtype: torch.dtype,
                 quant_config: Any | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       params_dtype=dtype, quant_config=quant_config,
                                                       prefix=join_prefix(prefix, "gate_up_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, params_dtype=dtype,
                                           quant_config=quant_config, prefix=join_prefix(prefix, "down_proj"))
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class RopeSelfAttention(nn.Module):
    """Fused-QKV self-attention with RoPE; ``qk_norm`` adds per-head RMSNorm on q and k before RoPE (Qwen3)."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype, qk_norm: bool = False,
                 sliding_window: int | None = None, quant_config: Any | None = None, prefix: str = "",
                 biases: tuple[bool, bool] | None = None) -> None:
        """``biases``: (qkv_proj, o_proj) bias flags; None = both ``config.attention_bias`` (Llama, Qwen3)."""
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads, total_kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        total_kv = total_kv or total_heads
        if biases is None:
            biases = (bool(getattr(config, "attention_bias", False)),) * 2
        qkv_bias, o_bias = biases
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv, bias=qkv_bias,
                                          params_dtype=dtype, quant_config=quant_config,
                                          prefix=join_prefix(prefix, "qkv_proj"))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        params_dtype=dtype, quant_config=quant_config,
                                        prefix=join_prefix(prefix, "o_proj"))
        self.rotary_emb = rotary_emb
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads,
                              prefix=join_prefix(prefix, "attn"), sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if not self.qk_norm:  # rotate the q and k columns of the fused output in place, in one pass
            self.rotary_emb.rotate_(positions, qkv[:, : self.q_size + self.kv_size])
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            num_tokens = q.shape[0]
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)).view(num_tokens, self.q_size)
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)).view(num_tokens, self.kv_size)
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window of layer ``layer_idx`` per ``config.layer_types`` (None = full attention)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_idx] == "sliding_attention":
        return getattr(config, "sliding_window", None)
    return None


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` with the residual carried separately.

    ``self_attn(positions, hidden) -> hidden`` and ``mlp(hidden) -> hidden`` are given by the model (dense attention
    or MLA; dense MLP or MoE), so every architecture shares this block and the decoder stack below.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def dense_mlp(config: Any, dtype: torch.dtype, quant_config: Any | None, prefix: str) -> GatedMLP:
    """The config's dense gated MLP (``intermediate_size``)."""
    return GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                    bool(getattr(config, "mlp_bias", False)), dtype, quant_config, prefix)


def rope_attention(config: Any, rotary_emb: RotaryEmbedding, layer_idx: int, dtype: torch.dtype, qk_norm: bool,
                   quant_config: Any | None, prefix: str,
                   biases: tuple[bool, bool] | None = None) -> RopeSelfAttention:
    return RopeSelfAttention(config, rotary_emb, dtype, qk_norm, layer_sliding_window(config, layer_idx),
                             quant_config, join_prefix(prefix, "self_attn"), biases)


LayerFactory = Callable[[int, RotaryEmbedding, str], nn.Module]


class DecoderModel(nn.Module):
    """Embedding -> decoder layers -> final norm. ``forward(input_ids int64 [T], positions int64 [T]) -> [T, H]``.

    ``make_layer(layer_idx, rotary_emb, prefix)`` builds each layer (a ``DecoderLayer``).
    ``capture_layers`` (set by a speculative proposer, e.g. EAGLE-3): after each forward, ``aux_hidden_states`` holds
    one ``[T, H]`` tensor per id, in the given order: id ``i`` = the residual stream entering layer ``i`` (``i = L``:
    the last layer's output before the final norm)."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, config: Any, dtype: torch.dtype, make_layer: LayerFactory, rotary_emb: RotaryEmbedding,
                 prefix: str = "", quant_config: Any | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   prefix=join_prefix(prefix, "embed_tokens"),
                                                   quant_config=quant_config)
        self.rotary_emb = rotary_emb
        self.layers = nn.ModuleList(
            make_layer(i, rotary_emb, join_prefix(prefix, f"layers.{i}")) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self._decode_stack: CpuDecodeStack | None = None  # built at the first forward, after weight processing

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self.rotary_emb.step_cache(positions):  # cos/sin gathered once for all layers
            return self._forward_layers(input_ids, positions)

    def process_weights_after_loading(self) -> None:
        """(Re)loaded weights: the C++ decode stack holding them is rebuilt at the next eligible step."""
        self._decode_stack = None

    def _forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        stack = self._decode_stack
        if stack is None:
            stack = self._decode_stack = CpuDecodeStack(self)
        stacked = stack.forward(hidden_states, positions)
        if stacked is not None:  # every layer and the final norm in one C++ call (decode-only CPU step)
            return stacked
        return self._forward_module_layers(hidden_states, positions)

    def _forward_module_layers(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                captured[i] = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.capture_layers:
            captured[len(self.layers)] = hidden_states + residual
            self.aux_hidden_states = [captured[i] for i in self.capture_layers]
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A Llama-style causal LM. Subclasses set ``qk_norm`` and may extend ``packed_modules_mapping``.

    ``forward(input_ids int64 [T], positions int64 [T]) -> hidden [T, hidden_size]`` (model dtype);
    ``compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size]``;
    ``load_weights(iterable of (HF checkpoint name, tensor)) -> set of fully loaded parameter names``.
    """

    qk_norm: ClassVar[bool] = False
    attention_biases: ClassVar[tuple[bool, bool] | None] = None  # (qkv, o) bias flags; None: config.attention_bias
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype, prefix: str = "", quant_config: Any | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.model = self.build_model(hf_config, dtype, quant_config, join_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                      prefix=join_prefix(prefix, "lm_head"), quant_config=quant_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def build_model(self, config: Any, dtype: torch.dtype, quant_config: Any | None, prefix: str) -> DecoderModel:
        """The decoder stack; architectures override this to change attention or MLP blocks."""

        def make_layer(i: int, rope: RotaryEmbedding, layer_prefix: str) -> DecoderLayer:
            attn = rope_attention(config, rope, i, dtype, self.qk_norm, quant_config, layer_prefix,
                                  self.attention_biases)
            mlp = dense_mlp(config, dtype, quant_config, join_prefix(layer_prefix, "mlp"))
            return DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps, dtype)

        return DecoderModel(config, dtype, make_layer, build_rope(config, dtype), prefix, quant_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def _stacked_mapping(self) -> list[tuple[str, str, Any]]:
        mapping = []
        for fused, parts in self.packed_modules_mapping.items():
            shard_ids: list[Any] = ["q", "k", "v"] if fused == "qkv_proj" else list(range(len(parts)))
            mapping.extend((fused, part, sid) for part, sid in zip(parts, shard_ids))
        return mapping

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (cast to the parameter dtype). A packed parameter counts as loaded once all of its
        shards arrived. Rotary caches are skipped, so is ``lm_head.*`` when embeddings are tied; unknown names are
        logged and skipped."""
        params = dict(self.named_parameters())
        stacked = self._stacked_mapping()
        shards_needed = {fused: len(parts) for fused, parts in self.packed_modules_mapping.items()}
        seen_shards: dict[str, set[Any]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(SKIPPED_CHECKPOINT_SUFFIXES) or (self.tie_word_embeddings and name.startswith("lm_head.")):
                continue
            name = _rename_kv_scale(name, params)
            for fused, part, shard_id in stacked:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    if target in params:
                        params[target].weight_loader(params[target], tensor, shard_id)
                        seen_shards.setdefault(target, set()).add(shard_id)
                        if len(seen_shards[target]) == shards_needed[fused]:
                            loaded.add(target)
                        break
            else:
                param = params.get(name)
                if param is None:
                    logger.warning("skipping checkpoint tensor %s: no matching parameter", name)
                    continue
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        return loaded


def _rename_kv_scale(name: str, params: dict[str, nn.Parameter]) -> str:
    """``<attn>.k_proj.kv_cache_scale`` -> ``<attn>.attn.k_cache_scale`` when the model has that parameter."""
    for old, new in KV_SCALE_RENAMES:
        if name.endswith(old):
            renamed = name[: -len(old)] + new
            return renamed if renamed in params else name
    return name
