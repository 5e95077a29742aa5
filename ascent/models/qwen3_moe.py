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

from ascent.layers.fused_moe import FusedMoE, expert_param_name, make_expert_params_mapping
from ascent.layers.linear import ReplicatedLinear
from ascent.layers.rotary import RotaryEmbedding
from ascent.models.common import (
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    build_rope,
    dense_mlp,
    join_prefix,
    rope_attention,
)

logger = logging.getLogger(__name__)

_EXPERT_FRAGMENT = re.compile(r"experts\.\d+\.[A-Za-z0-9_]+\.")


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated, unquantized) + routed ``experts``; ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, config: Any, dtype: torch.dtype, prefix: str = "", quant_config: Any | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, params_dtype=dtype,
                                     prefix=join_prefix(prefix, "gate"))
        self.experts = FusedMoE(
            num_experts=config.num_experts, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, params_dtype=dtype,
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            activation=getattr(config, "hidden_act", "silu"), prefix=join_prefix(prefix, "experts"),
            num_redundant_experts=getattr(config, "num_redundant_experts", 0) or 0, quant_config=quant_config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule for which decoder layers use the MoE block."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """HF ``Qwen3MoeForCausalLM``: the shared decoder stack with q/k-norm attention and sparse MoE blocks (dense MLP
    on ``mlp_only_layers``). Expert tensors are routed to ``FusedMoE.weight_loader`` (experts not local to this EP
    rank are skipped)."""

    qk_norm = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, prefix: str = "", quant_config: Any | None = None) -> None:
        super().__init__(hf_config, dtype, prefix, quant_config)
        self._expert_mapping = {fragment: (param, expert, shard) for param, fragment, expert, shard
                                in make_expert_params_mapping(hf_config.num_experts)}

    def build_model(self, config: Any, dtype: torch.dtype, quant_config: Any | None, prefix: str) -> DecoderModel:
        def make_layer(i: int, rope: RotaryEmbedding, layer_prefix: str) -> DecoderLayer:
            attn = rope_attention(config, rope, i, dtype, True, quant_config, layer_prefix)
            mlp_prefix = join_prefix(layer_prefix, "mlp")
            mlp = (Qwen3MoeSparseMoeBlock(config, dtype, mlp_prefix, quant_config) if is_sparse_layer(config, i)
                   else dense_mlp(config, dtype, quant_config, mlp_prefix))
            return DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps, dtype)

        return DecoderModel(config, dtype, make_layer, build_rope(config, dtype), prefix)

    def _load_expert(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                     seen: dict[str, set[tuple[int, str]]]) -> None:
        match = _EXPERT_FRAGMENT.search(name)
        entry = self._expert_mapping.get(match.group(0)) if match else None
        target = name[: match.start()] + expert_param_name(entry[0], name, match.end()) if match and entry else None
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
        needed = {"w13": 2 * num_experts, "w2": num_experts}
        return loaded | {t for t, shards in seen.items() if len(shards) == needed[t.rsplit(".", 1)[-1].split("_")[0]]}
