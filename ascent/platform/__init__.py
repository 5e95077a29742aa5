"""Hardware families, profiles, platform resolution and the device-op facade (ARCHITECTURE.md §4)."""

from ascent.platform.adaptor import (
    A5DeviceAdaptor,
    A310PDeviceAdaptor,
    DeviceAdaptor,
    MoERouting,
    get_device_adaptor,
)
from ascent.platform.device_config import (
    check_platform,
    get_current_profile,
    parse_dtype,
    resolve_platform,
    set_current_profile,
)
from ascent.platform.families import PROFILES, get_hardware_profile
from ascent.platform.hardware import (
    HARDWARE_PROFILE_CHOICES,
    DeviceFamily,
    UnsupportedDeviceError,
    device_type_from_runtime_soc,
    device_type_from_soc_version,
)
from ascent.platform.profile import (
    AttentionBackendFamily,
    BlockTableImpl,
    DeviceAdaptorFamily,
    FusedKernels,
    GraphMode,
    HardwareCapability,
    HardwareProfile,
    MoECommPolicy,
    QuantizationBackendFamily,
    RNGPlacement,
    WeightLayoutPolicy,
)

__all__ = [
    "A310PDeviceAdaptor",
    "A5DeviceAdaptor",
    "AttentionBackendFamily",
    "BlockTableImpl",
    "DeviceAdaptor",
    "DeviceAdaptorFamily",
    "DeviceFamily",
    "FusedKernels",
    "GraphMode",
    "HARDWARE_PROFILE_CHOICES",
    "HardwareCapability",
    "HardwareProfile",
    "MoECommPolicy",
    "MoERouting",
    "PROFILES",
    "QuantizationBackendFamily",
    "RNGPlacement",
    "UnsupportedDeviceError",
    "WeightLayoutPolicy",
    "check_platform",
    "device_type_from_runtime_soc",
    "device_type_from_soc_version",
    "get_current_profile",
    "get_device_adaptor",
    "get_hardware_profile",
    "parse_dtype",
    "resolve_platform",
    "set_current_profile",
]
