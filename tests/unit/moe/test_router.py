"""Routers against a naive per-token float64 loop (selection by sort with ties to the lower id, groups, bias,
renormalisation, scaling) and router selection by configuration and hardware profile."""

from __future__ import annotations

import pytest
import torch

from ascent.layers.fused_moe.router import (
    ChunkedSoftmaxTopKRouter,
    GroupedTopKRouter,
    TopKRouter,
    create_router,
)
from ascent.platform import A310PDeviceAdaptor, get_hardware_profile
from tests.unit.moe.helpers import naive_route


def check(router, logits: torch.Tensor, bias: torch.Tensor | None, **naive) -> None:
    weights, ids = router.route(logits, bias)
    ref_ids, ref_w = naive_route(logits, router.top_k, bias=bias, **naive)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == ref_ids
    torch.testing.assert_close(weights.double(), torch.tensor(ref_w, dtype=torch.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk(renorm: bool) -> None:
    torch.manual_seed(0)
    logits = torch.randn(37, 8) * 2
    check(TopKRouter(8, 2, renorm), logits, None, renorm=renorm)


def test_softmax_topk_scaled_bf16_logits() -> None:
    torch.manual_seed(1)
    logits = (torch.randn(11, 16) * 3).to(torch.bfloat16)
    check(TopKRouter(16, 4, True, routed_scaling_factor=2.5), logits, None, scale=2.5)


def test_sigmoid_topk_with_bias_weights_are_unbiased() -> None:
    torch.manual_seed(2)
    logits, bias = torch.randn(20, 8), torch.randn(8)
    check(TopKRouter(8, 3, True, "sigmoid"), logits, bias, scoring="sigmoid")
    check(TopKRouter(8, 3, False, "sigmoid"), logits, bias, scoring="sigmoid", renorm=False)


@pytest.mark.parametrize("group_score", ["sum_top2", "max"])
def test_grouped_topk(group_score: str) -> None:
    torch.manual_seed(3)
    logits, bias = torch.randn(40, 16), torch.randn(16) * 0.3
    scoring = "sigmoid" if group_score == "sum_top2" else "softmax"
    router = GroupedTopKRouter(16, 4, 4, 2, True, scoring, group_score, 2.5)
    check(router, logits, bias if group_score == "sum_top2" else None, scoring=scoring, groups=4, topk_group=2,
          group_score=group_score, scale=2.5)


def test_grouped_topk_masks_dropped_groups_at_minus_inf() -> None:
    """All biased scores negative: a dropped group masked with 0.0 (HF's native path) would win; -inf never does."""
    torch.manual_seed(4)
    logits, bias = torch.randn(25, 8), torch.full((8,), -3.0) + torch.rand(8) * 0.1
    router = GroupedTopKRouter(8, 2, 4, 1, True, "sigmoid", "sum_top2")
    weights, ids = router.route(logits, bias)
    groups = (ids // 2).tolist()
    assert all(g[0] == g[1] for g in groups)  # one group kept -> both picks from it
    check(router, logits, bias, scoring="sigmoid", groups=4, topk_group=1)


def test_grouped_topk_v2_group_limited_greedy() -> None:
    torch.manual_seed(5)
    logits = torch.randn(30, 8)
    router = GroupedTopKRouter(8, 2, 2, 1, False, "softmax", "max", 1.0)
    check(router, logits, None, groups=2, topk_group=1, group_score="max", renorm=False)


@pytest.mark.parametrize("renorm", [True, False])
def test_310p_chunked_softmax_equals_unchunked_fp16(renorm: bool) -> None:
    torch.manual_seed(6)
    logits = torch.randn(10, 8) * 2
    router = ChunkedSoftmaxTopKRouter(8, 2, renorm, 1.5, A310PDeviceAdaptor(), chunk_size=3)
    check(router, logits.half().float(), None, renorm=renorm, scale=1.5)
    w, ids = router.route(logits)
    w_one, ids_one = ChunkedSoftmaxTopKRouter(8, 2, renorm, 1.5, chunk_size=1024).route(logits)
    assert torch.equal(ids, ids_one) and torch.equal(w, w_one)
    with pytest.raises(ValueError, match="bias"):
        router.route(logits, torch.zeros(8))


def test_create_router_selection() -> None:
    p310, cpu = get_hardware_profile("310p"), get_hardware_profile("cpu")
    assert isinstance(create_router(8, 2, profile=p310), ChunkedSoftmaxTopKRouter)
    assert isinstance(create_router(8, 2, profile=cpu), TopKRouter)
    assert isinstance(create_router(8, 2, scoring_func="sigmoid", has_bias=True, profile=p310), TopKRouter)
    v3 = create_router(8, 2, scoring_func="sigmoid", use_grouped_topk=True, num_expert_group=4, topk_group=2,
                       has_bias=True)
    v2 = create_router(8, 2, use_grouped_topk=True, num_expert_group=4, topk_group=2)
    assert isinstance(v3, GroupedTopKRouter) and v3.group_select_mode == 1
    assert isinstance(v2, GroupedTopKRouter) and v2.group_select_mode == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(use_grouped_topk=True, num_expert_group=3, topk_group=1), "num_expert_group=3"),
    (dict(use_grouped_topk=True, num_expert_group=4, topk_group=5), "topk_group=5"),
    (dict(use_grouped_topk=True, num_expert_group=4), "topk_group"),
])
def test_create_router_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_router(8, 2, **kwargs)


def test_route_rejects_bad_shapes_and_top_k() -> None:
    with pytest.raises(ValueError, match="top_k=9"):
        TopKRouter(8, 9)
    with pytest.raises(ValueError, match="router_logits shape"):
        TopKRouter(8, 2).route(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="top_k=5"):
        GroupedTopKRouter(8, 5, 4, 2)
