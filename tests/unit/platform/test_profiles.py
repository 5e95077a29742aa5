"""Profile tables (specs/device_ops.md §1.3/§1.5, ARCHITECTURE.md §4), supports(), platform resolution."""

from __future__ import annotations

import pytest
import torch

from ascent.platform import (
    A5DeviceAdaptor,
    A310PDeviceAdaptor,
    DeviceAdaptor,
    HardwareCapability as C,
    check_platform,
    get_current_profile,
    get_device_adaptor,
    get_hardware_profile,
    resolve_platform,
    set_current_profile,
)
from ascent.platform.device_config import parse_dtype
from ascent.platform.families import PROFILES
from ascent.sample.rng import check_placement

FP32, BF16, FP16, FP8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
FAMILIES = ["cpu", "cuda", "a2", "a3", "310p", "a5"]

# Transcribed from the spec tables (one column per family, same order as FAMILIES).
SPEC = {
    "attention_backend": ["standard", "standard", "standard", "standard", "compat310p", "standard"],
    "rng_placement": ["host_cdf", "device", "device", "device", "host_cdf", "device"],
    "allowed_dtypes": [{FP32, BF16, FP16}, {BF16, FP16, FP32}, {BF16, FP16}, {BF16, FP16}, {FP16}, {BF16, FP16, FP8}],
    "kernel_alignment": [16, 16, 128, 128, 128, 128],
    "slot_mapping_dtype": [torch.int64, torch.int64, torch.int32, torch.int32, torch.int32, torch.int32],
    "fused_kernels": ["no", "optional", "emulated", "emulated", "no", "yes"],
    "block_table_impl": ["numpy", "torch", "torch", "torch", "numpy", "torch"],
    "kernel_block_sizes": [(), (), (), (), (128, 64), ()],
    "gdn_state_dtype": [None, None, None, None, FP16, None],
    "mamba_k_half_exact": [False, False, True, True, False, False],
    "graph_mode": ["none", "cuda_graphs", "none", "none", "decode_only", "none"],
    "weight_layout": ["configurable"] * 4 + ["force_nz", "configurable"],
    "moe_comm": ["size_based", "size_based", "capacity_density", "fused_or_capacity", "allgather", "capacity_world"],
    "cpu_binding": ["none", "none", "topo_affinity", "global_slice", "topo_affinity", "topo_affinity"],
    "device_addressing": ["direct", "direct", "direct", "dual_chip", "direct", "direct"],
    "emulated": [False, False, True, True, True, True],
}
# device_adaptor / quant_backend families per §1.5: STANDARD, FP8_OPTIMIZED (a5), COMPATIBILITY (310p).
ADAPTOR_CLASS = [DeviceAdaptor, DeviceAdaptor, DeviceAdaptor, DeviceAdaptor, A310PDeviceAdaptor, A5DeviceAdaptor]
QUANT_COMPAT = [False, False, False, False, True, False]

STANDARD_SET = {C.AUTO_ENABLE_CUSTOM_OPS, C.BGMV_SGMV_META_REGISTRATION, C.IRQ_CPU_RESERVATION, C.LORA_CUSTOM_OPS,
                C.MC2_HIERARCHY_COMM, C.NPUGRAPH_EX, C.RUNTIME_CUSTOM_OPS, C.SFA_DCP_REPLICATED_INDEXER,
                C.STANDARD_WORKER_PATCHES}
CORE_CAPS = {
    "cpu": {C.RUNTIME_CUSTOM_OPS},
    "cuda": {C.RUNTIME_CUSTOM_OPS, C.NPUGRAPH_EX},
    "a2": STANDARD_SET,
    "a3": STANDARD_SET,
    "310p": {C.COMPATIBILITY_OP_IMPLEMENTATIONS, C.IRQ_CPU_RESERVATION, C.RC_DEVICE_DISCOVERY, C.RUNTIME_CUSTOM_OPS},
    "a5": {C.AUTO_ENABLE_CUSTOM_OPS, C.BGMV_SGMV_META_REGISTRATION, C.CLUSTER_CPU_TOPOLOGY, C.DYNAMIC_MX_QUANT_FUSION,
           C.LORA_CUSTOM_OPS, C.NPUGRAPH_EX, C.REDUCED_CUDAGRAPH_CAPTURE_SIZES, C.STANDARD_WORKER_PATCHES},
}


@pytest.mark.parametrize("col, name", list(enumerate(FAMILIES)))
def test_profile_fields_match_spec_table(col: int, name: str) -> None:
    p = get_hardware_profile(name)
    assert p.name == name and PROFILES[p.family] is p
    for field, row in SPEC.items():
        value = getattr(p, field)
        actual = set(value) if field == "allowed_dtypes" else value
        assert actual == row[col], (name, field)
    assert type(get_device_adaptor(p)) is ADAPTOR_CLASS[col]
    assert (p.quant_backend != "standard") == QUANT_COMPAT[col]
    assert p.default_dtype in p.allowed_dtypes
    assert p.default_dtype == (FP16 if name == "310p" else BF16)
    check_placement(p.rng_placement)  # the sampler accepts every profile's placement


@pytest.mark.parametrize("name", FAMILIES)
def test_capability_sets(name: str) -> None:
    p = get_hardware_profile(name)
    assert CORE_CAPS[name] <= p.capabilities
    if name in ("cpu", "cuda"):
        assert p.capabilities == CORE_CAPS[name]
    for cap in C:
        assert p.supports(cap) == (cap in p.capabilities)
        assert p.supports(cap.value) == (cap in p.capabilities)


def test_capability_spot_checks() -> None:
    a2, a3, p310, a5 = (get_hardware_profile(n) for n in ("a2", "a3", "310p", "a5"))
    assert a2.supports(C.NPU_TOP_K_TOP_P) and a3.supports(C.NPU_TOP_K_TOP_P)
    assert not p310.supports(C.NPU_TOP_K_TOP_P) and not a5.supports(C.NPU_TOP_K_TOP_P)
    assert not a5.supports(C.RUNTIME_CUSTOM_OPS) and not a5.supports(C.IRQ_CPU_RESERVATION)
    assert a5.supports(C.DYNAMIC_MX_QUANT_FUSION) and not a2.supports(C.DYNAMIC_MX_QUANT_FUSION)
    assert p310.supports(C.GDN_COMPATIBILITY) and not p310.supports(C.TRITON_BATCH_MEMCPY)
    with pytest.raises(ValueError, match="'warp_drive'"):
        a2.supports("warp_drive")


def test_unknown_family_is_a_clear_error() -> None:
    for bad in ("tpu", "auto", "", "910b"):
        with pytest.raises(ValueError, match=repr(bad)):
            get_hardware_profile(bad)


def test_profiles_are_frozen() -> None:
    p = get_hardware_profile("cpu")
    with pytest.raises(AttributeError):
        p.rng_placement = "device"  # type: ignore[misc]


def test_block_sizes() -> None:
    p310, cpu, a2 = get_hardware_profile("310p"), get_hardware_profile("cpu"), get_hardware_profile("a2")
    assert p310.check_block_size(128) == 128 and p310.check_block_size(64) == 64
    with pytest.raises(ValueError, match="block_size=16"):
        p310.check_block_size(16)
    assert cpu.check_block_size(4) == 4 and cpu.allows_block_size(16)
    assert [cpu.align_block_size(n) for n in (1, 16, 17, 528)] == [16, 16, 32, 528]
    assert [a2.align_block_size(n) for n in (1, 128, 129, 528)] == [128, 128, 256, 640]


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_selection(cuda: bool) -> None:
    p, device, dtype = resolve_platform("auto", None, cuda_available=cuda)
    assert p.name == ("cuda" if cuda else "cpu") and device.type == ("cuda" if cuda else "cpu")
    assert dtype == BF16


@pytest.mark.parametrize("name", ["a2", "a3", "310p", "a5"])
@pytest.mark.parametrize("cuda", [False, True])
def test_emulated_profiles_run_on_present_device(name: str, cuda: bool) -> None:
    p, device, _ = resolve_platform(name, cuda_available=cuda)
    assert p.name == name and p.emulated and device.type == ("cuda" if cuda else "cpu")


def test_cpu_profile_stays_on_cpu() -> None:
    assert resolve_platform("cpu", cuda_available=True)[1].type == "cpu"


def test_cuda_without_gpu_is_an_error() -> None:
    with pytest.raises(ValueError, match="hardware_profile='cuda'.*no CUDA device"):
        resolve_platform("cuda", cuda_available=False)


def test_unknown_profile_names_the_value() -> None:
    with pytest.raises(ValueError, match="hardware_profile='tpu'"):
        resolve_platform("tpu")
    assert resolve_platform(" A2 ", cuda_available=False)[0].name == "a2"


def test_dtype_validation_and_defaults() -> None:
    msg = r"dtype=bfloat16 \(bf16\) is not supported by hardware profile '310p'; allowed: float16 \(fp16\)"
    with pytest.raises(ValueError, match=msg):
        resolve_platform("310p", torch.bfloat16, cuda_available=False)
    with pytest.raises(ValueError, match="dtype=bfloat16"):
        resolve_platform("310p", "bf16", cuda_available=False)
    with pytest.raises(ValueError, match="dtype=float32 \\(fp32\\).*'a2'"):
        resolve_platform("a2", "float32", cuda_available=False)
    assert resolve_platform("310p", None, cuda_available=False)[2] == FP16
    assert resolve_platform("310p", "auto", cuda_available=False)[2] == FP16
    assert resolve_platform("310p", "auto", auto_dtype=BF16, cuda_available=False)[2] == FP16
    assert resolve_platform("cpu", "auto", auto_dtype=FP32, cuda_available=False)[2] == FP32
    assert resolve_platform("cpu", "half", cuda_available=False)[2] == FP16
    assert resolve_platform("a5", "fp8", cuda_available=False)[2] == FP8
    with pytest.raises(ValueError, match="dtype='int4'"):
        resolve_platform("cpu", "int4", cuda_available=False)
    assert parse_dtype("AUTO") is None and parse_dtype(torch.float16) is torch.float16


def test_check_platform_at_worker_start() -> None:
    cpu, p310, cuda = (get_hardware_profile(n) for n in ("cpu", "310p", "cuda"))
    check_platform(cpu, "cpu", FP32)
    check_platform(p310, torch.device("cpu"), FP16)
    with pytest.raises(ValueError, match="dtype=bfloat16"):
        check_platform(p310, "cpu", BF16)
    with pytest.raises(ValueError, match="device=cpu"):
        check_platform(cuda, "cpu", BF16)
    with pytest.raises(ValueError, match="device=meta"):
        check_platform(get_hardware_profile("a2"), "meta", BF16)


def test_current_profile_set_and_reset() -> None:
    a3 = get_hardware_profile("a3")
    previous = set_current_profile(a3)
    try:
        assert get_current_profile() is a3
    finally:
        set_current_profile(previous)
    set_current_profile(None)
    try:
        default = get_current_profile()
        assert default.name == ("cuda" if torch.cuda.is_available() else "cpu")
    finally:
        set_current_profile(previous)
    with pytest.raises(ValueError, match="profile='a3'"):
        set_current_profile("a3")  # type: ignore[arg-type]
