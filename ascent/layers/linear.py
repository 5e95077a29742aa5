"""Linear layers that know their tensor-parallel shard and how to load it.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` bound method which narrows the full
checkpoint tensor to this rank's shard and, for packed layers, places it at the shard's offset:
``QKVParallelLinear`` takes shard ids ``"q" | "k" | "v"``, ``MergedColumnParallelLinear`` takes integer ids
(0 = gate, 1 = up); ``shard_id=None`` on a packed layer means the checkpoint already holds the fused tensor.
Parameters mark their sharded dimensions with ``output_dim`` / ``input_dim`` attributes; parameters without them
(e.g. per-tensor scales of quantization schemes) are copied whole. Attributes quantization schemes use:

* ``per_shard_scalar=True``: shape ``[num_shards, *elem]`` (num_shards = number of packed sub-outputs, 1 for unfused
  layers); a shard's tensor (elem-shaped, or anything with ``elem`` elements, e.g. a 0-d tensor or ``[1]``) lands in
  row ``shard_index`` (q/k/v -> 0/1/2, integer ids as is); ``shard_id=None`` copies a full ``[num_shards, *elem]``
  tensor (any shape with that many elements). Never sharded by TP.
* ``packed_dim`` / ``packed_factor``: ``packed_factor`` logical values share one stored element along ``packed_dim``
  (e.g. ModelSlim W4A8: two int4 per int8 along N -> ``[N/2, K]``). When ``packed_dim == output_dim`` the
  column-parallel offsets and sizes are divided by ``packed_factor``; along ``input_dim`` the row-parallel narrow
  uses the parameter's local (packed) size already.
* ``row_parallel_rank0_only=True`` (row-parallel per-output vectors such as W8A8's ``quant_bias``): rank 0 loads the
  full tensor, ranks != 0 hold zeros (the partial outputs are summed over TP; the layer's float bias likewise only
  reaches rank 0's ``apply``).

Weight creation and the matmul go through ``layer.quant_method`` (``UnquantizedLinearMethod`` unless a quantization
config provides another), so quantization schemes plug in without touching the layers or the models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from ascent.layers.cpu_packing import (amx_linear_weight, cpu_linear, pack_linear_weight, panel_weight,
                                       small_m_kernel)
from ascent.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def set_weight_attrs(weight: torch.Tensor, attrs: dict[str, Any] | None) -> None:
    """Attach loader metadata (``output_dim``, ``input_dim``, ``weight_loader``, ...) to a parameter."""
    for key, value in (attrs or {}).items():
        if hasattr(weight, key):
            raise ValueError(f"parameter already has attribute {key!r}")
        setattr(weight, key, value)


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator


class LinearMethodBase(ABC):
    """How a linear layer stores its weights and computes ``x @ W^T``; quantization schemes subclass this."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register the layer's weight parameters (local shard sizes) with ``extra_weight_attrs`` attached."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in_local]`` -> ``[..., out_local]`` in x's dtype."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Hook run once after all weights are loaded (repacking, transposes); unquantized weights need none."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain ``weight [out_local, in_local]`` in the model dtype."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CPU, pack bf16/fp16 weights for oneDNN once, plus AMX tiles where AMX-BF16 exists; the plain rows stay
        only for the small-M kernel when there are no AMX tiles (see ``ascent.layers.cpu_packing``), otherwise the
        packed copies replace them. On the kernel's AVX2 path the kernel takes every call: prepacked panels
        (``panel_weight``) instead of a GEMM copy."""
        layer.amx_weight = amx_linear_weight(layer.weight)
        layer.small_m_ops = small_m_kernel(layer.weight) if layer.amx_weight is None else None
        layer.panel_weight = panel_weight(layer.weight, layer.small_m_ops)
        packed = pack_linear_weight(layer.weight) if layer.panel_weight is None else None
        if packed is not None:
            layer.packed_weight = packed
            layer.owns_plain_weight = layer.small_m_ops is not None
            if layer.small_m_ops is None:
                layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_linear(x, layer.weight, getattr(layer, "packed_weight", None), bias,
                          getattr(layer, "small_m_ops", None), getattr(layer, "amx_weight", None),
                          panels=getattr(layer, "panel_weight", None))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, where: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{where}: checkpoint shard shape {tuple(src.shape)} != parameter shape {tuple(dst.shape)}")
    if dst.is_floating_point() and not (src.is_floating_point() or src.dtype is torch.bool):
        # quantized integers read as float weights: the checkpoint's quantization config was missed or overridden
        raise ValueError(f"{where}: the checkpoint holds {src.dtype} values for a {dst.dtype} parameter - a quantized "
                         "checkpoint loaded without its quantization config (ModelSlim quant_model_description.json, "
                         "config.json quantization_config) or with --quantization none")
    dst.copy_(src)


def _load_per_shard_scalar(param: torch.Tensor, loaded: torch.Tensor, index: int | None, where: str) -> None:
    """``per_shard_scalar`` parameters ``[num_shards, *elem]``: row ``index`` from an elem-sized tensor, or all rows
    (``index=None``) from a tensor with ``param.numel()`` elements."""
    dst = param.data if index is None else param.data[index]
    if loaded.numel() != dst.numel():
        raise ValueError(f"{where}: per-shard value of shape {tuple(loaded.shape)} does not fit "
                         f"{'all shards' if index is None else f'shard {index}'} {tuple(dst.shape)}")
    dst.copy_(loaded.reshape(dst.shape))


def _packed_factor(param: torch.Tensor, dim: int) -> int:
    """``packed_factor`` when ``param`` is packed along ``dim``, else 1."""
    return int(getattr(param, "packed_factor", 1)) if getattr(param, "packed_dim", None) == dim else 1


def _unpacked(value: int, factor: int, where: str) -> int:
    if value % factor:
        raise ValueError(f"{where}: size/offset {value} is not divisible by packed_factor {factor}")
    return value // factor


class LinearBase(nn.Module):
    """Common state: sizes, TP rank/size, params dtype and the quant method chosen for ``prefix``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    def _create(self, in_local: int, out_parts: list[int], bias: bool) -> None:
        """Create weights through the quant method, plus the bias; every parameter gets ``self.weight_loader``."""
        self.quant_method.create_weights(
            self, in_local, out_parts, self.input_size, self.output_size, self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            b = nn.Parameter(torch.empty(sum(out_parts), dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(b, {"output_dim": 0, "weight_loader": self.weight_loader})
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)

    def _reject_shard_id(self, shard_id: Any) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} {self.prefix!r} does not accept shard id {shard_id!r}")

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self._create(input_size, [output_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        self._reject_shard_id(shard_id)
        if getattr(param, "per_shard_scalar", False):
            _load_per_shard_scalar(param, loaded_weight, None, self.prefix)
            return
        _copy_checked(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``Y = X W^T`` with W split along the output dim: rank r holds rows ``[r*out/tp, (r+1)*out/tp)``.

    ``output_sizes`` lists the logical sub-outputs packed in the weight (each is split separately, so a packed layer
    keeps its sub-outputs contiguous per rank). ``gather_output`` all-gathers the local outputs.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        if sum(self.output_sizes) != output_size:
            raise ValueError(f"output_sizes {self.output_sizes} do not sum to output_size {output_size}")
        self.output_partition_sizes = self._partition_sizes()
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self._create(input_size, self.output_partition_sizes, bias)

    def _partition_sizes(self) -> list[int]:
        """Local (this rank's) size of each packed sub-output."""
        return [divide(s, self.tp_size, f"{self.prefix} output size") for s in self.output_sizes]

    def _load_narrow(self, param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int, start: int) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            _copy_checked(param.data, loaded, self.prefix)
            return
        factor = _packed_factor(param, dim)
        if factor != 1:
            offset, size, start = (_unpacked(v, factor, self.prefix) for v in (offset, size, start))
        if start + size > loaded.shape[dim]:
            raise ValueError(
                f"{self.prefix}: checkpoint dim {dim} has {loaded.shape[dim]} rows; "
                f"shard needs [{start}, {start + size})"
            )
        _copy_checked(param.data.narrow(dim, offset, size), loaded.narrow(dim, start, size), self.prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        self._reject_shard_id(shard_id)
        if getattr(param, "per_shard_scalar", False):
            _load_per_shard_scalar(param, loaded_weight, None, self.prefix)
            return
        size = self.output_size_per_partition
        self._load_narrow(param, loaded_weight, 0, size, self.tp_rank * size)

    def _split_full(self, param: nn.Parameter, loaded_weight: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
        """Split an already-fused checkpoint tensor into its sub-outputs (packed sizes when packed along dim)."""
        factor = _packed_factor(param, dim)
        return loaded_weight.split([_unpacked(s, factor, self.prefix) for s in self.output_sizes], dim=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return tensor_model_parallel_all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight (gate/up): shard ids are indices into ``output_sizes``."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias, gather_output, params_dtype, quant_config, prefix, output_sizes
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        scalar = getattr(param, "per_shard_scalar", False)
        if shard_id is None:
            dim = getattr(param, "output_dim", None)
            if scalar:
                _load_per_shard_scalar(param, loaded_weight, None, self.prefix)
                return
            if dim is None:
                _copy_checked(param.data, loaded_weight, self.prefix)
                return
            for idx, part in enumerate(self._split_full(param, loaded_weight, dim)):
                self.weight_loader(param, part, idx)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} not in 0..{len(self.output_sizes) - 1}")
        if scalar:
            _load_per_shard_scalar(param, loaded_weight, shard_id, self.prefix)
            return
        size = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])
        self._load_narrow(param, loaded_weight, offset, size, self.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q/K/V projection: local rows are ``[q (num_heads*d) | k (num_kv_heads*d) | v (num_kv_heads*d)]``.

    Query heads are split across ranks; KV heads too when ``total_num_kv_heads >= tp``, otherwise each KV head is
    replicated on ``tp / total_num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self._head_layout = (head_size, total_num_heads, total_num_kv_heads)
        sizes = [total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * head_size]
        super().__init__(hidden_size, sum(sizes), bias, False, params_dtype, quant_config, prefix, sizes)
        q, kv, _ = self.output_partition_sizes
        self._shard_local = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}

    def _partition_sizes(self) -> list[int]:
        head_size, total_heads, total_kv = self._head_layout
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_heads, total_kv
        self.num_heads = divide(total_heads, self.tp_size, f"{self.prefix} num_heads")
        if total_kv >= self.tp_size:
            self.num_kv_heads = divide(total_kv, self.tp_size, f"{self.prefix} num_kv_heads")
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(self.tp_size, total_kv, f"{self.prefix} tp size over kv heads")
        return [self.num_heads * head_size, self.num_kv_heads * head_size, self.num_kv_heads * head_size]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        scalar = getattr(param, "per_shard_scalar", False)
        if shard_id is None:
            dim = getattr(param, "output_dim", None)
            if scalar:
                _load_per_shard_scalar(param, loaded_weight, None, self.prefix)
                return
            if dim is None:
                _copy_checked(param.data, loaded_weight, self.prefix)
                return
            for sid, part in zip("qkv", self._split_full(param, loaded_weight, dim)):
                self.weight_loader(param, part, sid)
            return
        if shard_id not in self._shard_local:
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} not in ('q', 'k', 'v')")
        if scalar:
            _load_per_shard_scalar(param, loaded_weight, "qkv".index(shard_id), self.prefix)
            return
        offset, size = self._shard_local[shard_id]
        head_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        self._load_narrow(param, loaded_weight, offset, size, head_rank * size)


class RowParallelLinear(LinearBase):
    """``Y = X W^T`` with W split along the input dim; partial outputs are summed over TP (``reduce_results``).

    The bias is counted once: TP rank 0 passes it to ``quant_method.apply`` (into its partial output, before the
    sum), the other ranks pass None — vLLM's contract, the same on every TP size, so a quantization scheme whose
    parameters fold the float bias (ModelSlim W8A8 static: ``quant_bias``, loaded on rank 0 only) may ignore the
    argument, and with ``reduce_results=False`` the caller's later sum still counts it once.
    ``input_is_parallel=False`` slices a full input to the local part.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: Any | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{prefix} input size")
        self._create(self.input_size_per_partition, [output_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        self._reject_shard_id(shard_id)
        if getattr(param, "per_shard_scalar", False):
            _load_per_shard_scalar(param, loaded_weight, None, self.prefix)
            return
        dim = getattr(param, "input_dim", None)
        if dim is None:
            if getattr(param, "row_parallel_rank0_only", False) and self.tp_rank != 0:
                if tuple(param.shape) != tuple(loaded_weight.shape):
                    raise ValueError(f"{self.prefix}: checkpoint shape {tuple(loaded_weight.shape)} != parameter "
                                     f"shape {tuple(param.shape)}")
                param.data.zero_()
                return
            _copy_checked(param.data, loaded_weight, self.prefix)
            return
        size = param.shape[dim]
        if (self.tp_rank + 1) * size > loaded_weight.shape[dim]:
            raise ValueError(f"{self.prefix}: checkpoint dim {dim} has {loaded_weight.shape[dim]} columns")
        _copy_checked(param.data, loaded_weight.narrow(dim, self.tp_rank * size, size), self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            size = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * size, size)
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole (unsharded) checkpoint tensor into ``param``, casting to its dtype; shapes must match."""
    if shard_id is not None:
        raise ValueError(f"default weight loader got shard id {shard_id!r} for a parameter that is not packed")
    _copy_checked(param.data, loaded_weight, "parameter")
