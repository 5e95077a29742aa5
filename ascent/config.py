"""Engine configuration: one dataclass per area, validated on construction (ValueError naming the bad value)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

HARDWARE_PROFILES = ("auto", "cpu", "cuda", "a2", "a3", "310p", "a5")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATION_METHODS = ("auto", "ascend", "modelslim", "compressed-tensors", "fp8", "modelopt", "mxfp8", "none")
DEFAULT_KV_CACHE_FRACTION = 0.25  # of available RAM/VRAM when --kv-cache-memory-bytes is not given


def _require(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: {why}.")


def parse_json_object(name: str, value: Any) -> dict[str, Any]:
    """A JSON-object option given as a dict or its JSON text (a copy); ValueError naming the option otherwise."""
    if isinstance(value, dict):
        return dict(value)
    _require(isinstance(value, str), name, value, "must be a JSON object string or a dict")
    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={value!r} is invalid: not JSON ({e.msg})") from None
    _require(isinstance(data, dict), name, value, "must be a JSON object")
    return data


@dataclass
class ModelConfig:
    """The model: path (HF directory or .gguf file), dtype, max length. ``hf_config`` is filled by ``resolve()``."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    chat_template: str | None = None
    quantization: str | None = None  # None / "auto" = detect from the checkpoint (vLLM semantics); "none" = float
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (-1: no limit), as vLLM
    generation_config: str = "auto"  # where default sampling values / EOS ids come from: auto | vllm | a directory
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    hf_config: Any = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=torch.float32, repr=False)
    eos_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.quantization is not None:
            _require(self.quantization in QUANTIZATION_METHODS, "quantization", self.quantization,
                     f"must be one of {QUANTIZATION_METHODS}")
        _require(isinstance(self.max_logprobs, int) and self.max_logprobs >= -1, "max_logprobs", self.max_logprobs,
                 "must be -1 (no limit) or a non-negative integer")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_size(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def kv_bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * elem


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size", self.block_size,
                 "must be a power of two between 1 and 256")
        if self.kv_cache_memory_bytes is not None:
            _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", self.kv_cache_memory_bytes,
                     "must be positive")
        if self.num_gpu_blocks_override is not None:
            _require(self.num_gpu_blocks_override >= 2, "num_gpu_blocks_override", self.num_gpu_blocks_override,
                     "must be at least 2")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be at least 1")
        if self.max_num_batched_tokens is not None:
            _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens,
                     "must be at least 1")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 self.long_prefill_token_threshold, "must be >= 0")
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                 f"must be one of {SCHEDULING_POLICIES}")


@dataclass
class ParallelConfig:
    """TP ranks shard attention/MLP weights; with ``enable_expert_parallel`` the same ranks form the EP group and
    hold disjoint experts (vLLM's rule: EP size = TP size x DP size)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", self.tensor_parallel_size, "must be an integer >= 1")
        _require(self.data_parallel_size == 1, "data_parallel_size", self.data_parallel_size,
                 "data-parallel engines are not part of this build; use tensor/expert parallelism")
        _require(self.distributed_timeout_s > 0, "distributed_timeout_s", self.distributed_timeout_s, "must be > 0")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass
class LoadConfig:
    load_format: str = "auto"

    def __post_init__(self) -> None:
        _require(self.load_format in LOAD_FORMATS, "load_format", self.load_format, f"must be one of {LOAD_FORMATS}")


@dataclass
class DeviceConfig:
    """``--hardware-profile`` resolved to a ``HardwareProfile`` and the torch device it runs on (emulated Ascend
    profiles run on whatever device is present; ``cuda`` without a GPU is a ValueError)."""

    hardware_profile: str = "auto"
    num_threads: int | None = None
    profile: Any = field(default=None, repr=False)
    device: torch.device = field(default=torch.device("cpu"))

    def __post_init__(self) -> None:
        from ascent.platform.device_config import resolve_platform

        _require(self.hardware_profile in HARDWARE_PROFILES, "hardware_profile", self.hardware_profile,
                 f"must be one of {HARDWARE_PROFILES}")
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "num_threads", self.num_threads, "must be at least 1")
        self.profile, self.device, _ = resolve_platform(self.hardware_profile)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    device_config: DeviceConfig
    disable_log_stats: bool = False
    speculative_config: Any = None  # ascent.spec_decode.base.SpeculativeConfig when speculation is on
    eplb_config: Any = None  # ascent.eplb.config.EplbConfig when expert-parallel load balancing is configured

    def finalize(self) -> None:
        """Cross-field checks once the model's limits are known."""
        mc, sc = self.model_config, self.scheduler_config
        tp = self.parallel_config.tensor_parallel_size
        heads = getattr(mc.hf_config, "num_attention_heads", None)
        if heads is not None and heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={heads}.")
        if sc.max_num_batched_tokens is None:
            sc.max_num_batched_tokens = max(2048, sc.max_num_seqs) if sc.enable_chunked_prefill else max(
                mc.max_model_len, 2048)
        if sc.max_num_batched_tokens < sc.max_num_seqs:  # vLLM's SchedulerConfig check
            raise ValueError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} must be at least max_num_seqs="
                f"{sc.max_num_seqs}: lower max_num_seqs or raise max_num_batched_tokens.")
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < mc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} is smaller than max_model_len="
                f"{mc.max_model_len}; enable chunked prefill or raise max_num_batched_tokens.")


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available system RAM (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
