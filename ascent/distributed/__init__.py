"""Parallel groups and collectives (tensor parallelism for now)."""

from ascent.distributed.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_tensor_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_tensor_parallel",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
