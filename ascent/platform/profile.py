"""HardwareProfile: the frozen record of what one hardware family supports and which implementation each slot uses.

Three kinds of fields (as upstream):
- ``capabilities`` (:class:`HardwareCapability`): binary contracts, queried with ``profile.supports(cap)``;
- policies / modes (``weight_layout``, ``moe_comm``, ``rng_placement``, ``graph_mode``, ...): which rule applies;
- families (``attention_backend``, ``device_adaptor``, ``quant_backend``): which of several equivalent
  implementations is used.
Plus engine fields (dtypes, kernel block sizes and alignment, slot-mapping dtype, block-table implementation).
The values per family live in ``families.py``; all enum values are strings, so ``profile.rng_placement == "device"``
works and the values can be passed to code that expects plain names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ascent.platform.hardware import DeviceFamily


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return self.value


class HardwareCapability(_StrEnum):
    """Binary contracts (names follow vllm-ascend). Consumers use their documented fallback when absent."""

    # vllm-ascend PR #14076 set.
    AUTO_ENABLE_CUSTOM_OPS = "auto_enable_custom_ops"
    BGMV_SGMV_META_REGISTRATION = "bgmv_sgmv_meta_registration"
    CLUSTER_CPU_TOPOLOGY = "cluster_cpu_topology"
    COMPATIBILITY_OP_IMPLEMENTATIONS = "compatibility_op_implementations"
    DYNAMIC_MX_QUANT_FUSION = "dynamic_mx_quant_fusion"
    IRQ_CPU_RESERVATION = "irq_cpu_reservation"
    LORA_CUSTOM_OPS = "lora_custom_ops"
    MC2_HIERARCHY_COMM = "mc2_hierarchy_comm"
    NPUGRAPH_EX = "npugraph_ex"
    RC_DEVICE_DISCOVERY = "rc_device_discovery"
    REDUCED_CUDAGRAPH_CAPTURE_SIZES = "reduced_cudagraph_capture_sizes"
    RUNTIME_CUSTOM_OPS = "runtime_custom_ops"
    SFA_DCP_REPLICATED_INDEXER = "sfa_dcp_replicated_indexer"
    STANDARD_WORKER_PATCHES = "standard_worker_patches"
    # vllm-ascend PR #14059 switch points (the remaining device-type branches).
    ATB_EXTENSIONS = "atb_extensions"
    ATB_WARMUP = "atb_warmup"
    CHUNKED_PREFILL_PHASE_SPLIT = "chunked_prefill_phase_split"
    DISTRIBUTED_COMMUNICATION_ADAPTATION = "distributed_communication_adaptation"
    DSA_O_PROJ_TP = "dsa_o_proj_tp"
    DSV4_COMPRESSED_CACHE = "dsv4_compressed_cache"
    FP8_ATTENTION = "fp8_attention"
    FUSED_MOE_COMPATIBILITY = "fused_moe_compatibility"
    FUSED_SWIGLU_TUNING_ARGS = "fused_swiglu_tuning_args"
    GDN_COMPATIBILITY = "gdn_compatibility"
    GRAPH_MULS_ADD_FUSION = "graph_muls_add_fusion"
    GRAPH_NORM_QUANT_FUSION = "graph_norm_quant_fusion"
    LOCAL_KV_COMM_RESOURCE = "local_kv_comm_resource"
    MOE_DISPATCH_EXTRA_ARGS = "moe_dispatch_extra_args"
    MOE_DISPATCH_SHARED_EXPERT_ARGS = "moe_dispatch_shared_expert_args"
    NPU_TOP_K_TOP_P = "npu_top_k_top_p"
    PAGED_ATTENTION = "paged_attention"
    STANDARD_MAMBA_PATCH = "standard_mamba_patch"
    TRITON_BATCH_MEMCPY = "triton_batch_memcpy"
    UNRESTRICTED_MLAPO = "unrestricted_mlapo"


class AttentionBackendFamily(_StrEnum):
    STANDARD = "standard"  # unified varlen paged attention (SDPA backend)
    COMPATIBILITY = "compat310p"  # FA prefill + PA decode + splitfuse mask, host qLens


class DeviceAdaptorFamily(_StrEnum):
    STANDARD = "standard"
    FP8_OPTIMIZED = "fp8"  # the A5 overrides
    COMPATIBILITY = "compat310p"  # the 310P overrides


class QuantizationBackendFamily(_StrEnum):
    STANDARD = "standard"  # every registered scheme (MX formats also need DYNAMIC_MX_QUANT_FUSION)
    COMPATIBILITY = "w8a8_only"  # W8A8 static/dynamic, W8A8S, W8A8SC only


class WeightLayoutPolicy(_StrEnum):
    CONFIGURABLE = "configurable"
    FORCE_NZ = "force_nz"  # every eligible weight goes through the (numerics-preserving) layout hook


class MoECommPolicy(_StrEnum):
    """MoE dispatcher choice rule (all-gather + reduce-scatter vs all-to-all; MC2 is emulated as all-to-all)."""

    SIZE_BASED = "size_based"  # all-gather or all-to-all by batch size
    CAPACITY_AND_EXPERT_DENSITY = "capacity_density"  # A2 heuristic
    FUSED_OR_CAPACITY = "fused_or_capacity"  # A3 heuristic: MC2 when it fits, else all-to-all
    CAPACITY_AND_WORLD_SIZE = "capacity_world"  # A5 heuristic
    ALLGATHER = "allgather"  # always all-gather


class RNGPlacement(_StrEnum):
    """Sampler randomness (``ascent.sample.rng``): device noise, host noise, or host uniforms + inverse CDF."""

    DEVICE = "device"
    HOST = "host"
    HOST_CDF = "host_cdf"


class FusedKernels(_StrEnum):
    NO = "no"  # torch fallbacks only
    OPTIONAL = "optional"
    EMULATED = "emulated"
    YES = "yes"


class GraphMode(_StrEnum):
    NONE = "none"
    CUDA_GRAPHS = "cuda_graphs"
    FULL_DECODE_ONLY = "decode_only"  # graph replay for uniform decode batches; eager fallback otherwise


class BlockTableImpl(_StrEnum):
    NUMPY = "numpy"  # slot mapping computed on the host with numpy
    TORCH = "torch"  # slot mapping computed on the model device (stand-in for the Triton kernel)


class CPUBindingMode(_StrEnum):
    NONE = "none"
    TOPO_AFFINITY = "topo_affinity"
    GLOBAL_SLICE = "global_slice"


class DeviceAddressingMode(_StrEnum):
    DIRECT = "direct"
    DUAL_CHIP_CARD = "dual_chip"


class DeviceRequirement(_StrEnum):
    CPU = "cpu"  # always runs on the CPU
    CUDA = "cuda"  # needs a CUDA device
    ANY = "any"  # emulated: runs on whatever device is present (CUDA if available, else CPU)


DTYPE_SHORT_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_label(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16 (bf16)"`` (both spellings users type)."""
    short = DTYPE_SHORT_NAMES.get(dtype)
    return f"{dtype_name(dtype)} ({short})" if short else dtype_name(dtype)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Immutable capabilities and implementation choices of one hardware family.

    Invariants (checked on construction): ``default_dtype in allowed_dtypes``; ``kernel_block_sizes`` positive
    (empty = any block size the cache config accepts); ``kernel_alignment`` a positive power of two;
    ``slot_mapping_dtype`` int32 or int64; ``gdn_state_dtype`` None (= model/config choice) or a float dtype.
    ``mamba_k_half_exact``: the SSM state must exactly fill the K half of an attention page (A2/A3 rule).
    """

    family: DeviceFamily
    capabilities: frozenset[HardwareCapability]
    attention_backend: AttentionBackendFamily
    device_adaptor: DeviceAdaptorFamily
    quant_backend: QuantizationBackendFamily
    weight_layout: WeightLayoutPolicy
    moe_comm: MoECommPolicy
    rng_placement: RNGPlacement
    allowed_dtypes: tuple[torch.dtype, ...]
    default_dtype: torch.dtype
    kernel_block_sizes: tuple[int, ...]
    kernel_alignment: int
    slot_mapping_dtype: torch.dtype
    graph_mode: GraphMode
    fused_kernels: FusedKernels
    block_table_impl: BlockTableImpl
    gdn_state_dtype: torch.dtype | None
    mamba_k_half_exact: bool
    cpu_binding: CPUBindingMode
    device_addressing: DeviceAddressingMode
    device_requirement: DeviceRequirement

    def __post_init__(self) -> None:
        if self.default_dtype not in self.allowed_dtypes:
            raise ValueError(f"default_dtype={self.default_dtype} is not in allowed_dtypes={self.allowed_dtypes}")
        if any(b < 1 for b in self.kernel_block_sizes):
            raise ValueError(f"kernel_block_sizes={self.kernel_block_sizes} must be positive")
        if self.kernel_alignment < 1 or self.kernel_alignment & (self.kernel_alignment - 1):
            raise ValueError(f"kernel_alignment={self.kernel_alignment} must be a positive power of two")
        if self.slot_mapping_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slot_mapping_dtype={self.slot_mapping_dtype} must be torch.int32 or torch.int64")
        if self.gdn_state_dtype is not None and not self.gdn_state_dtype.is_floating_point:
            raise ValueError(f"gdn_state_dtype={self.gdn_state_dtype} must be a floating dtype or None")

    @property
    def name(self) -> str:
        """The ``--hardware-profile`` spelling of this profile's family."""
        return self.family.value

    @property
    def emulated(self) -> bool:
        """True for profiles that emulate another device on whatever device is present."""
        return self.device_requirement == DeviceRequirement.ANY

    def supports(self, capability: HardwareCapability | str) -> bool:
        """Whether the exact contract ``capability`` (an enum member or its string value) is available."""
        if isinstance(capability, str) and not isinstance(capability, HardwareCapability):
            try:
                capability = HardwareCapability(capability.strip().lower())
            except ValueError:
                raise ValueError(f"capability {capability!r} is unknown") from None
        if not isinstance(capability, HardwareCapability):
            raise ValueError(f"capability {capability!r} is not a HardwareCapability")
        return capability in self.capabilities

    def allows_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self.allowed_dtypes

    def check_dtype(self, dtype: torch.dtype, what: str = "dtype") -> torch.dtype:
        """Return ``dtype`` if this profile allows it, else raise ValueError naming it and the allowed set."""
        if dtype not in self.allowed_dtypes:
            allowed = ", ".join(dtype_label(d) for d in self.allowed_dtypes)
            raise ValueError(f"{what}={dtype_label(dtype)} is not supported by hardware profile {self.name!r}; "
                             f"allowed: {allowed}.")
        return dtype

    def allows_block_size(self, block_size: int) -> bool:
        """Whether the attention kernels of this profile accept ``block_size`` (empty list = any)."""
        return not self.kernel_block_sizes or block_size in self.kernel_block_sizes

    def check_block_size(self, block_size: int) -> int:
        """Return ``block_size`` if allowed, else raise ValueError naming it and the supported sizes."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        if not self.allows_block_size(block_size):
            raise ValueError(f"block_size={block_size} is not supported by hardware profile {self.name!r} "
                             f"(kernel block sizes: {list(self.kernel_block_sizes)}).")
        return block_size

    def align_block_size(self, min_block_size: int) -> int:
        """Smallest multiple of ``kernel_alignment`` that is >= ``min_block_size`` (mamba page rule)."""
        if min_block_size < 1:
            raise ValueError(f"min_block_size={min_block_size} must be >= 1")
        a = self.kernel_alignment
        return -(-min_block_size // a) * a
