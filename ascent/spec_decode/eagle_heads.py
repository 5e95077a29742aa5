"""EAGLE draft heads in the published HF checkpoint layouts (Llama-style; our own implementation).

EAGLE-1 (Li et al., arXiv 2401.15077; SafeAILab layout): ``fc.weight [H, 2H]`` (optional ``fc.bias``) fuses
``[embed(token) ; feature]``, then one decoder layer ``layers.0.*`` (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``post_attention_layernorm``; no ``input_layernorm``). Output = the layer's output plus
its residual (no final norm); logits = the target's ``lm_head`` of it. Embeddings: ``embed_tokens.weight`` if the
checkpoint has it, else the target's.

EAGLE-3 (arXiv 2503.01840; ``midlayer.*`` layout): ``fc.weight [H, n·H_target]`` fuses the ``n`` (normally 3) target
aux hidden states once, on the target's features; the layer ``midlayer.*`` attends over
``[input_layernorm(embed(token)) ; hidden_norm(h)]`` (``q/k/v_proj`` take ``2H`` inputs) with ``h`` as the residual
(``norm_before_residual``: the normed ``h``); the output goes through ``norm`` for the logits (own ``lm_head`` over
``draft_vocab_size`` tokens, mapped to target ids by ``target = draft + d2t[draft]``; ``t2d`` is ignored) and is
carried un-normed into the next chain step. Missing ``lm_head`` / ``embed_tokens``: the target's are used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ascent.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ascent.layers.linear import QKVParallelLinear, ReplicatedLinear, default_weight_loader
from ascent.layers.norm import RMSNorm
from ascent.models.common import build_rope, dense_mlp, head_dim_of, rope_attention

logger = logging.getLogger(__name__)

_STACKED = ((".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"), (".qkv_proj.", ".v_proj.", "v"),
            (".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1))


def normalize_name(name: str) -> str:
    """Checkpoint name -> module name: drop a leading ``model.``, ``midlayer.`` -> ``layers.0.``."""
    if name.startswith("model."):
        name = name[len("model."):]
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def load_head_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load HF-named tensors into ``module`` (q/k/v and gate/up fused); returns the loaded parameter/buffer names.
    Unknown names are logged and skipped."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    loaded: set[str] = set()
    for raw, tensor in weights:
        name = normalize_name(raw)
        for fused, part, shard in _STACKED:
            target = name.replace(part, fused)
            if part in name and target in params:
                params[target].weight_loader(params[target], tensor, shard)
                loaded.add(target)
                break
        else:
            if name in params:
                getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)
                loaded.add(name)
            elif name in buffers:
                buffers[name].copy_(tensor.to(buffers[name].dtype))
                loaded.add(name)
            else:
                logger.warning("skipping EAGLE checkpoint tensor %s: no matching parameter", raw)
    return loaded


class EagleLayer(nn.Module):
    """The single draft decoder layer (attention + gated MLP); ``qkv_in`` = 2H for EAGLE-3."""

    def __init__(self, config: Any, dtype: torch.dtype, eagle3: bool, prefix: str = "layers.0") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = rope_attention(config, build_rope(config, dtype), 0, dtype, False, None, prefix)
        if eagle3:
            bias = bool(getattr(config, "attention_bias", False))
            attn = self.self_attn
            attn.qkv_proj = QKVParallelLinear(2 * hidden, head_dim_of(config), config.num_attention_heads,
                                              getattr(config, "num_key_value_heads", None) or
                                              config.num_attention_heads, bias=bias, params_dtype=dtype,
                                              prefix=f"{prefix}.self_attn.qkv_proj")
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.mlp = dense_mlp(config, dtype, None, f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Returns the layer output plus residual (pre-norm feature)."""
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle1Head(nn.Module):
    """EAGLE-1: ``forward(ids, positions, feature [n, H]) -> feature' [n, H]`` (logits: the target's lm_head)."""

    def __init__(self, config: Any, dtype: torch.dtype, fc_bias: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=fc_bias, params_dtype=dtype, prefix="fc")
        self.layers = nn.ModuleList([EagleLayer(config, dtype, eagle3=False)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        x = self.fc(torch.cat([self.embed_tokens(input_ids), feature], dim=-1))
        return self.layers[0](positions, x, x)


class Eagle3Head(nn.Module):
    """EAGLE-3: ``forward(ids, positions, h [n, H]) -> (normed [n, H], carry [n, H])``; ``combine(aux [n, k·H])``
    applies ``fc``; ``compute_logits(normed) -> fp32 [n, vocab]`` (-inf outside the draft vocabulary)."""

    def __init__(self, config: Any, dtype: torch.dtype, num_aux: int, target_hidden: int, vocab_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.vocab_size = vocab_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or vocab_size)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.fc = ReplicatedLinear(num_aux * target_hidden, hidden, bias=False, params_dtype=dtype, prefix="fc")
        self.layers = nn.ModuleList([EagleLayer(config, dtype, eagle3=True)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.lm_head: ParallelLMHead | None = ParallelLMHead(self.draft_vocab_size, hidden, params_dtype=dtype,
                                                             prefix="lm_head")
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        layer = self.layers[0]
        embeds = layer.input_layernorm(self.embed_tokens(input_ids))
        normed_h = layer.hidden_norm(h)
        residual = normed_h if self.norm_before_residual else h
        out = layer(positions, torch.cat([embeds, normed_h], dim=-1), residual)
        return self.norm(out), out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        logits = self.lm_head(normed).float()
        if self.draft_vocab_size == self.vocab_size:
            return logits
        ids = torch.arange(self.draft_vocab_size, device=logits.device) + self.d2t
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, ids] = logits
        return full
