"""GPTQ activation ordering of weight-only checkpoints (compressed-tensors ``actorder: "group"``/``"dynamic"``).

Such checkpoints carry ``weight_g_idx`` int32 [K]: input column k belongs to scale group ``g_idx[k]``, and a group's
columns are scattered over K. Sorting the columns by group (``perm = argsort(g_idx)``, stable) makes every group
contiguous again, so after loading the weight is stored column-permuted, ``W' = W[:, perm]``, and the layer
multiplies the permuted input: ``y = x[:, perm] @ W'^T`` (vLLM's Marlin path does the same). Layers so permuted
keep ``wo_input_perm`` int64 [K] and run on the module path (the C++ decode stack does not permute inputs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ascent.layers.linear import RowParallelLinear
from ascent.quantization.base import WeightLoader
from ascent.quantization.schemes.common import add_param, layer_name, num_shards

ACT_ORDERS_WITH_G_IDX = ("group", "dynamic")


def uses_g_idx(spec: Any) -> bool:
    """Whether the checkpoint of ``spec`` stores ``weight_g_idx`` (activation ordering by group)."""
    return spec.extra.get("actorder") in ACT_ORDERS_WITH_G_IDX


def create_g_idx(layer: nn.Module, k: int, output_partition_sizes: list[int], weight_loader: WeightLoader) -> None:
    """``weight_g_idx`` int32 [S, K]: one row per fused shard (q/k/v share their input, so their orders agree)."""
    if isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1:
        raise NotImplementedError(f"{layer_name(layer)}: activation order (weight_g_idx) with the input split "
                                  f"across {layer.tp_size} tensor-parallel ranks is not supported")
    add_param(layer, "weight_g_idx", (num_shards(output_partition_sizes), k), torch.int32, weight_loader, fill=-1,
              per_shard_scalar=True)


def group_sorting_permutation(layer: nn.Module, group_size: int) -> torch.Tensor | None:
    """``perm`` int64 [K] sorting the input columns by group (None when they already are); ValueError /
    NotImplementedError naming the layer for orders this layout cannot serve."""
    g_idx = layer.weight_g_idx.detach().to(torch.int64)
    if bool((g_idx < 0).any()):
        raise ValueError(f"{layer_name(layer)}: actorder checkpoint without weight_g_idx for every shard")
    if bool((g_idx != g_idx[0]).any()):
        raise NotImplementedError(f"{layer_name(layer)}: fused shards with different activation orders "
                                  f"(weight_g_idx) are not supported")
    order = g_idx[0]
    perm = torch.argsort(order, stable=True)
    if not torch.equal(order[perm], torch.arange(order.numel()) // group_size):
        raise ValueError(f"{layer_name(layer)}: weight_g_idx does not give each group {group_size} columns")
    return None if torch.equal(perm, torch.arange(order.numel())) else perm


def permute_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x[..., perm]`` for a column-permuted layer, else ``x``."""
    perm = getattr(layer, "wo_input_perm", None)
    return x if perm is None else x.index_select(-1, perm)
