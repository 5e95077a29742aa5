"""Helpers shared by the scheme modules: parameter declaration with loader attributes, the deq_scale encoding,
per-shard scalar checks and the fast/reference switch."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ascent.layers.linear import set_weight_attrs
from ascent.quantization.base import WeightLoader, mark_optional
from ascent.quantization.kernels import reference_forced

logger = logging.getLogger(__name__)


def add_param(layer: nn.Module, name: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype,
              weight_loader: WeightLoader, fill: float | None = 0.0, optional_default: float | None = None,
              **attrs: Any) -> nn.Parameter:
    """Register ``layer.<name>`` (no grad) with ``weight_loader`` and loader ``attrs`` (``output_dim``,
    ``input_dim``, ``packed_dim``, ``packed_factor``, ``per_shard_scalar``, ``row_parallel_rank0_only`` ...).
    ``optional_default`` marks the parameter optional (see ``mark_optional``) with that initial value."""
    data = torch.empty(tuple(shape), dtype=dtype)
    if fill is not None:
        data.fill_(fill)
    param = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(param, {"weight_loader": weight_loader, **attrs})
    if optional_default is not None:
        mark_optional(param, optional_default)
    layer.register_parameter(name, param)
    return param


def num_shards(output_partition_sizes: list[int]) -> int:
    """Packed sub-outputs of the layer (3 for qkv, 2 for gate_up, 1 unfused): rows of per-shard scalars."""
    return max(1, len(output_partition_sizes))


def layer_name(layer: nn.Module) -> str:
    return getattr(layer, "prefix", "") or type(layer).__name__


def use_reference(scheme: Any) -> bool:
    """Reference path when the scheme says so (``scheme.force_reference``) or ``ASCENT_QUANT_REFERENCE=1``."""
    return bool(getattr(scheme, "force_reference", False)) or reference_forced()


def fp32_bits_as_int64(value: torch.Tensor) -> torch.Tensor:
    """A float tensor's float32 bit patterns widened to int64 (the Ascend int64 deq_scale encoding)."""
    return value.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)


def decode_deq_scale(raw: torch.Tensor) -> torch.Tensor:
    """Stored deq_scale -> float32: int64 storage keeps the fp32 bits in its low 32 bits; float storage is the
    value itself (decode by the stored dtype, spec §11.3)."""
    if raw.dtype in (torch.int64, torch.int32):
        low = raw.to(torch.int64) & 0xFFFFFFFF
        signed = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
        return signed.view(torch.float32).clone()
    return raw.to(torch.float32)


def deq_scale_loader(base: WeightLoader) -> WeightLoader:
    """Wrap ``base`` so the int64 ``deq_scale`` parameter accepts int64 (fp32 bits) and float checkpoints alike:
    float values are re-encoded as their fp32 bits before the (sharding) copy."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if loaded.is_floating_point():
            loaded = fp32_bits_as_int64(loaded)
        return base(param, loaded.to(torch.int64), *args, **kwargs)

    return load


def shard_scalars(param: torch.Tensor) -> torch.Tensor:
    """A ``per_shard_scalar`` parameter ``[S, 1]`` (or ``[S]``) -> float32 ``[S]``."""
    return param.detach().reshape(param.shape[0], -1)[:, 0].float()


def common_shard_scalar(layer: nn.Module, param: torch.Tensor, what: str, rtol: float = 1e-6) -> float:
    """The value all fused shards share (they quantize the same x); ValueError naming the layer if the shards
    differ by more than ``rtol`` relative."""
    values = shard_scalars(param)
    ref = float(values[0])
    if bool(((values - ref).abs() > rtol * max(abs(ref), 1e-30)).any()):
        raise ValueError(f"{layer_name(layer)}: fused shards have different {what} {values.tolist()}; "
                         f"they quantize the same input and must be equal")
    return ref


def max_shard_scalar(layer: nn.Module, param: torch.Tensor, what: str) -> float:
    """The largest of the fused shards' values: one static activation scale for the shared input that clips none
    of the shards (vLLM's choice for compressed-tensors W8A8 with different q/k/v ``input_scale``)."""
    values = shard_scalars(param)
    if bool((values != values[0]).any()):
        logger.warning("%s: fused shards have different %s %s; using the largest for the shared input",
                       layer_name(layer), what, values.tolist())
    return float(values.max())


def check_zero_offset(layer: nn.Module, name: str, quant_type: str) -> None:
    """Symmetric-only schemes: ``layer.<name>`` must be all zero (spec §11.10)."""
    param = getattr(layer, name, None)
    if param is not None and bool((param.detach() != 0).any()):
        raise ValueError(f"{layer_name(layer)}: {name} has non-zero entries but {quant_type} supports symmetric "
                         f"weights only (the offset would be ignored)")


def group_size_of(spec: Any, k: int) -> int:
    """Columns per weight scale: ``spec.group_size`` for group strategy, else the whole row (per-channel)."""
    if spec.weight_strategy == "group":
        g = int(spec.group_size)
        if k % g:
            raise ValueError(f"{spec.quant_type}: input size {k} is not a multiple of group_size {g}")
        return g
    return k


def expand_groups(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Per-group ``[N, G]`` (or per-channel ``[N, 1]``) -> per-element ``[N, K]`` float32."""
    return scale.float().repeat_interleave(k // scale.shape[-1], dim=-1)
