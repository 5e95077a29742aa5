"""Vocab-parallel token embedding and LM head.

With tensor parallelism the vocab is padded to a multiple of ``padding_size * tp`` and rank r owns rows
``[r * V_pad/tp, (r+1) * V_pad/tp)``; padding rows are zero and padded logits are dropped. With tp = 1 nothing is
padded.

Quantized tables (``quant_config.get_quant_method`` returns a ``QuantEmbeddingMethod``, vLLM Ascend's
``AscendEmbeddingMethod``): the parameters come from the quant type's *linear* scheme (``create_weights`` with
N = local vocab rows, K = embedding dim); every parameter with an ``output_dim`` is sharded / padded along the vocab
like the float weight (``packed_factor`` rows per stored row when ``packed_dim == output_dim``), the others are
copied whole. The lm_head computes float32 ``quant_method.apply_logits(hidden, bias)``; an input embedding
dequantizes only the looked-up rows (``quant_method.embedding``; weight-only formats).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ascent.layers.cpu_packing import (amx_linear_weight, cpu_linear, pack_linear_weight, panel_weight,
                                       small_m_kernel)
from torch import nn

from ascent.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from ascent.layers.linear import _copy_checked, set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


class VocabParallelEmbedding(nn.Module):
    """``input_ids int64 [T]`` -> ``[T, embedding_dim]`` in the parameter dtype."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: Any | None = None,
    ) -> None:
        super().__init__()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        multiple = padding_size * self.tp_size if self.tp_size > 1 else 1
        self.num_embeddings_padded = -(-num_embeddings // multiple) * multiple
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.params_dtype = dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self, embedding_dim, [self.num_embeddings_per_partition], embedding_dim,
                                             self.num_embeddings_padded, dtype, weight_loader=self.weight_loader)
            return
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader, "output_dim": 0})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's vocab rows of a full checkpoint tensor (``[vocab, dim]`` for the float weight; any
        parameter with an ``output_dim`` of a quantized table) and zero the padding rows; parameters without an
        ``output_dim`` (per-tensor scales) are copied whole."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: embedding takes no shard id, got {shard_id!r}")
        dim = getattr(param, "output_dim", None)
        if dim is None:
            if getattr(param, "per_shard_scalar", False) and loaded_weight.numel() == param.numel():
                loaded_weight = loaded_weight.reshape(param.shape)
            _copy_checked(param.data, loaded_weight, self.prefix)
            return
        factor = int(getattr(param, "packed_factor", 1)) if getattr(param, "packed_dim", None) == dim else 1
        if self.org_vocab_size % factor or self.vocab_start_index % factor:
            raise ValueError(f"{self.prefix}: vocab {self.org_vocab_size} is not a multiple of the packing {factor}")
        expected = tuple(self.org_vocab_size // factor if d == dim else n for d, n in enumerate(param.shape))
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"{self.prefix}: checkpoint shape {tuple(loaded_weight.shape)} != {expected}")
        start = self.vocab_start_index // factor
        rows = max(min(self.vocab_end_index, self.org_vocab_size) // factor - start, 0)
        param.data.narrow(dim, 0, rows).copy_(loaded_weight.narrow(dim, start, rows))
        param.data.narrow(dim, rows, param.shape[dim] - rows).zero_()

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_shard
        out = self._rows(local_ids)
        out = out * in_shard.unsqueeze(-1).to(out.dtype)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.org_vocab_size}, padded={self.num_embeddings_padded}, dim={self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharing the embedding's layout; ``forward(hidden [N, dim]) -> logits fp32 [N, vocab]``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
        prefix: str = "",
        quant_config: Any | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix, quant_config)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition, dtype=self.params_dtype),
                                     requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self._bias_loader, "output_dim": 0})
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None or tuple(loaded_weight.shape) != (self.org_vocab_size,):
            raise ValueError(f"{self.prefix}: bad lm_head bias shape {tuple(loaded_weight.shape)} / shard {shard_id!r}")
        end = min(self.vocab_end_index, self.org_vocab_size)
        rows = max(end - self.vocab_start_index, 0)
        param.data[:rows].copy_(loaded_weight[self.vocab_start_index : self.vocab_start_index + rows])
        param.data[rows:].zero_()

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's weight parameter (tied word embeddings); returns self. A quantized side is a
        NotImplementedError: a tied checkpoint has one table, which cannot be float on one side and quantized on
        the other."""
        if self.quant_method is not None or embed_tokens.quant_method is not None:
            raise NotImplementedError(
                f"{self.prefix}: tied word embeddings with a quantized embedding table or lm_head are not supported; "
                f"mark both {embed_tokens.prefix or 'embed_tokens'} and {self.prefix or 'lm_head'} FLOAT in the "
                f"quantization config")
        if embed_tokens.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie lm_head {tuple(self.weight.shape)} to {tuple(embed_tokens.weight.shape)}")
        self.weight = embed_tokens.weight
        return self

    def process_weights_after_loading(self) -> None:
        """Pack a (possibly tied, hence copied) weight for oneDNN on CPU; the embedding keeps its dense rows."""
        self.amx_weight = amx_linear_weight(self.weight)
        # the small-M kernel reads the dense rows the embedding keeps anyway; AMX tiles take its calls where they exist
        self.small_m_ops = small_m_kernel(self.weight) if self.amx_weight is None else None
        self.panel_weight = panel_weight(self.weight, self.small_m_ops)  # the kernel's AVX2 path: every call
        self.packed_weight = pack_linear_weight(self.weight) if self.panel_weight is None else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply_logits(self, hidden_states, self.bias)
        else:
            logits = cpu_linear(hidden_states, self.weight, getattr(self, "packed_weight", None), self.bias,
                                getattr(self, "small_m_ops", None), getattr(self, "amx_weight", None),
                                float_output=True, panels=getattr(self, "panel_weight", None))
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        if logits.shape[-1] != self.org_vocab_size:
            logits = logits[..., : self.org_vocab_size]
        return logits.float().contiguous()
