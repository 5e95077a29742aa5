"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm attention) with sparse MoE blocks (softmax top-k routing).

Layer ``i`` is sparse unless ``i in config.mlp_only_layers`` or ``(i + 1) % config.decoder_sparse_step != 0``
(then a dense gated MLP of ``config.intermediate_size``), as in HF ``Qwen3MoeDecoderLayer``. HF checkpoint keys:
``mlp.gate.weight`` (router, ``[E, H]``) and ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (fused on load into
``mlp.experts.w13_weight`` / ``w2_weight``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.fused_moe import FusedMoE, make_expert_params_mapping
from ascent.layers.linear import ReplicatedLinear
from ascent.layers.norm import RMSNorm
from ascent.layers.rotary import RotaryEmbedding
from ascent.models.common import (
    DecoderForCausalLM,
    GatedMLP,
    RopeSelfAttention,
    build_rope,
    join_prefix,
    layer_sliding_window,
)

logger = logging.getLogger(__name__)

_EXPERT_FRAGMENT = re.compile(r"experts\.\d+\.[A-Za-z0-9_]+\.")


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated, unquantized) + routed ``experts``; ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, config: Any, dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, params_dtype=dtype,
                                     prefix=join_prefix(prefix, "gate"))
        self.experts = FusedMoE(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, params_dtype=dtype,
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            activation=getattr(config, "hidden_act", "silu"), prefix=join_prefix(prefix, "experts"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule for which decoder layers use the MoE block."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm block ``h = x + attn(norm(x)); out = h + mlp(norm(h))`` with a sparse or dense ``mlp``."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int, dtype: torch.dtype,
                 quant_config: Any | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = RopeSelfAttention(config, rotary_emb, dtype, True, layer_sliding_window(config, layer_idx),
                                           quant_config, join_prefix(prefix, "self_attn"))
        mlp_prefix = join_prefix(prefix, "mlp")
        if is_sparse_layer(config, layer_idx):
            self.mlp: nn.Module = Qwen3MoeSparseMoeBlock(config, dtype, mlp_prefix)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                                False, dtype, quant_config, mlp_prefix)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

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


class Qwen3MoeModel(nn.Module):
    """Embedding -> decoder layers -> final norm. ``forward(input_ids int64 [T], positions int64 [T]) -> [T, H]``."""

    def __init__(self, config: Any, dtype: torch.dtype, quant_config: Any | None = None, prefix: str = "") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype,
                                                   prefix=join_prefix(prefix, "embed_tokens"))
        self.rotary_emb = build_rope(config, dtype)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, self.rotary_emb, i, dtype, quant_config, join_prefix(prefix, f"layers.{i}"))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """HF ``Qwen3MoeForCausalLM``. Reuses the dense model's forward / logits / weight loading; expert tensors are
    routed to ``FusedMoE.weight_loader`` (experts not local to this EP rank are skipped)."""

    qk_norm = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, prefix: str = "", quant_config: Any | None = None) -> None:
        # The dense parent's __init__ would build dense decoder layers; build the same attributes with MoE layers.
        nn.Module.__init__(self)
        self.config = hf_config
        self.dtype = dtype
        self.model = Qwen3MoeModel(hf_config, dtype, quant_config, join_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                      prefix=join_prefix(prefix, "lm_head"))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self._expert_mapping = {fragment: (param, expert, shard) for param, fragment, expert, shard
                                in make_expert_params_mapping(hf_config.num_experts)}

    def _load_expert(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                     seen: dict[str, set[tuple[int, str]]]) -> None:
        match = _EXPERT_FRAGMENT.search(name)
        entry = self._expert_mapping.get(match.group(0)) if match else None
        target = name[: match.start()] + entry[0] if match and entry else None
        if target is None or target not in params:
            logger.warning("skipping checkpoint tensor %s: no matching expert parameter", name)
            return
        params[target].weight_loader(params[target], tensor, name, entry[2], entry[1])
        seen.setdefault(target, set()).add((entry[1], entry[2]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the dense model, plus ``*.mlp.experts.{e}.{gate,up,down}_proj.weight`` into the fused expert params; an
        expert parameter counts as loaded once every expert's shards arrived (local to this EP rank or not)."""
        params = dict(self.named_parameters())
        seen: dict[str, set[tuple[int, str]]] = {}

        def non_expert() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if ".mlp.experts." in name:
                    self._load_expert(name, tensor, params, seen)
                else:
                    yield name, tensor

        loaded = super().load_weights(non_expert())
        num_experts = self.config.num_experts
        needed = {"w13_weight": 2 * num_experts, "w2_weight": num_experts}
        return loaded | {t for t, shards in seen.items() if len(shards) == needed[t.rsplit(".", 1)[-1]]}
