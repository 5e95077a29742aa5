"""The MLA attention layer of DeepSeek-V2/V3: projections, RoPE on the rope dims, paged latent attention.

Checkpoint names (HF): ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj`` when ``q_lora_rank`` is None),
``kv_a_proj_with_mqa`` ``[L+R, hidden]``, ``kv_a_layernorm`` ``[L]``, ``kv_b_proj`` ``[heads*(N+V), L]``,
``o_proj`` ``[hidden, heads*V]``. The layer owns a paged latent cache like ``Attention`` does (``layer_name``,
``num_kv_heads`` = 1, ``head_size`` = L + R, ``kv_cache``, ``backend``), so the model runner allocates and binds it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ascent.attention.backends.mla import MLABackend, MLAImpl
from ascent.forward_context import get_forward_context
from ascent.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, UnquantizedLinearMethod
from ascent.layers.norm import RMSNorm
from ascent.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config

# DeepSeek's q_a / kv_a layernorms use RMSNorm's default epsilon, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """``(qk_nope + qk_rope)^-0.5``, times ``mscale^2`` with ``mscale = yarn_mscale(factor, mscale_all_dim)`` for
    scaled RoPE types that set ``mscale_all_dim`` (DeepSeek's YaRN)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters_from_config(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        scale *= _yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2
    return scale


def build_mla_rope(config: Any, dtype: torch.dtype) -> RotaryEmbedding:
    """RoPE over the ``qk_rope_head_dim`` dims; GPT-J (interleaved pairs) unless ``config.rope_interleave`` is
    False (DeepSeek-V2 checkpoints are always interleaved)."""
    rope_dim = config.qk_rope_head_dim
    interleave = getattr(config, "rope_interleave", True)
    return get_rope(rope_dim, rope_dim, config.max_position_embeddings, rope_parameters_from_config(config),
                    is_neox_style=not interleave, dtype=dtype)


class MLAAttention(nn.Module):
    """Multi-head latent attention with a paged latent KV cache.

    ``forward(positions int64 [T], hidden_states [T, hidden]) -> [T, hidden]`` using the ``MLAMetadata`` of the
    current forward context (or a dict ``layer_name -> metadata``; None = dummy forward without a cache).
    Heads are split over tensor-parallel ranks (q/kv_b column-parallel, o row-parallel); the latent projection
    is replicated. ``process_weights_after_loading`` derives the absorbed W_UK / W_UV from ``kv_b_proj``.
    """

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
                 quant_config: Any | None = None, prefix: str = "") -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        total_heads = config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self._build_projections(total_heads, bias, dtype, quant_config, prefix)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.qk_nope_head_dim + self.v_head_dim)
        self.rotary_emb = rotary_emb
        self.scale = mla_softmax_scale(config)
        self.layer_name = _join(prefix, "attn")
        self.num_kv_heads = 1
        self.head_size = self.kv_lora_rank + self.qk_rope_head_dim
        self.backend = MLABackend
        self.impl = MLAImpl(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                            self.v_head_dim, self.scale)
        self.kv_cache: torch.Tensor = torch.empty(0)

    def _build_projections(self, total_heads: int, bias: bool, dtype: torch.dtype, quant_config: Any | None,
                           prefix: str) -> None:
        q_out = total_heads * self.qk_head_dim
        common = dict(params_dtype=dtype, quant_config=quant_config)
        if self.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(self.hidden_size, self.q_lora_rank, bias=bias,
                                             prefix=_join(prefix, "q_a_proj"), **common)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, bias=False,
                                                 prefix=_join(prefix, "q_b_proj"), **common)
        else:
            self.q_proj = ColumnParallelLinear(self.hidden_size, q_out, bias=False, prefix=_join(prefix, "q_proj"),
                                               **common)
        self.kv_a_proj_with_mqa = ReplicatedLinear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                                   bias=bias, prefix=_join(prefix, "kv_a_proj_with_mqa"), **common)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        kv_b_out = total_heads * (self.qk_nope_head_dim + self.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, kv_b_out, bias=False,
                                              prefix=_join(prefix, "kv_b_proj"), **common)
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, self.hidden_size, bias=bias,
                                        prefix=_join(prefix, "o_proj"), **common)

    def _kv_b_weight(self) -> torch.Tensor:
        """The effective ``kv_b_proj`` weight ``[H*(N+V), L]`` (the raw weight when unquantized and still dense;
        otherwise recovered by projecting the identity through the layer)."""
        weight = getattr(self.kv_b_proj, "weight", None)
        dense = isinstance(self.kv_b_proj.quant_method, UnquantizedLinearMethod)
        if dense and weight is not None and weight.numel() > 0:
            return weight.data
        eye = torch.eye(self.kv_lora_rank, dtype=self.kv_b_proj.params_dtype, device=self.kv_a_layernorm.weight.device)
        return self.kv_b_proj(eye).transpose(0, 1)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split ``kv_b_proj`` into the absorbed ``W_UK`` ``[H, N, L]`` and ``W_UV`` ``[H, V, L]``."""
        weight = self._kv_b_weight().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = weight.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        self.impl.set_weights(w_uk.clone(), w_uv.clone(), up_proj=self.kv_b_proj)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(num_tokens, -1), k_pe.contiguous())
        metadata: Any = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata[self.layer_name]
        out = self.impl.forward(q_nope, q_pe.view(num_tokens, self.num_heads, self.qk_rope_head_dim), c_kv, k_pe,
                                self.kv_cache, metadata)
        return self.o_proj(out)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"rope={self.qk_rope_head_dim}, nope={self.qk_nope_head_dim}, v={self.v_head_dim}, backend=MLA")
