"""MoE routers: router logits ``[T, E]`` -> routing weights fp32 ``[T, k]`` and logical expert ids int32 ``[T, k]``.

Golden semantics (specs/eplb_moe_lora.md §5.1): scores = softmax or sigmoid of the logits in fp32; an optional
``e_score_correction_bias [E]`` is added for *selection only*; grouped routing keeps the ``topk_group`` best of
``num_expert_group`` groups (group score = sum of the group's top-2 biased scores, DeepSeek-V3 ``noaux_tc``, or the
group max, DeepSeek-V2 ``group_limited_greedy``) and masks the other groups at -inf; top-k among the eligible
experts; weights = unbiased scores at the chosen ids, renormalised (sum + 1e-20) when asked, then multiplied by
``routed_scaling_factor``. The arithmetic runs in the device adaptor's ``moe_gating_top_k``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ascent.platform.adaptor import DeviceAdaptor
from ascent.platform.profile import HardwareCapability, HardwareProfile

SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORES = ("sum_top2", "max")
CHUNK_310P = 1024


class Router(ABC):
    """Selects ``top_k`` of ``num_experts`` experts per token."""

    def __init__(self, num_experts: int, top_k: int, renormalize: bool, routed_scaling_factor: float,
                 adaptor: DeviceAdaptor) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.adaptor = adaptor

    def route(self, router_logits: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits ``[T, E]`` (any float dtype), bias fp32 ``[E]`` or None ->
        (weights fp32 ``[T, k]``, ids int32 ``[T, k]``)."""
        if router_logits.dim() != 2 or router_logits.shape[1] != self.num_experts:
            raise ValueError(f"router_logits shape {tuple(router_logits.shape)} must be [T, {self.num_experts}]")
        return self._route(router_logits, bias)

    @abstractmethod
    def _route(self, router_logits: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's selection (inputs validated)."""


def _check_scoring(scoring_func: str) -> int:
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func!r} must be one of {SCORING_FUNCS}")
    return SCORING_FUNCS.index(scoring_func)


class TopKRouter(Router):
    """Plain top-k over softmax (Qwen3-MoE, Mixtral; ``renormalize`` = ``norm_topk_prob``) or sigmoid scores
    (optionally with a selection bias)."""

    def __init__(self, num_experts: int, top_k: int, renormalize: bool = True, scoring_func: str = "softmax",
                 routed_scaling_factor: float = 1.0, adaptor: DeviceAdaptor | None = None) -> None:
        super().__init__(num_experts, top_k, renormalize, routed_scaling_factor, adaptor or DeviceAdaptor())
        self.norm_type = _check_scoring(scoring_func)

    def _route(self, router_logits: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, _ = self.adaptor.moe_gating_top_k(
            router_logits, k=self.top_k, renorm=self.renormalize, norm_type=self.norm_type,
            routed_scaling_factor=self.routed_scaling_factor, bias=bias)
        return weights, ids


class GroupedTopKRouter(Router):
    """DeepSeek grouped top-k: experts split into ``num_expert_group`` equal groups, only the ``topk_group`` best
    groups are eligible (``group_score`` "sum_top2" = V3, "max" = V2's group_limited_greedy)."""

    def __init__(self, num_experts: int, top_k: int, num_expert_group: int, topk_group: int,
                 renormalize: bool = True, scoring_func: str = "sigmoid", group_score: str = "sum_top2",
                 routed_scaling_factor: float = 1.0, adaptor: DeviceAdaptor | None = None) -> None:
        super().__init__(num_experts, top_k, renormalize, routed_scaling_factor, adaptor or DeviceAdaptor())
        self.norm_type = _check_scoring(scoring_func)
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
        if top_k > topk_group * (num_experts // num_expert_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group * (num_experts // num_expert_group)} experts "
                             f"of {topk_group} selected groups")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={group_score!r} must be one of {GROUP_SCORES}")
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.group_select_mode = 1 if group_score == "sum_top2" else 0

    def _route(self, router_logits: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, _ = self.adaptor.moe_gating_top_k(
            router_logits, k=self.top_k, k_group=self.topk_group, group_count=self.num_expert_group,
            group_select_mode=self.group_select_mode, renorm=self.renormalize, norm_type=self.norm_type,
            routed_scaling_factor=self.routed_scaling_factor, bias=bias)
        return weights, ids


class ChunkedSoftmaxTopKRouter(Router):
    """310P router: softmax top-k only (no groups, no bias); logits are cast to fp16 and processed in chunks of at
    most ``chunk_size`` tokens (a memory bound; the result does not depend on it)."""

    def __init__(self, num_experts: int, top_k: int, renormalize: bool = True, routed_scaling_factor: float = 1.0,
                 adaptor: DeviceAdaptor | None = None, chunk_size: int = CHUNK_310P) -> None:
        super().__init__(num_experts, top_k, renormalize, routed_scaling_factor, adaptor or DeviceAdaptor())
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1")
        self.chunk_size = chunk_size

    def _route(self, router_logits: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if bias is not None:
            raise ValueError("the 310P chunked softmax router takes no e_score_correction_bias")
        logits = router_logits.to(torch.float16)
        weights, ids = [], []
        for start in range(0, max(logits.shape[0], 1), self.chunk_size):
            w, i, _ = self.adaptor.moe_gating_top_k(
                logits[start: start + self.chunk_size], k=self.top_k, renorm=self.renormalize, norm_type=0,
                routed_scaling_factor=self.routed_scaling_factor)
            weights.append(w)
            ids.append(i)
        return torch.cat(weights), torch.cat(ids)


def create_router(num_experts: int, top_k: int, *, renormalize: bool = True, scoring_func: str = "softmax",
                  use_grouped_topk: bool = False, num_expert_group: int | None = None,
                  topk_group: int | None = None, has_bias: bool = False, routed_scaling_factor: float = 1.0,
                  adaptor: DeviceAdaptor | None = None, profile: HardwareProfile | None = None) -> Router:
    """The router for a FusedMoE configuration.

    Grouped routing uses the sum-of-top-2 group score when a correction bias is present (DeepSeek-V3) and the group
    max otherwise (DeepSeek-V2). A profile with ``FUSED_MOE_COMPATIBILITY`` (310P) gets the chunked fp16 softmax
    router for plain softmax routing; grouped or sigmoid routing there uses the generic routers.
    """
    _check_scoring(scoring_func)
    if use_grouped_topk:
        if num_expert_group is None or topk_group is None:
            raise ValueError(f"use_grouped_topk needs num_expert_group ({num_expert_group}) and topk_group "
                             f"({topk_group})")
        return GroupedTopKRouter(num_experts, top_k, num_expert_group, topk_group, renormalize, scoring_func,
                                 "sum_top2" if has_bias else "max", routed_scaling_factor, adaptor)
    compat = profile is not None and profile.supports(HardwareCapability.FUSED_MOE_COMPATIBILITY)
    if compat and scoring_func == "softmax" and not has_bias:
        return ChunkedSoftmaxTopKRouter(num_experts, top_k, renormalize, routed_scaling_factor, adaptor)
    return TopKRouter(num_experts, top_k, renormalize, scoring_func, routed_scaling_factor, adaptor)
