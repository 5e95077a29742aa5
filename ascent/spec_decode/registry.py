"""Proposer registry by speculative method name.

Built-in proposers live in ``ascent.spec_decode.<module>`` and register themselves on import; ``get_proposer_cls``
imports the module that implements a method the first time it is asked for, so importing this registry stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ascent.spec_decode.base import Proposer

_BUILTIN_MODULES = {
    "ngram": "ngram",
    "suffix": "suffix",
    "draft_model": "draft_model",
    "medusa": "medusa",
    "eagle": "eagle",
    "eagle3": "eagle",
    "mtp": "mtp",
    "dflash": "dflash",
    "dspark": "dspark",
    "extract_hidden_states": "extract_hidden",
}

_PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(method: str) -> Callable[[type[Proposer]], type[Proposer]]:
    """Class decorator: register a ``Proposer`` subclass under ``method`` (sets ``cls.method``)."""

    def wrap(cls: type[Proposer]) -> type[Proposer]:
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise ValueError(f"{cls!r} registered for method {method!r} is not a Proposer subclass")
        existing = _PROPOSERS.get(method)
        if existing is not None and existing is not cls:
            raise ValueError(f"method={method!r} is already registered to {existing.__qualname__}")
        cls.method = method
        _PROPOSERS[method] = cls
        return cls

    return wrap


def get_proposer_cls(method: str) -> type[Proposer]:
    """The proposer class for ``method``; ValueError naming the method when none implements it."""
    if method not in _PROPOSERS and method in _BUILTIN_MODULES:
        module = f"ascent.spec_decode.{_BUILTIN_MODULES[method]}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    cls = _PROPOSERS.get(method)
    if cls is None:
        raise ValueError(f"speculative method={method!r} has no proposer; available: {registered_methods()}")
    return cls


def registered_methods() -> list[str]:
    """Methods registered so far (built-in modules register when ``get_proposer_cls`` first imports them)."""
    return sorted(_PROPOSERS)
