"""SOC-version parsing: the accept/reject vectors of specs/device_ops.md §1.1."""

from __future__ import annotations

import pytest

from ascent.platform.hardware import (
    HARDWARE_PROFILE_CHOICES,
    DeviceFamily,
    UnsupportedDeviceError,
    check_device_type_matches,
    device_type_from_runtime_soc,
    device_type_from_soc_version,
    family_from_name,
)

A2, A3, P310, A5 = DeviceFamily.A2, DeviceFamily.A3, DeviceFamily.P310, DeviceFamily.A5

SOC_ACCEPT = [
    # the spec's explicit test vectors
    ("ascend910b1", A2), ("ASCEND910_9391", A3), ("ascend310p3vir08", P310), ("ascend950_9599", A5),
    # the whole table
    ("910b", A2), ("ascend910b2", A2), ("ascend910b2c", A2), ("ascend910b3", A2), ("ascend910b4", A2),
    ("ascend910b4-1", A2),
    ("910c", A3), ("ascend910_9381", A3), ("ascend910_9372", A3), ("ascend910_9392", A3), ("ascend910_9382", A3),
    ("ascend910_9362", A3),
    ("310p", P310), ("ascend310p1", P310), ("ascend310p3", P310), ("ascend310p5", P310), ("ascend310p7", P310),
    ("ascend310p3vir01", P310), ("ascend310p3vir02", P310), ("ascend310p3vir04", P310),
    # normalisation: strip + lower; any string containing ascend950 is A5
    ("  Ascend910B1\n", A2), ("Ascend950PR_9579", A5), ("xxascend950", A5),
]
SOC_REJECT = ["unknown", "ascend910x", "", "ascend910", "ascend310p9", "ascend910_9399", "910", "ascend95"]


@pytest.mark.parametrize("soc, family", SOC_ACCEPT)
def test_soc_version_accepted(soc: str, family: DeviceFamily) -> None:
    assert device_type_from_soc_version(soc) is family


@pytest.mark.parametrize("soc", SOC_REJECT)
def test_soc_version_rejected(soc: str) -> None:
    with pytest.raises(UnsupportedDeviceError, match="Undefined soc_version") as info:
        device_type_from_soc_version(soc)
    assert repr(soc) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_soc_version_non_string_rejected() -> None:
    with pytest.raises(ValueError, match="Undefined soc_version"):
        device_type_from_soc_version(910)  # type: ignore[arg-type]


def _runtime_reference(code: int) -> DeviceFamily | None:
    if 220 <= code <= 225:
        return A2
    if 250 <= code <= 255:
        return A3
    if 200 <= code <= 205:
        return P310
    return A5 if code == 260 else None


@pytest.mark.parametrize("code", list(range(190, 270)) + [-1, 0, 1000])
def test_runtime_soc_ranges_inclusive(code: int) -> None:
    expected = _runtime_reference(code)
    if expected is None:
        with pytest.raises(UnsupportedDeviceError, match=f"Cannot support runtime soc_version: {code}"):
            device_type_from_runtime_soc(code)
    else:
        assert device_type_from_runtime_soc(code) is expected


@pytest.mark.parametrize("code", [220.0, "220", True, None])
def test_runtime_soc_non_int_rejected(code: object) -> None:
    with pytest.raises(ValueError, match="Cannot support runtime soc_version"):
        device_type_from_runtime_soc(code)  # type: ignore[arg-type]


def test_runtime_edges() -> None:
    assert [device_type_from_runtime_soc(c) for c in (200, 205, 220, 225, 250, 255, 260)] == [
        P310, P310, A2, A2, A3, A3, A5]
    for code in (199, 206, 219, 226, 249, 256, 259, 261):
        with pytest.raises(UnsupportedDeviceError):
            device_type_from_runtime_soc(code)


def test_family_names() -> None:
    assert HARDWARE_PROFILE_CHOICES == ("auto", "cpu", "cuda", "a2", "a3", "310p", "a5")
    for name in HARDWARE_PROFILE_CHOICES[1:]:
        assert family_from_name(name).value == name
        assert family_from_name(f" {name.upper()} ").value == name
    with pytest.raises(ValueError, match="'tpu'"):
        family_from_name("tpu")
    with pytest.raises(ValueError, match="'auto'"):
        family_from_name("auto")


def test_runtime_mismatch_detected() -> None:
    check_device_type_matches(A2, 223)
    with pytest.raises(UnsupportedDeviceError, match="does not match the installed version's device type"):
        check_device_type_matches(A2, 252)
