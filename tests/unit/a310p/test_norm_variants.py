"""GemmaRMSNorm / RMSNormGated vs transformers' own modules (Gemma, Qwen3-Next) and a float64 definition for the
variants transformers does not have (group-wise, gate before norm, sigmoid); SiluAndMulComposed vs SiluAndMul."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

from ascent.layers.activation import SiluAndMul
from ascent.layers.activation_compat import SiluAndMulComposed
from ascent.layers.norm_variants import GemmaRMSNorm, RMSNormGated

HIDDEN = 64
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul_(3).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return a.dtype == b.dtype and torch.allclose(a.double(), b.double(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hf_cls", [HFGemmaRMSNorm, Qwen3NextRMSNorm])
def test_gemma_rmsnorm_matches_transformers(dtype: torch.dtype, hf_cls: type) -> None:
    ours = GemmaRMSNorm(HIDDEN, eps=1e-6, dtype=dtype)
    assert torch.count_nonzero(ours.weight) == 0
    weight = rand(HIDDEN, seed=1) * 0.1
    ours.weight.data.copy_(weight.to(dtype))
    hf = hf_cls(HIDDEN, eps=1e-6).to(dtype)
    hf.weight.data.copy_(weight.to(dtype))
    x = rand(5, 3, HIDDEN, dtype=dtype)
    with torch.no_grad():
        assert close(ours(x), hf(x), dtype)
        residual = rand(5, 3, HIDDEN, dtype=torch.float32, seed=2)
        normed, new_residual = ours(x, residual)
        s = x + residual.to(dtype)
        assert new_residual.dtype == torch.float32 and torch.equal(new_residual, s.float())
        assert close(normed, hf(s), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_norm_matches_qwen3_next(dtype: torch.dtype) -> None:
    ours = RMSNormGated(HIDDEN, eps=1e-6, dtype=dtype)
    hf = Qwen3NextRMSNormGated(HIDDEN, eps=1e-6).to(dtype)
    weight = (1 + rand(HIDDEN, seed=3) * 0.2).to(dtype)
    ours.weight.data.copy_(weight)
    hf.weight.data.copy_(weight)
    x, z = rand(7, HIDDEN, dtype=dtype, seed=4), rand(7, HIDDEN, dtype=dtype, seed=5)
    with torch.no_grad():
        assert close(ours(x, z), hf(x, z), dtype)


def gated_definition(x: torch.Tensor, z: torch.Tensor | None, w: torch.Tensor, eps: float, group: int | None,
                     before: bool, act: str) -> torch.Tensor:
    """float64, element by element over groups: y = norm(x) * w * act(z) or norm(x * act(z)) * w."""
    x, w = x.double(), w.double()
    gate = None if z is None else (torch.sigmoid(z.double()) if act == "sigmoid" else torch.nn.functional.silu(
        z.double()))
    if gate is not None and not before:
        x = x * gate
    g = group or x.shape[-1]
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], g):
        part = x[..., start : start + g]
        out[..., start : start + g] = part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + eps)
    out = out * w
    return out * gate if gate is not None and before else out


@pytest.mark.parametrize("group", [None, 16])
@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_gated_norm_variants_match_definition(group: int | None, before: bool, act: str) -> None:
    norm = RMSNormGated(HIDDEN, eps=1e-5, group_size=group, norm_before_gate=before, activation=act)
    norm.weight.data.copy_(1 + rand(HIDDEN, seed=6) * 0.3)
    x, z = rand(4, 2, HIDDEN, seed=7), rand(4, 2, HIDDEN, seed=8)
    expected = gated_definition(x, z, norm.weight, 1e-5, group, before, act)
    assert torch.allclose(norm(x, z).double(), expected, rtol=1e-5, atol=1e-5)
    no_gate = gated_definition(x, None, norm.weight, 1e-5, group, before, act)
    assert torch.allclose(norm(x).double(), no_gate, rtol=1e-5, atol=1e-5)


def test_gated_norm_validation() -> None:
    with pytest.raises(ValueError, match="'gelu'"):
        RMSNormGated(HIDDEN, activation="gelu")
    with pytest.raises(ValueError, match="group_size 10"):
        RMSNormGated(HIDDEN, group_size=10)
    with pytest.raises(ValueError, match="gate shape"):
        RMSNormGated(HIDDEN)(rand(2, HIDDEN), rand(3, HIDDEN))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul_composed_equals_silu_and_mul(dtype: torch.dtype) -> None:
    x = rand(6, 2, 2 * 48, dtype=dtype, seed=9)
    out = SiluAndMulComposed()(x)
    assert out.shape == (6, 2, 48) and torch.equal(out, SiluAndMul()(x))
    d = x.double()
    expected = d[..., :48] / (1 + torch.exp(-d[..., :48])) * d[..., 48:]
    assert torch.allclose(out.double(), expected, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    with pytest.raises(ValueError, match="got 5"):
        SiluAndMulComposed()(torch.ones(2, 5))
