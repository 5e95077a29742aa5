"""Shared helpers for the MoE tests: a naive float64 per-token router, random expert checkpoints, loading them
through the layer's weight loader, and a naive per-token float64 reference of the routed-expert computation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ascent.layers.fused_moe import FusedMoE, make_expert_params_mapping


def naive_route(logits: torch.Tensor, k: int, scoring: str = "softmax", renorm: bool = True,
                bias: torch.Tensor | None = None, groups: int = 1, topk_group: int = 1, group_score: str = "sum_top2",
                scale: float = 1.0) -> tuple[list[list[int]], list[list[float]]]:
    """Golden routing semantics, one token at a time: ids sorted by descending selection score (ties -> lower id),
    dropped groups never eligible, weights = unbiased scores (renormalised, scaled)."""
    ids_out, w_out = [], []
    num_experts = logits.shape[1]
    per_group = num_experts // groups
    for row in logits.double().tolist():
        if scoring == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        eligible = list(range(num_experts))
        if groups > 1:
            gscore = []
            for g in range(groups):
                members = sorted(choice[g * per_group: (g + 1) * per_group], reverse=True)
                gscore.append(sum(members[:2]) if group_score == "sum_top2" else members[0])
            kept = sorted(range(groups), key=lambda g: (-gscore[g], g))[:topk_group]
            eligible = [e for e in eligible if e // per_group in kept]
        chosen = sorted(eligible, key=lambda e: (-choice[e], e))[:k]
        weights = [scores[e] for e in chosen]
        if renorm:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
        ids_out.append(chosen)
        w_out.append([w * scale for w in weights])
    return ids_out, w_out


def random_experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-style per-expert checkpoint tensors ``experts.{e}.{gate,up,down}_proj.weight``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(num_experts):
        out[f"experts.{e}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.2
        out[f"experts.{e}.up_proj.weight"] = torch.randn(inter, hidden, generator=g) * 0.2
        out[f"experts.{e}.down_proj.weight"] = torch.randn(hidden, inter, generator=g) * 0.2
    return out


def load_experts(layer: FusedMoE, ckpt: dict[str, torch.Tensor]) -> int:
    """Feed every checkpoint tensor to the layer's weight loader; returns how many landed in a local slot."""
    params = dict(layer.named_parameters())
    landed = 0
    for param_name, fragment, expert_id, shard_id in make_expert_params_mapping(layer.num_experts):
        name = f"{fragment}weight"
        param = params[param_name.removeprefix("experts.")]
        landed += bool(param.weight_loader(param, ckpt[name], name, shard_id, expert_id))
    return landed


def naive_moe(x: torch.Tensor, logits: torch.Tensor, ckpt: dict[str, torch.Tensor], top_k: int,
              **route) -> torch.Tensor:
    """``out[t] = sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t)`` token by token in float64."""
    ids, weights = naive_route(logits, top_k, **route)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for e, w in zip(ids[t], weights[t]):
            gate = ckpt[f"experts.{e}.gate_proj.weight"].double() @ xt
            up = ckpt[f"experts.{e}.up_proj.weight"].double() @ xt
            out[t] += w * (ckpt[f"experts.{e}.down_proj.weight"].double() @ (F.silu(gate) * up))
    return out
