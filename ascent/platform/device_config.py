"""Platform resolution: ``--hardware-profile`` + ``--dtype`` -> (profile, torch device, model dtype), validated.

- ``auto`` selects ``cuda`` when a CUDA device is available, else ``cpu``.
- ``cpu`` runs on the CPU; ``cuda`` needs a CUDA device (error otherwise); the emulated Ascend profiles (a2, a3,
  310p, a5) run on whatever device is present (CUDA if available, else CPU).
- dtype None / ``"auto"`` picks ``auto_dtype`` (the model's preferred dtype, when given and allowed by the profile)
  or else the profile's default (fp16 for 310p); an explicit dtype the profile does not allow (e.g. bf16 under 310p)
  raises ValueError naming it.
The engine sets the resolved profile once at start with :func:`set_current_profile`; code that has no config at hand
reads it with :func:`get_current_profile`.
"""

from __future__ import annotations

import torch

from ascent.platform.families import get_hardware_profile
from ascent.platform.hardware import AUTO, HARDWARE_PROFILE_CHOICES, DeviceFamily
from ascent.platform.profile import DeviceRequirement, HardwareProfile, dtype_name

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
}

_current_profile: HardwareProfile | None = None


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype or a name (``float32/float/fp32``, ``bfloat16/bf16``, ``float16/half/fp16``, ``fp8``) -> dtype;
    None or ``"auto"`` -> None. Anything else raises ValueError naming the value."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower()
        if name == AUTO:
            return None
        if name in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[name]
    raise ValueError(f"dtype={dtype!r} is invalid: use auto or one of {sorted(_DTYPE_ALIASES)}.")


def parse_hardware_profile(hardware_profile: str) -> str:
    """Normalise a ``--hardware-profile`` value (``auto`` or a family name); else ValueError naming it."""
    name = hardware_profile.strip().lower() if isinstance(hardware_profile, str) else hardware_profile
    if name not in HARDWARE_PROFILE_CHOICES:
        raise ValueError(f"hardware_profile={hardware_profile!r} is invalid: must be one of "
                         f"{HARDWARE_PROFILE_CHOICES}.")
    return name


def select_device(profile: HardwareProfile, cuda_available: bool) -> torch.device:
    """The torch device ``profile`` runs on; ValueError when it needs CUDA and none is available."""
    if profile.device_requirement == DeviceRequirement.CPU:
        return torch.device("cpu")
    if profile.device_requirement == DeviceRequirement.CUDA and not cuda_available:
        raise ValueError(f"hardware_profile={profile.name!r} requested but no CUDA device is available "
                         f"(use --hardware-profile auto or cpu).")
    return torch.device("cuda") if cuda_available else torch.device("cpu")


def select_dtype(profile: HardwareProfile, dtype: torch.dtype | str | None,
                 auto_dtype: torch.dtype | None = None) -> torch.dtype:
    """The model dtype: an explicit ``dtype`` must be allowed by ``profile``; None/"auto" -> ``auto_dtype`` when
    the profile allows it, else ``profile.default_dtype``."""
    requested = parse_dtype(dtype)
    if requested is None:
        if auto_dtype is not None and profile.allows_dtype(auto_dtype):
            return auto_dtype
        return profile.default_dtype
    return profile.check_dtype(requested)


def resolve_platform(
    hardware_profile: str,
    dtype: torch.dtype | str | None = None,
    *,
    auto_dtype: torch.dtype | None = None,
    cuda_available: bool | None = None,
) -> tuple[HardwareProfile, torch.device, torch.dtype]:
    """Resolve and validate ``--hardware-profile`` and ``--dtype``.

    ``cuda_available`` defaults to ``torch.cuda.is_available()``. Returns ``(profile, device, dtype)``; raises
    ValueError naming the bad value for an unknown profile, ``cuda`` without a GPU, or a disallowed dtype.
    """
    name = parse_hardware_profile(hardware_profile)
    has_cuda = torch.cuda.is_available() if cuda_available is None else bool(cuda_available)
    if name == AUTO:
        name = DeviceFamily.CUDA.value if has_cuda else DeviceFamily.CPU.value
    profile = get_hardware_profile(name)
    return profile, select_device(profile, has_cuda), select_dtype(profile, dtype, auto_dtype)


def check_platform(profile: HardwareProfile, device: torch.device | str, dtype: torch.dtype) -> None:
    """Worker-start validation that ``device`` and ``dtype`` fit ``profile`` (ValueError naming the mismatch)."""
    device = torch.device(device)
    if profile.device_requirement == DeviceRequirement.CPU and device.type != "cpu":
        raise ValueError(f"device={device} does not match hardware profile {profile.name!r} (runs on cpu).")
    if profile.device_requirement == DeviceRequirement.CUDA:
        if device.type != "cuda":
            raise ValueError(f"device={device} does not match hardware profile {profile.name!r} (needs cuda).")
        if not torch.cuda.is_available():
            raise ValueError(f"hardware_profile={profile.name!r} requested but no CUDA device is available.")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} is not supported (cpu or cuda).")
    profile.check_dtype(dtype)


def set_current_profile(profile: HardwareProfile | None) -> HardwareProfile | None:
    """Set the process-wide profile (engine start; None clears it). Returns the previous one."""
    global _current_profile
    if profile is not None and not isinstance(profile, HardwareProfile):
        raise ValueError(f"profile={profile!r} is not a HardwareProfile")
    previous, _current_profile = _current_profile, profile
    return previous


def get_current_profile() -> HardwareProfile:
    """The profile set at engine start; before that, the ``auto`` profile (cuda if available, else cpu)."""
    if _current_profile is not None:
        return _current_profile
    return get_hardware_profile(DeviceFamily.CUDA if torch.cuda.is_available() else DeviceFamily.CPU)


def describe(profile: HardwareProfile, device: torch.device, dtype: torch.dtype) -> str:
    """One log line naming the resolved platform."""
    kind = "emulated on " if profile.emulated else "on "
    return f"hardware profile {profile.name} ({kind}{device.type}), dtype {dtype_name(dtype)}"
