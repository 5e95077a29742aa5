"""Hardware identity: device families and SOC-version parsing (standard library only).

Families are the six values of ``--hardware-profile`` (besides ``auto``). Ascend identity comes either from a
compile-time SOC string (``SOC_VERSION`` / npu-smi names) or from the integer code the Ascend runtime reports;
both map onto the same four Ascend families. Code outside ``ascent.platform`` never branches on a family: it asks
the :class:`~ascent.platform.profile.HardwareProfile` selected for it.
"""

from __future__ import annotations

from enum import Enum


class UnsupportedDeviceError(ValueError, RuntimeError):
    """An unknown family name, SOC string or runtime SOC code (a ValueError naming the value; also a RuntimeError,
    the type upstream raises for the same cases)."""


class DeviceFamily(str, Enum):
    """A hardware family; the value is the ``--hardware-profile`` spelling."""

    CPU = "cpu"
    CUDA = "cuda"
    A2 = "a2"
    A3 = "a3"
    P310 = "310p"
    A5 = "a5"

    def __str__(self) -> str:
        return self.value


AUTO = "auto"
HARDWARE_PROFILE_CHOICES: tuple[str, ...] = (AUTO,) + tuple(f.value for f in DeviceFamily)

_SOC_VERSIONS: dict[str, DeviceFamily] = {
    "910b": DeviceFamily.A2,
    "ascend910b1": DeviceFamily.A2,
    "ascend910b2": DeviceFamily.A2,
    "ascend910b2c": DeviceFamily.A2,
    "ascend910b3": DeviceFamily.A2,
    "ascend910b4": DeviceFamily.A2,
    "ascend910b4-1": DeviceFamily.A2,
    "910c": DeviceFamily.A3,
    "ascend910_9391": DeviceFamily.A3,
    "ascend910_9381": DeviceFamily.A3,
    "ascend910_9372": DeviceFamily.A3,
    "ascend910_9392": DeviceFamily.A3,
    "ascend910_9382": DeviceFamily.A3,
    "ascend910_9362": DeviceFamily.A3,
    "310p": DeviceFamily.P310,
    "ascend310p1": DeviceFamily.P310,
    "ascend310p3": DeviceFamily.P310,
    "ascend310p5": DeviceFamily.P310,
    "ascend310p7": DeviceFamily.P310,
    "ascend310p3vir01": DeviceFamily.P310,
    "ascend310p3vir02": DeviceFamily.P310,
    "ascend310p3vir04": DeviceFamily.P310,
    "ascend310p3vir08": DeviceFamily.P310,
}
_A5_MARKER = "ascend950"

# Inclusive runtime SOC code ranges reported by the Ascend runtime.
_RUNTIME_RANGES: tuple[tuple[int, int, DeviceFamily], ...] = (
    (220, 225, DeviceFamily.A2),
    (250, 255, DeviceFamily.A3),
    (200, 205, DeviceFamily.P310),
    (260, 260, DeviceFamily.A5),
)


def family_from_name(name: str) -> DeviceFamily:
    """Family name (``cpu | cuda | a2 | a3 | 310p | a5``, case-insensitive) -> family; else UnsupportedDeviceError."""
    if isinstance(name, DeviceFamily):
        return name
    if not isinstance(name, str):
        raise UnsupportedDeviceError(f"hardware family {name!r} is invalid: expected a string")
    try:
        return DeviceFamily(name.strip().lower())
    except ValueError:
        choices = tuple(f.value for f in DeviceFamily)
        raise UnsupportedDeviceError(f"hardware family {name!r} is unknown: must be one of {choices}") from None


def device_type_from_soc_version(soc_version: str) -> DeviceFamily:
    """Compile-time SOC string -> Ascend family.

    Stripped and lower-cased; any string containing ``ascend950`` is A5, otherwise an exact table lookup
    (A2: ``910b``, ``ascend910b1/b2/b2c/b3/b4/b4-1``; A3: ``910c``, ``ascend910_9391/9381/9372/9392/9382/9362``;
    310P: ``310p``, ``ascend310p1/p3/p5/p7``, ``ascend310p3vir01/02/04/08``). Unknown -> UnsupportedDeviceError
    ("Undefined soc_version: ...").
    """
    if not isinstance(soc_version, str):
        raise UnsupportedDeviceError(f"Undefined soc_version: {soc_version!r}. soc_version must be a string.")
    normalized = soc_version.strip().lower()
    if _A5_MARKER in normalized:
        return DeviceFamily.A5
    family = _SOC_VERSIONS.get(normalized)
    if family is None:
        raise UnsupportedDeviceError(f"Undefined soc_version: {soc_version!r}. Please file an issue.")
    return family


def device_type_from_runtime_soc(soc_code: int) -> DeviceFamily:
    """Runtime integer SOC code -> Ascend family: 220-225 A2, 250-255 A3, 200-205 310P, exactly 260 A5 (inclusive).

    Anything else (including bools and non-integers) -> UnsupportedDeviceError ("Cannot support runtime
    soc_version: ...").
    """
    if isinstance(soc_code, bool) or not isinstance(soc_code, int):
        raise UnsupportedDeviceError(f"Cannot support runtime soc_version: {soc_code!r} (expected an int).")
    for low, high, family in _RUNTIME_RANGES:
        if low <= soc_code <= high:
            return family
    raise UnsupportedDeviceError(f"Cannot support runtime soc_version: {soc_code!r}.")


def check_device_type_matches(built: DeviceFamily, runtime_soc_code: int) -> None:
    """Raise UnsupportedDeviceError when the runtime SOC code names another family than ``built``."""
    current = device_type_from_runtime_soc(runtime_soc_code)
    if current != built:
        raise UnsupportedDeviceError(
            f"Current device type: {current.value} does not match the installed version's device type: "
            f"{built.value} (runtime soc_version {runtime_soc_code!r}).")
