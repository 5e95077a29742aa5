"""DeepSeek-V3 style multi-token prediction proposer (``method: "mtp"``; vLLM's ``deepseek_mtp`` semantics).

The MTP layer is part of the target checkpoint as layer ``num_hidden_layers`` (``model.layers.{L}.*``; the target
loader skips it): ``enorm``, ``hnorm``, ``eh_proj [H, 2H]``, a full decoder layer (``self_attn`` = MLA,
``mlp`` = MoE or dense like target layer ``L``, ``input_layernorm``, ``post_attention_layernorm``),
``shared_head.norm``, ``shared_head.head`` and optionally ``embed_tokens`` (else the target's). Draft step at
position ``p``: ``x = eh_proj([enorm(embed(token_{p+1})) ; hnorm(h_p)])`` (embedding zeroed at position 0), ``out =
layer(x) + residual``, logits ``= head(norm(out))``; ``h_p`` is the target's final hidden state for the catch-up
rows and the MTP layer's own ``out`` for later chain steps (one layer reused for all ``k`` steps, vLLM's behaviour
with ``num_nextn_predict_layers = 1``). The layer has its own MLA KV cache (:class:`DraftModelRunner`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascent.attention.mla_layer import MLAAttention, build_mla_rope
from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.linear import ReplicatedLinear
from ascent.layers.norm import RMSNorm
from ascent.loader.base import finalize_model
from ascent.models.common import DecoderLayer, dense_mlp
from ascent.spec_decode.base import SpeculativeConfig
from ascent.spec_decode.draft_runner import DraftModelRunner
from ascent.spec_decode.model_proposer import ChainDrafter
from ascent.spec_decode.registry import register_proposer

_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


class SharedHead(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype, prefix="shared_head.head")


class DeepseekMTPLayer(nn.Module):
    """``forward(ids, positions, prev_hidden [n, H]) -> out [n, H]``; ``compute_logits(out) -> fp32 [n, V]``."""

    def __init__(self, config: Any, dtype: torch.dtype, layer_idx: int, topk_method: str, own_embed: bool) -> None:
        super().__init__()
        from ascent.models.deepseek_v2 import DeepseekMoE, _is_moe_layer

        hidden = config.hidden_size
        prefix = f"model.layers.{layer_idx}"
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(config.vocab_size, hidden, dtype, prefix="embed_tokens") if own_embed else None)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, params_dtype=dtype, prefix="eh_proj")
        attn = MLAAttention(config, build_mla_rope(config, dtype), dtype, None, f"{prefix}.self_attn")
        mlp = (DeepseekMoE(config, dtype, topk_method, None, f"{prefix}.mlp") if _is_moe_layer(config, layer_idx)
               else dense_mlp(config, dtype, None, f"{prefix}.mlp"))
        self.block = DecoderLayer(attn, mlp, hidden, config.rms_norm_eps, dtype)
        self.shared_head = SharedHead(config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        embeds = self.embed_tokens(input_ids)
        embeds = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(embeds), embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        out, residual = self.block(positions, x, None)
        return out + residual

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(out)).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``model.layers.{L}.*`` tensors with their prefix stripped; ValueError naming missing parameters."""
        from ascent.layers.fused_moe import make_expert_params_mapping
        from ascent.models.deepseek_v2 import DeepseekV2ForCausalLM

        params = dict(self.named_parameters())
        experts = getattr(getattr(self.block.mlp, "experts", None), "num_experts", None) or 0
        mapping = {frag: (param, e, sid) for param, frag, e, sid in make_expert_params_mapping(experts)}
        loaded = set()
        for name, tensor in weights.items():
            name = name.replace("mlp.gate.e_score_correction_bias", "mlp.experts.e_score_correction_bias")
            if name.startswith(_BLOCK_PARTS):
                name = "block." + name
            target, _ = DeepseekV2ForCausalLM._load_one(params, mapping, name, tensor)
            if target is None:
                raise ValueError(f"unexpected MTP checkpoint tensor {name!r}")
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP layer is missing {', '.join(missing[:8])}")


def read_mtp_weights(model_dir: str, layer_idx: int) -> dict[str, torch.Tensor]:
    """The tensors named ``model.layers.{layer_idx}.*`` of a safetensors checkpoint, prefix stripped."""
    from safetensors import safe_open

    from ascent.loader.hf import safetensors_files

    prefix = f"model.layers.{layer_idx}."
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                if name.startswith(prefix):
                    out[name[len(prefix):]] = reader.get_tensor(name)
    return out


@register_proposer("mtp")
class MTPProposer(ChainDrafter):
    """Chain drafting with the target checkpoint's first MTP layer."""

    uses_target_hidden = True
    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.layer: DeepseekMTPLayer | None = None

    def load_model(self, target_model: nn.Module | None) -> None:
        assert self.env is not None and target_model is not None
        config = target_model.config
        if not getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("method 'mtp' needs a target with num_nextn_predict_layers >= 1 in its config")
        path = self.config.model or self.env.target_model_path
        assert path is not None
        idx = int(config.num_hidden_layers)
        weights = read_mtp_weights(path, idx)
        if not weights:
            raise ValueError(f"checkpoint {path!r} has no MTP layer tensors (model.layers.{idx}.*)")
        topk = getattr(target_model, "default_topk_method", "noaux_tc")
        with torch.device(self.env.device):
            layer = DeepseekMTPLayer(config, self.env.dtype, idx, topk, own_embed="embed_tokens.weight" in weights)
        layer.load_weights(weights)
        finalize_model(layer)
        if layer.embed_tokens is None:
            layer.embed_tokens = target_model.model.embed_tokens
        self.layer = layer.eval()
        self.runner = DraftModelRunner(self.layer, self.env, self.k)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                carry: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.layer is not None and carry is not None
        out = self.layer(input_ids, positions, carry)
        return out, out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.layer is not None
        return self.layer.compute_logits(hidden)
