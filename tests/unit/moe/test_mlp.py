"""Unified expert MLP against a per-expert loop of dense gated MLPs; the group_list contract and its conversions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascent.layers.fused_moe.mlp import cumsum_group_list, unified_apply_mlp


def per_expert_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int],
                    act=F.silu) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    row = 0
    for e, n in enumerate(counts):
        xs = x[row: row + n].double()
        inter = w2.shape[2]
        gate, up = xs @ w13[e, :inter].double().T, xs @ w13[e, inter:].double().T
        out[row: row + n] = (act(gate) * up) @ w2[e].double().T
        row += n
    return out


@pytest.fixture
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4, 2 * 8, 16) * 0.3, torch.randn(4, 16, 8) * 0.3


@pytest.mark.parametrize("group_list_type, group_list", [
    (1, [3, 0, 5, 2]),
    (0, [3, 3, 8, 10]),
    (2, [[0, 3], [2, 5], [3, 2], [0, 0]]),
])
def test_matches_per_expert_loop(weights, group_list_type: int, group_list: list) -> None:
    w13, w2 = weights
    x = torch.randn(10, 16)
    out = unified_apply_mlp(x, w13, w2, torch.tensor(group_list), group_list_type)
    torch.testing.assert_close(out.double(), per_expert_loop(x, w13, w2, [3, 0, 5, 2]), rtol=1e-5, atol=1e-6)


def test_gelu_activations_and_row_scales(weights) -> None:
    w13, w2 = weights
    x = torch.randn(6, 16)
    counts = torch.tensor([1, 2, 0, 3])
    scales = torch.rand(6)
    gelu_tanh = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    for name, act in (("gelu", F.gelu), ("gelu_tanh", gelu_tanh)):
        out = unified_apply_mlp(x, w13, w2, counts, 1, name)
        torch.testing.assert_close(out.double(), per_expert_loop(x, w13, w2, [1, 2, 0, 3], act), rtol=1e-5,
                                   atol=1e-6)
    scaled = unified_apply_mlp(x, w13, w2, counts, 1, topk_scales=scales)
    ref = per_expert_loop(x, w13, w2, [1, 2, 0, 3]) * scales[:, None].double()  # the down proj is linear
    torch.testing.assert_close(scaled.double(), ref, rtol=1e-5, atol=1e-6)


def test_rows_past_last_group_are_zero(weights) -> None:
    w13, w2 = weights
    out = unified_apply_mlp(torch.randn(7, 16), w13, w2, torch.tensor([1, 1, 1, 1]), 1)
    assert torch.count_nonzero(out[4:]) == 0


def test_bf16_close_to_fp32(weights) -> None:
    w13, w2 = weights
    x = torch.randn(10, 16)
    counts = torch.tensor([3, 0, 5, 2])
    out = unified_apply_mlp(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), counts)
    assert out.dtype == torch.bfloat16
    ref = per_expert_loop(x, w13, w2, [3, 0, 5, 2])
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_group_list_fixture_conversions() -> None:
    counts, cumsum = torch.tensor([0, 2, 1, 0]), torch.tensor([0, 2, 3, 3])
    pairs = torch.tensor([[1, 2], [2, 1], [0, 0], [0, 0]])
    assert cumsum_group_list(counts, 1, 0).tolist() == cumsum.tolist()
    assert cumsum_group_list(cumsum, 0, 1).tolist() == counts.tolist()
    assert cumsum_group_list(cumsum, 0, 0).tolist() == cumsum.tolist()
    assert cumsum_group_list(counts, 1, 1).tolist() == counts.tolist()
    assert cumsum_group_list(pairs, 2, 0, num_experts=4).tolist() == cumsum.tolist()


@pytest.mark.parametrize("src, dst", [(0, 2), (2, 1), (1, 2), (2, 0), (0, 1), (1, 0)])
def test_group_list_all_conversions_round_trip(src: int, dst: int) -> None:
    counts = torch.tensor([2, 0, 3, 0, 1])
    forms = {1: counts, 0: counts.cumsum(0), 2: torch.tensor([[0, 2], [2, 3], [4, 1]])}
    out = cumsum_group_list(forms[src], src, dst, num_experts=5)
    assert torch.equal(out, forms[dst])


def test_group_list_validation(weights) -> None:
    w13, w2 = weights
    with pytest.raises(ValueError, match=r"group_list_type should be in \[0, 1, 2\], but received 3"):
        cumsum_group_list(torch.tensor([1]), 3, 0)
    with pytest.raises(ValueError, match="num_experts"):
        cumsum_group_list(torch.tensor([[0, 1]]), 2, 0)
    with pytest.raises(ValueError, match="outside"):
        cumsum_group_list(torch.tensor([[5, 1]]), 2, 0, num_experts=4)
    with pytest.raises(ValueError, match="activation='relu'"):
        unified_apply_mlp(torch.zeros(1, 16), w13, w2, torch.tensor([1, 0, 0, 0]), activation="relu")
    with pytest.raises(ValueError, match="x shape"):
        unified_apply_mlp(torch.zeros(1, 15), w13, w2, torch.tensor([1, 0, 0, 0]))
    with pytest.raises(ValueError, match="does not fit"):
        unified_apply_mlp(torch.zeros(2, 16), w13, w2, torch.tensor([1, 2, 0, 0]))
