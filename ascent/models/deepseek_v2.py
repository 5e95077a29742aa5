"""DeepSeek-V2 and DeepSeek-V3: MLA attention (paged latent cache, ``ascent.attention.mla_layer``) and MoE.

Layers ``< first_k_dense_replace`` use a dense gated MLP; the others a routed MoE (``FusedMoE``) plus a dense
shared-experts MLP of ``n_shared_experts * moe_intermediate_size``. Routing (scores in fp32 from an fp32 router):
* V2 ``topk_method`` "greedy": softmax top-k; "group_limited_greedy": softmax, only the ``topk_group`` best of
  ``n_group`` groups (group score = max) are eligible;
* V3 ``noaux_tc`` (the default when the config has no ``topk_method``): sigmoid, ``e_score_correction_bias`` added
  for selection only, group score = sum of the group's top-2;
then weights renormalised when ``norm_topk_prob`` and scaled by ``routed_scaling_factor``.
Checkpoint names are HF's (specs/feasibility.md §1); layers ``>= num_hidden_layers`` (MTP heads) are skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ascent.attention.mla_layer import MLAAttention, build_mla_rope
from ascent.layers.linear import ReplicatedLinear, default_weight_loader
from ascent.layers.rotary import RotaryEmbedding
from ascent.models.common import (
    SKIPPED_CHECKPOINT_SUFFIXES,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    dense_mlp,
    join_prefix,
)

logger = logging.getLogger(__name__)

ROUTING_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_GATE_UP = ((".gate_proj.", 0), (".up_proj.", 1))
_EXPERT_KEY = re.compile(r"\.(experts\.\d+\.[A-Za-z0-9_]+\.)")


def routing_options(config: Any, default_topk_method: str) -> dict[str, Any]:
    """FusedMoE routing keyword arguments for a DeepSeek config (see the module docstring)."""
    method = getattr(config, "topk_method", None) or default_topk_method
    if method not in ROUTING_METHODS:
        raise ValueError(f"topk_method {method!r} is not supported (supported: {', '.join(ROUTING_METHODS)})")
    scoring = getattr(config, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
    grouped = method != "greedy" and (getattr(config, "n_group", None) or 1) > 1
    return dict(
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        scoring_func=scoring,
        use_grouped_topk=grouped,
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        e_score_correction_bias=method == "noaux_tc",
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )


class DeepseekMoE(nn.Module):
    """Router (fp32 ``gate`` ``[E, H]``) -> routed experts (``FusedMoE``), plus the shared experts."""

    def __init__(self, config: Any, dtype: torch.dtype, default_topk_method: str, quant_config: Any | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        from ascent.layers.fused_moe import FusedMoE

        self.gate = ReplicatedLinear(config.hidden_size, config.n_routed_experts, bias=False,
                                     params_dtype=torch.float32, prefix=join_prefix(prefix, "gate"))
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, dtype, activation=getattr(config, "hidden_act", "silu"),
                                prefix=join_prefix(prefix, "experts"),
                                num_redundant_experts=getattr(config, "num_redundant_experts", 0) or 0,
                                quant_config=quant_config, **routing_options(config, default_topk_method))
        self.shared_experts: GatedMLP | None = None
        if getattr(config, "n_shared_experts", None):
            self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                           getattr(config, "hidden_act", "silu"), False, dtype, quant_config,
                                           join_prefix(prefix, "shared_experts"))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states.float()))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def _is_moe_layer(config: Any, layer_idx: int) -> bool:
    return bool(config.n_routed_experts) and layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """HF ``DeepseekV2ForCausalLM``: the shared decoder stack with MLA attention and DeepSeek MoE blocks.

    ``forward(input_ids int64 [T], positions int64 [T]) -> hidden [T, hidden_size]`` (model dtype);
    ``compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size]``;
    ``load_weights(iterable of (HF checkpoint name, tensor)) -> set of fully loaded parameter names``.
    """

    default_topk_method = "greedy"

    def build_model(self, config: Any, dtype: torch.dtype, quant_config: Any | None, prefix: str) -> DecoderModel:
        def make_layer(i: int, rope: RotaryEmbedding, layer_prefix: str) -> DecoderLayer:
            attn = MLAAttention(config, rope, dtype, quant_config, join_prefix(layer_prefix, "self_attn"))
            mlp_prefix = join_prefix(layer_prefix, "mlp")
            mlp = (DeepseekMoE(config, dtype, self.default_topk_method, quant_config, mlp_prefix)
                   if _is_moe_layer(config, i) else dense_mlp(config, dtype, quant_config, mlp_prefix))
            return DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps, dtype)

        return DecoderModel(config, dtype, make_layer, build_mla_rope(config, dtype), prefix)

    def _skip(self, name: str) -> bool:
        if name.endswith(SKIPPED_CHECKPOINT_SUFFIXES) or (self.tie_word_embeddings and name.startswith("lm_head.")):
            return True
        parts = name.split(".")
        return (len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit()
                and int(parts[2]) >= self.config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors: per-expert projections into ``FusedMoE`` (a parameter counts as loaded once all
        of its experts' shards arrived), gate/up pairs into the fused ``gate_up_proj``, the selection bias
        ``mlp.gate.e_score_correction_bias`` into ``mlp.experts``; unknown names are logged and skipped."""
        from ascent.layers.fused_moe import make_expert_params_mapping

        params = dict(self.named_parameters())
        num_experts = self.config.n_routed_experts or 0
        expert_mapping = {frag: (param, e, sid) for param, frag, e, sid in make_expert_params_mapping(num_experts)}
        expected = {"experts.w13_": 2 * num_experts, "experts.w2_": num_experts}
        shards: dict[str, set[Any]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._skip(name):
                continue
            name = name.replace("mlp.gate.e_score_correction_bias", "mlp.experts.e_score_correction_bias")
            target, shard = self._load_one(params, expert_mapping, name, tensor)
            if target is None:
                logger.warning("skipping checkpoint tensor %s: no matching parameter", name)
                continue
            shards.setdefault(target, set()).add(shard)
            suffix = next((k for k in expected if k in target), None)
            needed = expected[suffix] if suffix else (2 if ".gate_up_proj." in target else 1)
            if len(shards[target]) == needed:
                loaded.add(target)
        return loaded

    @staticmethod
    def _load_one(params: dict[str, nn.Parameter], expert_mapping: dict[str, tuple[str, int, str]], name: str,
                  tensor: torch.Tensor) -> tuple[str | None, Any]:
        """Load one tensor; returns (parameter name, shard key) or (None, None) when nothing matches."""
        from ascent.layers.fused_moe import expert_param_name

        match = _EXPERT_KEY.search(name)
        if match is not None and match.group(1) in expert_mapping:
            param_name, expert_id, shard_id = expert_mapping[match.group(1)]
            target = name[: match.start(1)] + expert_param_name(param_name, name, match.end(1))
            if target in params:
                params[target].weight_loader(params[target], tensor, name, shard_id, expert_id)
                return target, (expert_id, shard_id)
        for part, shard_id in _GATE_UP:
            if part in name:
                target = name.replace(part, ".gate_up_proj.")
                if target in params:
                    params[target].weight_loader(params[target], tensor, shard_id)
                    return target, shard_id
        param = params.get(name)
        if param is None:
            return None, None
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return name, None


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """HF ``DeepseekV3ForCausalLM``: same structure; routing defaults to ``noaux_tc`` (sigmoid + correction bias,
    group score = sum of top-2) and RoPE to ``rope_interleave`` (GPT-J pairs) as in the HF config."""

    default_topk_method = "noaux_tc"
