"""Rotary position embeddings (RoPE) with the scaling variants used by Llama/Qwen-family configs.

Supported ``rope_type`` values: ``default``, ``linear``, ``dynamic`` (NTK, static at the extended length),
``llama3``, ``yarn`` (with the attention factor / mscale folded into cos and sin). Frequencies follow the formulas of
the RoPE, NTK, YaRN and Llama-3.1 papers; ``tests/unit/test_rotary.py`` checks them against transformers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ascent.layers.cpu_kernels import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ROPE_TYPES_WITH_ORIGINAL_MAX = ("llama3", "yarn", "longrope")  # types whose dict carries the pretraining length


def rope_parameters_from_config(hf_config: Any) -> dict[str, Any]:
    """The RoPE dict of a HF config: ``config.rope_parameters`` (transformers 5), else ``rope_scaling`` +
    ``rope_theta`` (older dicts). Always has ``rope_type`` and ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    freq_factors = getattr(hf_config, "rope_freq_factors", None)  # GGUF rope_freqs (llama.cpp's freq_factors)
    if freq_factors is not None:
        params["freq_factors"] = [float(f) for f in freq_factors]
    top_level_original = getattr(hf_config, "original_max_position_embeddings", None)
    if params["rope_type"] in ROPE_TYPES_WITH_ORIGINAL_MAX and isinstance(top_level_original, int):
        # A top-level pretraining length (Phi-3-style configs) wins over the rope dict's, as transformers'
        # standardize_rope_params and vLLM's patch_rope_parameters decide.
        params["original_max_position_embeddings"] = top_level_original
    return params


def _base_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any], original_max: int) -> torch.Tensor:
    factor = params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original_max / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= original_max / high) & (wavelen <= original_max / low)
    return torch.where(medium, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, rotary_dim: int, params: dict[str, Any], factor: float, original_max: int
) -> tuple[torch.Tensor, float]:
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation_weight = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation_weight) + 1.0 / pos_freqs * extrapolation_weight
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    rotary_dim: int, max_position: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float, int]:
    """``(inv_freq fp32 [rotary_dim/2], attention_factor, cache_len)`` for a RoPE parameter dict.

    ``cache_len`` is the number of positions the cos/sin cache must cover (scaled types extend the context).
    ``freq_factors`` ([rotary_dim/2], from a GGUF's ``rope_freqs``) divide the frequencies, as in llama.cpp.
    """
    inv_freq, attention_factor, cache_len = _scaled_inv_freq(rotary_dim, max_position, params)
    factors = params.get("freq_factors")
    if factors is not None:
        if len(factors) != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {len(factors)} entries, expected rotary_dim / 2 = "
                             f"{inv_freq.numel()}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, attention_factor, cache_len


def _scaled_inv_freq(rotary_dim: int, max_position: int, params: dict[str, Any]) -> tuple[torch.Tensor, float, int]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", 10000.0))
    original_max = int(params.get("original_max_position_embeddings") or max_position)
    if rope_type == "default":
        return _base_inv_freq(base, rotary_dim), 1.0, max_position
    if rope_type == "linear":
        factor = float(params["factor"])
        return _base_inv_freq(base, rotary_dim) / factor, 1.0, max(max_position, int(max_position * factor))
    if rope_type == "dynamic":
        factor = float(params["factor"])
        cache_len = int(max_position * factor)
        scaled = base * ((factor * cache_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return _base_inv_freq(scaled, rotary_dim), 1.0, cache_len
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(base, rotary_dim), params, original_max), 1.0, max_position
    if rope_type == "yarn":
        factor = params.get("factor") or max_position / original_max
        inv_freq, attention_factor = _yarn_inv_freq(base, rotary_dim, params, float(factor), original_max)
        return inv_freq, attention_factor, max(max_position, int(original_max * factor))
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` dims of every head; the rest passes through.

    ``cos_sin_cache`` (buffer, model dtype) has shape ``[cache_len, 2 * rotary_dim]``: the cosines expanded to the
    full rotary dim, then the sines expanded and signed so that ``x' = x * cos + pair_swap(x) * sin`` — NeoX style
    pairs dims ``(i, i + rotary_dim/2)``, GPT-J style pairs ``(2i, 2i+1)``. The attention factor (YaRN mscale) is
    folded into both.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        rope_parameters: dict[str, Any],
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq, self.attention_factor, self.max_position = compute_inv_freq(rotary_dim, max_position, rope_parameters)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cache = self._build_cache(inv_freq, self.attention_factor, self.max_position)
        self.register_buffer("cos_sin_cache", cache.to(dtype or torch.get_default_dtype()), persistent=False)
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused = fused_ops()

    def _build_cache(self, inv_freq: torch.Tensor, attention_factor: float, cache_len: int) -> torch.Tensor:
        freqs = torch.outer(torch.arange(cache_len, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        if self.is_neox_style:
            return torch.cat([cos, cos, -sin, sin], dim=-1)
        cos_full = torch.stack([cos, cos], dim=-1).flatten(-2)
        sin_full = torch.stack([-sin, sin], dim=-1).flatten(-2)
        return torch.cat([cos_full, sin_full], dim=-1)

    def _pair_swap(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            half = self.rotary_dim // 2
            return torch.cat([x[..., half:], x[..., :half]], dim=-1)
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack([pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)
        if self.rotary_dim == self.head_size:
            return (x * cos + self._pair_swap(x) * sin).view(num_tokens, -1)
        rot = x[..., : self.rotary_dim]
        rotated = rot * cos + self._pair_swap(rot) * sin
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1).view(num_tokens, -1)

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        """``[T, 2 * rotary_dim]`` cache rows of ``positions`` (expanded cos, then signed sin); inside
        ``step_cache(positions)`` the gather is done once and shared by every layer."""
        cached = self._step
        if cached is not None and cached[0] is positions:
            return cached[1]
        return self.cos_sin_cache.index_select(0, positions)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[T, 1, rotary_dim]``, for ``positions``."""
        cos, sin = self._rows(positions).unsqueeze(1).split(self.rotary_dim, dim=-1)
        return cos, sin

    @contextmanager
    def step_cache(self, positions: torch.Tensor) -> Iterator[None]:
        """Within the block, cos/sin of ``positions`` (this tensor object, whose contents must not change) are
        gathered once; a model forward wraps its layer loop in it. Nests (the outer cache is restored)."""
        previous = self._step
        self._step = (positions, self.cos_sin_cache.index_select(0, positions))
        try:
            yield
        finally:
            self._step = previous

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 ``[T]``; q ``[T, nh*head_size]``, k ``[T, nkv*head_size]`` -> rotated (new tensors)."""
        cos, sin = self.cos_sin(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads*head_size]`` in place (it may be a column slice of a wider row-major tensor, e.g.
        the q and k columns of a fused QKV output, so q and k rotate in one pass); returns ``x``. Same values as
        ``forward``."""
        if self._fused is not None and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1:
            rows = self._rows(positions)
            if rows.dtype == x.dtype:
                self._fused.rotary_(x, rows, self.head_size, self.rotary_dim, self.is_neox_style)
                return x
        cos, sin = self.cos_sin(positions)
        heads = x.view(x.shape[0], -1, self.head_size)
        if self.rotary_dim < self.head_size:
            heads = heads[..., : self.rotary_dim]
        swapped = self._pair_swap(heads)
        heads.mul_(cos)
        heads.add_(swapped.mul_(sin))
        return x

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    rope_parameters: dict[str, Any] | None = None,
    is_neox_style: bool = True,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """Build the RoPE module for ``rope_parameters`` (a HF ``rope_parameters`` dict; None = default, theta 1e4)."""
    params = dict(rope_parameters or {})
    params.setdefault("rope_type", params.get("type", "default"))
    return RotaryEmbedding(head_size, rotary_dim, max_position, params, is_neox_style, dtype)
