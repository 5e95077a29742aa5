"""THE family table: which implementation / policy / value each hardware family gets per slot.

This is the only module that maps family names to behaviour (specs/device_ops.md §1.3 and §1.5); everything else
reads the selected :class:`HardwareProfile`. ``_TABLE`` has one column per family and one row per profile field;
cells are the string values of the field's enum, dtype lists are ``/``-separated, ``any`` = no kernel block-size
restriction, ``cfg`` = the model/config choice. Capability sets follow in ``FAMILY_CAPABILITIES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from ascent.platform.hardware import DeviceFamily, UnsupportedDeviceError, family_from_name
from ascent.platform.profile import (
    AttentionBackendFamily,
    BlockTableImpl,
    CPUBindingMode,
    DeviceAdaptorFamily,
    DeviceAddressingMode,
    DeviceRequirement,
    FusedKernels,
    GraphMode,
    HardwareCapability as Cap,
    HardwareProfile,
    MoECommPolicy,
    QuantizationBackendFamily,
    RNGPlacement,
    WeightLayoutPolicy,
)

_TABLE = """
field               cpu             cuda            a2                a3                 310p           a5
attention_backend   standard        standard        standard          standard           compat310p     standard
device_adaptor      standard        standard        standard          standard           compat310p     fp8
quant_backend       standard        standard        standard          standard           w8a8_only      standard
weight_layout       configurable    configurable    configurable      configurable       force_nz       configurable
moe_comm            size_based      size_based      capacity_density  fused_or_capacity  allgather      capacity_world
rng_placement       host_cdf        device          device            device             host_cdf       device
allowed_dtypes      fp32/bf16/fp16  bf16/fp16/fp32  bf16/fp16         bf16/fp16          fp16           bf16/fp16/fp8
default_dtype       bf16            bf16            bf16              bf16               fp16           bf16
kernel_block_sizes  any             any             any               any                128/64         any
kernel_alignment    16              16              128               128                128            128
slot_mapping_dtype  int64           int64           int32             int32              int32          int32
graph_mode          none            cuda_graphs     none              none               decode_only    none
fused_kernels       no              optional        emulated          emulated           no             yes
block_table_impl    numpy           torch           torch             torch              numpy          torch
gdn_state_dtype     cfg             cfg             cfg               cfg                fp16           cfg
mamba_k_half_exact  no              no              yes               yes                no             no
cpu_binding         none            none            topo_affinity     global_slice       topo_affinity  topo_affinity
device_addressing   direct          direct          direct            dual_chip          direct         direct
device_requirement  cpu             cuda            any               any                any            any
"""

# vllm-ascend capability sets (§1.3) ...
_STANDARD_SET = frozenset({
    Cap.AUTO_ENABLE_CUSTOM_OPS, Cap.BGMV_SGMV_META_REGISTRATION, Cap.IRQ_CPU_RESERVATION, Cap.LORA_CUSTOM_OPS,
    Cap.MC2_HIERARCHY_COMM, Cap.NPUGRAPH_EX, Cap.RUNTIME_CUSTOM_OPS, Cap.SFA_DCP_REPLICATED_INDEXER,
    Cap.STANDARD_WORKER_PATCHES,
})
_COMPAT_SET = frozenset({
    Cap.COMPATIBILITY_OP_IMPLEMENTATIONS, Cap.IRQ_CPU_RESERVATION, Cap.RC_DEVICE_DISCOVERY, Cap.RUNTIME_CUSTOM_OPS,
})
_A5_SET = frozenset({
    Cap.AUTO_ENABLE_CUSTOM_OPS, Cap.BGMV_SGMV_META_REGISTRATION, Cap.CLUSTER_CPU_TOPOLOGY,
    Cap.DYNAMIC_MX_QUANT_FUSION, Cap.LORA_CUSTOM_OPS, Cap.NPUGRAPH_EX, Cap.REDUCED_CUDAGRAPH_CAPTURE_SIZES,
    Cap.STANDARD_WORKER_PATCHES,
})
# ... plus the PR #14059 switch points (the device-type branches still on upstream main, §1.4).
_A2_SWITCHES = frozenset({
    Cap.ATB_EXTENSIONS, Cap.ATB_WARMUP, Cap.FUSED_SWIGLU_TUNING_ARGS, Cap.GRAPH_MULS_ADD_FUSION,
    Cap.GRAPH_NORM_QUANT_FUSION, Cap.NPU_TOP_K_TOP_P, Cap.PAGED_ATTENTION, Cap.STANDARD_MAMBA_PATCH,
    Cap.TRITON_BATCH_MEMCPY,
})
_A3_SWITCHES = _A2_SWITCHES | {Cap.MOE_DISPATCH_EXTRA_ARGS}
_310P_SWITCHES = frozenset({
    Cap.DISTRIBUTED_COMMUNICATION_ADAPTATION, Cap.FUSED_MOE_COMPATIBILITY, Cap.FUSED_SWIGLU_TUNING_ARGS,
    Cap.GDN_COMPATIBILITY,
})
_A5_SWITCHES = frozenset({
    Cap.CHUNKED_PREFILL_PHASE_SPLIT, Cap.DSV4_COMPRESSED_CACHE, Cap.FP8_ATTENTION, Cap.GRAPH_MULS_ADD_FUSION,
    Cap.GRAPH_NORM_QUANT_FUSION, Cap.LOCAL_KV_COMM_RESOURCE, Cap.MOE_DISPATCH_EXTRA_ARGS,
    Cap.MOE_DISPATCH_SHARED_EXPERT_ARGS, Cap.STANDARD_MAMBA_PATCH, Cap.TRITON_BATCH_MEMCPY, Cap.UNRESTRICTED_MLAPO,
})

FAMILY_CAPABILITIES: Mapping[DeviceFamily, frozenset[Cap]] = MappingProxyType({
    DeviceFamily.CPU: frozenset({Cap.RUNTIME_CUSTOM_OPS}),
    DeviceFamily.CUDA: frozenset({Cap.RUNTIME_CUSTOM_OPS, Cap.NPUGRAPH_EX}),
    DeviceFamily.A2: _STANDARD_SET | _A2_SWITCHES,
    DeviceFamily.A3: _STANDARD_SET | _A3_SWITCHES,
    DeviceFamily.P310: _COMPAT_SET | _310P_SWITCHES,
    DeviceFamily.A5: _A5_SET | _A5_SWITCHES,
})

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
           "int32": torch.int32, "int64": torch.int64}
_ENUM_FIELDS: dict[str, type] = {
    "attention_backend": AttentionBackendFamily,
    "device_adaptor": DeviceAdaptorFamily,
    "quant_backend": QuantizationBackendFamily,
    "weight_layout": WeightLayoutPolicy,
    "moe_comm": MoECommPolicy,
    "rng_placement": RNGPlacement,
    "graph_mode": GraphMode,
    "fused_kernels": FusedKernels,
    "block_table_impl": BlockTableImpl,
    "cpu_binding": CPUBindingMode,
    "device_addressing": DeviceAddressingMode,
    "device_requirement": DeviceRequirement,
}


def _cell(field: str, text: str) -> Any:
    if field in _ENUM_FIELDS:
        return _ENUM_FIELDS[field](text)
    if field == "allowed_dtypes":
        return tuple(_DTYPES[t] for t in text.split("/"))
    if field in ("default_dtype", "slot_mapping_dtype"):
        return _DTYPES[text]
    if field == "gdn_state_dtype":
        return None if text == "cfg" else _DTYPES[text]
    if field == "kernel_block_sizes":
        return () if text == "any" else tuple(int(t) for t in text.split("/"))
    if field == "kernel_alignment":
        return int(text)
    if field == "mamba_k_half_exact":
        return {"yes": True, "no": False}[text]
    raise KeyError(f"family table row {field!r} has no parser")


def _parse_table(text: str) -> dict[DeviceFamily, dict[str, str]]:
    """``_TABLE`` -> family -> field -> cell text."""
    header, *rows = (line.split() for line in text.strip().splitlines())
    families = [family_from_name(name) for name in header[1:]]
    table: dict[DeviceFamily, dict[str, str]] = {family: {} for family in families}
    for field, *cells in rows:
        if len(cells) != len(families):
            raise ValueError(f"family table row {field!r} has {len(cells)} cells, expected {len(families)}")
        for family, cell in zip(families, cells):
            table[family][field] = cell
    return table


FAMILY_TABLE: Mapping[DeviceFamily, Mapping[str, str]] = MappingProxyType(
    {family: MappingProxyType(row) for family, row in _parse_table(_TABLE).items()})


def _build_profiles() -> Mapping[DeviceFamily, HardwareProfile]:
    profiles = {}
    for family, row in FAMILY_TABLE.items():
        values = {field: _cell(field, text) for field, text in row.items()}
        profiles[family] = HardwareProfile(family=family, capabilities=FAMILY_CAPABILITIES[family], **values)
    return MappingProxyType(profiles)


PROFILES: Mapping[DeviceFamily, HardwareProfile] = _build_profiles()


def get_hardware_profile(family: DeviceFamily | str) -> HardwareProfile:
    """The profile of ``family`` (a :class:`DeviceFamily` or its name, e.g. ``"310p"``).

    ``"auto"`` is not a family (resolve it with ``device_config.resolve_platform``); unknown names raise
    UnsupportedDeviceError (a ValueError) naming the value.
    """
    try:
        fam = family_from_name(family)
    except UnsupportedDeviceError as exc:
        raise UnsupportedDeviceError(f"No hardware profile is registered for {family!r}: {exc}") from None
    return PROFILES[fam]
