"""RoPE frequencies, cos/sin and application vs transformers (ROPE_INIT_FUNCTIONS, LlamaRotaryEmbedding,
apply_rotary_pos_emb) and vs the complex-number formulation for GPT-J style."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ascent.layers.rotary import get_rope, rope_parameters_from_config

HEAD, MAX_POS = 32, 256

ROPE_CASES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                        mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2),
    "yarn-attn-factor": dict(rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=128,
                             attention_factor=1.3, truncate=False),
}


def hf_config(params: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * HEAD, num_attention_heads=4, head_dim=HEAD, max_position_embeddings=MAX_POS,
                       rope_parameters=dict(params))


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_cos_sin_and_apply_match_transformers(case: str) -> None:
    config = hf_config(ROPE_CASES[case])
    params = rope_parameters_from_config(config)
    rope = get_rope(HEAD, HEAD, MAX_POS, params, is_neox_style=True, dtype=torch.float32)
    if params["rope_type"] == "default":
        ref_inv, ref_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    torch.testing.assert_close(rope.inv_freq, ref_inv, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(ref_factor, rel=1e-12)

    hf_rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, MAX_POS - 1])
    x = torch.zeros(1, positions.numel(), 1)
    cos, sin = hf_rope(x, positions[None])
    cache = rope.cos_sin_cache[positions]
    half = HEAD // 2
    torch.testing.assert_close(cache[:, :HEAD], cos[0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(cache[:, HEAD:], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1), rtol=1e-5,
                               atol=2e-5)
    q, k = torch.randn(positions.numel(), 4 * HEAD), torch.randn(positions.numel(), 2 * HEAD)
    ref_q, ref_k = apply_rotary_pos_emb(q.view(1, -1, 4, HEAD), k.view(1, -1, 2, HEAD), cos, sin, unsqueeze_dim=2)
    out_q, out_k = rope(positions, q, k)
    torch.testing.assert_close(out_q, ref_q.reshape_as(q), rtol=1e-5, atol=3e-5)
    torch.testing.assert_close(out_k, ref_k.reshape_as(k), rtol=1e-5, atol=3e-5)


def test_dynamic_ntk_is_static_at_extended_length() -> None:
    params = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    config = hf_config(params)
    rope = get_rope(HEAD, HEAD, MAX_POS, rope_parameters_from_config(config))
    ref_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, torch.device("cpu"), seq_len=2 * MAX_POS)
    torch.testing.assert_close(rope.inv_freq, ref_inv, rtol=1e-6, atol=0)
    assert rope.cos_sin_cache.shape == (2 * MAX_POS, 2 * HEAD)


def test_partial_rotary_neox() -> None:
    rotary_dim = 8
    config = LlamaConfig(hidden_size=4 * HEAD, num_attention_heads=4, head_dim=rotary_dim,
                         max_position_embeddings=MAX_POS, rope_parameters=dict(rope_type="default", rope_theta=100.0))
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(20)[None])
    rope = get_rope(HEAD, rotary_dim, MAX_POS, dict(rope_type="default", rope_theta=100.0))
    positions = torch.arange(20)
    q, k = torch.randn(20, 2 * HEAD), torch.randn(20, HEAD)
    out_q, out_k = rope(positions, q, k)
    for x, out in ((q, out_q), (k, out_k)):
        heads = x.view(1, 20, -1, HEAD)
        rotated, _ = apply_rotary_pos_emb(heads[..., :rotary_dim], heads[..., :rotary_dim], cos, sin, unsqueeze_dim=2)
        expected = torch.cat([rotated, heads[..., rotary_dim:]], dim=-1).reshape_as(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [HEAD, 16])
def test_gptj_style_matches_complex_rotation(rotary_dim: int) -> None:
    theta = 10000.0
    rope = get_rope(HEAD, rotary_dim, MAX_POS, dict(rope_theta=theta), is_neox_style=False, dtype=torch.float64)
    positions = torch.tensor([0, 3, 17, 100])
    q, k = torch.randn(4, 3 * HEAD, dtype=torch.float64), torch.randn(4, HEAD, dtype=torch.float64)
    out_q, out_k = rope(positions, q, k)
    freqs = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    phase = torch.polar(torch.ones(4, rotary_dim // 2, dtype=torch.float64), positions[:, None] * freqs)
    for x, out in ((q, out_q), (k, out_k)):
        heads = x.view(4, -1, HEAD)
        as_complex = torch.view_as_complex(heads[..., :rotary_dim].reshape(4, heads.shape[1], -1, 2).contiguous())
        rotated = torch.view_as_real(as_complex * phase[:, None]).flatten(-2)
        expected = torch.cat([rotated, heads[..., rotary_dim:]], dim=-1).reshape_as(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_legacy_rope_fields_and_errors() -> None:
    class Legacy:
        rope_theta = 5e5
        rope_scaling = {"type": "linear", "factor": 2.0}

    params = rope_parameters_from_config(Legacy())
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5e5 and params["factor"] == 2.0
    with pytest.raises(ValueError, match="longrope"):
        get_rope(HEAD, HEAD, MAX_POS, dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0]))
    with pytest.raises(ValueError, match="rotary_dim 40"):
        get_rope(HEAD, 40, MAX_POS, None)


@pytest.mark.parametrize("neox,rotary_dim,dtype", [(True, HEAD, torch.bfloat16), (False, HEAD, torch.float32),
                                                   (True, HEAD // 2, torch.bfloat16)])
def test_rotate_inplace_on_fused_qkv_equals_forward(neox: bool, rotary_dim: int, dtype: torch.dtype) -> None:
    """``rotate_`` on the q+k columns of a fused QKV output gives forward's values bitwise and leaves v alone;
    ``step_cache`` shares one cos/sin gather and restores the previous cache on exit."""
    rope = get_rope(HEAD, rotary_dim, MAX_POS, {"rope_theta": 10000.0}, is_neox_style=neox, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    nq, nkv, tokens = 4, 2, 7
    qkv = torch.randn(tokens, (nq + 2 * nkv) * HEAD, generator=gen).to(dtype)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen)
    q, k, v = qkv.split([nq * HEAD, nkv * HEAD, nkv * HEAD], dim=-1)
    want_q, want_k = rope(positions, q, k)
    v_before = v.clone()
    with rope.step_cache(positions):
        assert rope._rows(positions) is rope._rows(positions)  # gathered once per step
        rope.rotate_(positions, qkv[:, : (nq + nkv) * HEAD])
    assert rope._rows(positions) is not rope._rows(positions)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v_before)
