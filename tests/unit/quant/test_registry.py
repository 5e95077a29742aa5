"""Scheme registry: duplicate keys, unknown keys, the separate 310P table and profile selection (spec §6, §12.7)."""

from __future__ import annotations

import pytest

from ascent.quantization.registry import (
    DEFAULT_REGISTRY,
    REGISTRY_310P,
    SchemeRegistry,
    registry_for_profile,
)
from tests.unit.quant.helpers import FakeInt8Linear, spec


def test_register_and_create() -> None:
    registry = SchemeRegistry("t")

    @registry.register("FAKE8", "linear")
    class Scheme(FakeInt8Linear):
        pass

    assert registry.keys()[0] == ("FAKE8", "linear")
    assert (Scheme.quant_type, Scheme.layer_type) == ("FAKE8", "linear")
    made = registry.create(spec("FAKE8"))
    assert isinstance(made, Scheme) and made.spec.quant_type == "FAKE8"
    registry.register("FAKE8", "linear")(Scheme)  # the same class again is not a conflict


def test_duplicate_registration_names_both_keys() -> None:
    registry = SchemeRegistry("t")
    registry.register("FAKE8", "linear")(type("A", (FakeInt8Linear,), {}))
    with pytest.raises(ValueError, match=r"Scheme already registered for quant_type='FAKE8', layer_type='linear'"):
        registry.register("FAKE8", "linear")(type("B", (FakeInt8Linear,), {}))


def test_unknown_key_names_both() -> None:
    registry = SchemeRegistry("t")
    with pytest.raises(NotImplementedError, match=r"quant_type='NF4' for layer_type='moe'"):
        registry.get("NF4", "moe")
    with pytest.raises(ValueError, match="layer_type='conv'"):
        registry.register("W8A8", "conv")


def test_310p_registry_is_separate_and_prefixed() -> None:
    registry = SchemeRegistry("310p-test", label="[310P] ")
    registry.register("FAKE8", "linear")(type("A", (FakeInt8Linear,), {}))
    with pytest.raises(ValueError, match=r"^\[310P\] Scheme already registered"):
        registry.register("FAKE8", "linear")(type("B", (FakeInt8Linear,), {}))
    with pytest.raises(NotImplementedError, match=r"^\[310P\] Unsupported quant_type='W4A16' for layer_type='linear'"):
        registry.get("W4A16", "linear")
    assert REGISTRY_310P is not DEFAULT_REGISTRY and REGISTRY_310P.label == "[310P] "
    # the 310P table has no weight-only schemes: asking for one names both keys with the 310P prefix
    with pytest.raises(NotImplementedError, match=r"^\[310P\] .*quant_type='W4A16_MXFP4'.*layer_type='linear'"):
        REGISTRY_310P.get("W4A16_MXFP4", "linear")


@pytest.mark.parametrize("profile,expected", [("310p", "310p"), ("cpu", "default"), ("cuda", "default"),
                                              ("a2", "default"), ("a3", "default"), ("a5", "default")])
def test_registry_for_profile(profile: str, expected: str) -> None:
    assert registry_for_profile(profile).name == expected
