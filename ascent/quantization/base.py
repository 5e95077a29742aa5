"""The contract between quantization configs, schemes and the layers they quantize.

A *config* (ModelSlim, compressed-tensors, FP8, ModelOpt MXFP8) reads a checkpoint's quantization description and,
for every layer prefix, answers with a :class:`QuantSpec` (or None = unquantized). The spec's
``(quant_type, layer_type)`` selects a *scheme* class from the registry (``ascent.quantization.registry``); the scheme
instance declares the layer's parameters (the loading contract: names, shapes, dtypes), transforms them once after
loading, and computes the layer's output. Method adapters (``ascent.quantization.method_adapters``) wrap schemes into
the ``quant_method`` objects the layers call, so models never see quantization.

Shapes: N = local output rows (sum of ``output_partition_sizes``), K = local input columns
(``input_size_per_partition``). Every scheme keeps a reference path (dequantize -> float matmul, what the tests
compare against) next to its fast path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

LAYER_TYPES = ("linear", "moe", "attention", "embedding")
SOURCE_FORMATS = ("modelslim", "compressed-tensors", "fp8", "modelopt", "ascent")
WeightLoader = Callable[..., None]


@dataclass(frozen=True)
class QuantSpec:
    """How one layer is quantized, independent of the checkpoint format that said so.

    ``quant_type`` uses ModelSlim's names (``W8A8``, ``W8A8_DYNAMIC``, ``W8A8_MIX``, ``W8A16``, ``W4A16``,
    ``W4A8_DYNAMIC``, ``W8A8FP8_DYNAMIC``, ``W8A8_MXFP8``, ``W4A4_MXFP4``, ``W4A8_MXFP``, ``W4A16_MXFP4``,
    ``W4A4_DYNAMIC``, ``W4A4_FLATQUANT_DYNAMIC``, ``FP8_BLOCK``, ``W8A8S``, ``W8A8SC``, ``C8``, ``FAKQuant`` ...);
    compressed-tensors / FP8 configs map their argument sets onto the same names. ``source_format`` tells the scheme
    which tensor names and encodings the checkpoint uses (e.g. ModelSlim's ``deq_scale``/``quant_bias`` versus
    compressed-tensors' ``input_scale``; ``weight`` int8 versus ``weight_packed`` int32).

    Weight fields: ``weight_bits``, ``weight_type`` (``int`` | ``float``), ``weight_strategy``
    (``tensor`` | ``channel`` | ``group`` | ``block``), ``group_size`` (group strategy, along K),
    ``block_structure`` ``(rows, cols)`` (block strategy), ``weight_symmetric``.
    Activation fields (None = weight-only): ``act_bits``, ``act_type``, ``act_strategy`` (``tensor`` | ``token`` |
    ``group``), ``act_dynamic``, ``act_symmetric``, ``act_group_size``. ``extra`` carries format specifics
    (e.g. ``{"kv_consumer": True}`` for W8A8_MIX, ``{"scale_alg": 1}`` for MX activations).
    """

    quant_type: str
    layer_type: str = "linear"
    source_format: str = "modelslim"
    weight_bits: int = 8
    weight_type: str = "int"
    weight_strategy: str = "channel"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    weight_symmetric: bool = True
    act_bits: int | None = None
    act_type: str = "int"
    act_strategy: str | None = None
    act_dynamic: bool = True
    act_symmetric: bool = True
    act_group_size: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type={self.layer_type!r} must be one of {LAYER_TYPES}")
        if self.source_format not in SOURCE_FORMATS:
            raise ValueError(f"source_format={self.source_format!r} must be one of {SOURCE_FORMATS}")
        if self.weight_strategy == "group" and not self.group_size:
            raise ValueError(f"{self.quant_type}: weight_strategy='group' needs group_size > 0")


def mark_optional(param: torch.Tensor, default: float | None = None) -> torch.Tensor:
    """Tag a parameter the checkpoint may omit (e.g. compressed-tensors has no ``input_offset``): the loader's
    completeness check skips it and it keeps its initial value (filled with ``default`` when given)."""
    if default is not None:
        param.data.fill_(default)
    param.quant_optional = True  # type: ignore[attr-defined]
    return param


class QuantScheme(ABC):
    """Base of every scheme: built from the layer's :class:`QuantSpec` by the registry."""

    quant_type: ClassVar[str] = ""
    layer_type: ClassVar[str] = ""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Run once after every parameter is loaded: validate, decode encodings, build fast-path layouts."""
        return None


class QuantLinearScheme(QuantScheme):
    """A quantized linear layer: ``y [..., N] = x [..., K] @ W^T + bias`` with W stored quantized."""

    layer_type = "linear"

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register the layer's parameters (local shard shapes). Each carries ``weight_loader`` and marks its TP
        dimensions with ``output_dim`` / ``input_dim`` (``packed_dim``/``packed_factor`` when several values share
        one stored element along a dim); per-tensor values of fused layers set ``per_shard_scalar=True`` and have
        one entry per packed shard. Parameters a format may omit are wrapped with :func:`mark_optional`."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Fast path chosen by shape (e.g. ``torch._int_mm`` for W8A8); output in x's dtype."""

    def apply_logits(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`apply` for a quantized lm_head: float32 ``[..., N]`` logits. Default: :meth:`apply`'s output
        widened; schemes whose kernels can write float32 directly override it (no 16-bit rounding, no copy)."""
        return self.apply(layer, x, bias).float()

    @abstractmethod
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight ``[N, K]`` the stored tensors represent (after ``process_weights_after_loading``)."""

    def apply_reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Reference semantics in float32 (activation quantization included where the scheme has it); the fast
        path must match it within the scheme's stated tolerance. Default: weight-only, ``x @ dequant(W)^T``."""
        y = x.float() @ self.dequantized_weight(layer).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    #: Whether :meth:`embedding_rows` works: weight-only formats whose parameters are indexed by output row (W8A16 /
    #: W4A16) can serve an input embedding table; activation-quantized formats are linear-only (lm_head).
    supports_embedding: ClassVar[bool] = False

    def embedding_rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows ``[*ids.shape, K]`` (in ``layer.params_dtype``) of the local row indices ``ids``
        — the lookup of a quantized input embedding (rows = vocab entries). Only where :attr:`supports_embedding`."""
        raise NotImplementedError(f"{self.quant_type or type(self).__name__} weights cannot be looked up as an "
                                  f"embedding table")


class QuantMoEScheme(QuantScheme):
    """Quantized routed experts of a ``FusedMoE`` layer (``w13`` = gate rows then up rows, ``w2`` = down)."""

    layer_type = "moe"

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register ``w13_*`` ``[S, 2*I_tp, ...]`` and ``w2_*`` ``[S, H, ...]`` parameters (S = local slots)."""

    @abstractmethod
    def dequantized_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(w13 [S, 2*I_tp, H], w2 [S, H, I_tp])``."""

    @abstractmethod
    def apply_experts(self, layer: nn.Module, x: torch.Tensor, group_list: torch.Tensor,
                      activation: str) -> torch.Tensor:
        """Expert MLP over rows grouped by local slot: ``x [R, H]`` (rows sorted by slot), ``group_list [S]`` rows
        per slot -> ``[R, H]`` in x's dtype (routing weights are applied by the caller)."""

    def experts_moved(self, layer: nn.Module, slots: list[int]) -> None:
        """EPLB moved whole experts into the local ``slots`` (``FusedMoE.rearrange_experts`` copied every ``moe_role``
        parameter of those slots). Schemes that derive state from the expert parameters in
        ``process_weights_after_loading`` (dense-weight caches, packed kernel operands, int8 copies) must rebuild or
        invalidate it here; the default (no derived state) does nothing."""
        return None


class QuantAttentionScheme(QuantScheme):
    """KV-cache / attention quantization (C8 int8 KV with static scales, MLA FA quant)."""

    layer_type = "attention"

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_kv_heads: int, head_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register the per-channel (``num_kv_heads * head_size``) or scalar K/V scales and offsets."""

    @abstractmethod
    def quantize_kv(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key, value [T, kv_heads, head_size]`` -> stored (int8 / fp8) tensors of the same shape."""

    @abstractmethod
    def dequantize_kv(self, layer: nn.Module, key: torch.Tensor, value: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`quantize_kv` into the model dtype: ``(q - offset) * scale``."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization description. ``get_quant_method(layer, prefix)`` returns the object the layer
    stores as ``quant_method`` (None = unquantized); ``get_spec(prefix, layer_type)`` is the format-independent
    answer the method is built from."""

    name: ClassVar[str] = ""

    @classmethod
    @abstractmethod
    def from_model_dir(cls, model_dir: str, hf_config: Any) -> "QuantizationConfig":
        """Parse the description found in ``model_dir`` (ValueError naming the missing / bad file)."""

    @abstractmethod
    def get_spec(self, prefix: str, layer_type: str) -> QuantSpec | None:
        """The spec of the layer at engine prefix ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``)."""

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any | None:
        """Default: build the adapter for the layer kind from :meth:`get_spec` (see ``method_adapters``)."""
        from ascent.quantization.method_adapters import quant_method_for

        return quant_method_for(self, layer, prefix)
