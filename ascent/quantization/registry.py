"""Scheme registries keyed by ``(quant_type, layer_type)``.

``DEFAULT_REGISTRY`` serves every profile except 310P, which has its own (``REGISTRY_310P``: W8A8 / W8A8_DYNAMIC /
W8A8S / W8A8SC only, vLLM Ascend's ``_310p`` registry). Registering a key twice in one registry is a ValueError naming
both keys; asking for a missing key is a NotImplementedError naming both keys and listing what the registry has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ascent.quantization.base import LAYER_TYPES, QuantScheme, QuantSpec

SchemeT = TypeVar("SchemeT", bound=type[QuantScheme])


class SchemeRegistry:
    """A ``(quant_type, layer_type) -> scheme class`` table."""

    def __init__(self, name: str, label: str = "") -> None:
        self.name = name
        self.label = label  # message prefix, e.g. "[310P] "
        self._schemes: dict[tuple[str, str], type[QuantScheme]] = {}

    def register(self, quant_type: str, layer_type: str) -> Callable[[SchemeT], SchemeT]:
        """Class decorator: register the scheme for ``(quant_type, layer_type)``."""
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"{self.label}layer_type={layer_type!r} must be one of {LAYER_TYPES}")

        def wrap(cls: SchemeT) -> SchemeT:
            key = (quant_type, layer_type)
            if key in self._schemes and self._schemes[key] is not cls:
                raise ValueError(
                    f"{self.label}Scheme already registered for quant_type={quant_type!r}, "
                    f"layer_type={layer_type!r}: {self._schemes[key].__name__}")
            cls.quant_type, cls.layer_type = quant_type, layer_type
            self._schemes[key] = cls
            return cls

        return wrap

    def get(self, quant_type: str, layer_type: str) -> type[QuantScheme]:
        _load_builtin_schemes()
        cls = self._schemes.get((quant_type, layer_type))
        if cls is None:
            known = ", ".join(f"{q}/{lt}" for q, lt in sorted(self._schemes)) or "none"
            raise NotImplementedError(
                f"{self.label}Unsupported quant_type={quant_type!r} for layer_type={layer_type!r} "
                f"in the {self.name} scheme registry (supported: {known})")
        return cls

    def create(self, spec: QuantSpec) -> QuantScheme:
        """An instance of the scheme registered for ``(spec.quant_type, spec.layer_type)``."""
        return self.get(spec.quant_type, spec.layer_type)(spec)

    def keys(self) -> list[tuple[str, str]]:
        _load_builtin_schemes()
        return sorted(self._schemes)


DEFAULT_REGISTRY = SchemeRegistry("default")
REGISTRY_310P = SchemeRegistry("310p", label="[310P] ")


def register_scheme(quant_type: str, layer_type: str) -> Callable[[SchemeT], SchemeT]:
    return DEFAULT_REGISTRY.register(quant_type, layer_type)


def register_scheme_310p(quant_type: str, layer_type: str) -> Callable[[SchemeT], SchemeT]:
    return REGISTRY_310P.register(quant_type, layer_type)


def registry_for_profile(profile_name: str) -> SchemeRegistry:
    """The 310p profile gets the 310P registry; every other profile the default one."""
    return REGISTRY_310P if profile_name == "310p" else DEFAULT_REGISTRY


_BUILTINS_LOADED = False


def _load_builtin_schemes() -> None:
    """Import the scheme modules once so their decorators run (``ascent.quantization.schemes``)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import ascent.quantization.schemes  # noqa: F401
