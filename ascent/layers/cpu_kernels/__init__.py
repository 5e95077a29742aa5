"""Fused CPU kernels (C++), built on first use with the system compiler: the CPU profile's RUNTIME_CUSTOM_OPS.

On CPU every aten op costs a fixed dispatch + cold-cache price; in a decode step the weight stream evicts the caches
between layers, so a 4-op RMSNorm costs ~30-40 µs where one fused call costs a few. ``fused_cpu.cpp`` holds
``rms_norm``, ``add_rms_norm``, ``rotary_`` and ``silu_and_mul`` with the rounding of the torch ops they replace.

``fused_ops()`` returns the compiled module, or None when the kernels do not apply: disabled with
``ASCENT_CPU_FUSED_OPS=0``, the current hardware profile lacks ``RUNTIME_CUSTOM_OPS``, or the build failed (no
compiler: one warning, then the torch paths are used). The build is cached under ``$ASCENT_CACHE_DIR`` (default
``~/.cache/ascent``) keyed by the sources' bytes and directory, the torch version and the CPU, so later processes only
load the library. Builds and loads of one module are serialized across processes by an OS file lock
(:func:`exclusive_build`), which a killed process cannot leave behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own baton only
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused_cpu.cpp")


def _build_dir(source_hash: str) -> Path:
    root = Path(os.environ.get("ASCENT_CACHE_DIR") or Path.home() / ".cache" / "ascent")
    return root / "cpu_kernels" / f"{source_hash}-torch{torch.__version__}-{platform.machine()}"


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s ascent lock: an ``flock`` on ``build_dir/ascent.lock``, which the OS releases when its
    holder exits or is killed. torch's ``cpp_extension.load`` guards a build with a baton file (``build_dir/lock``)
    that a process killed mid-build (Ctrl-C during the first start-up) leaves behind, and every later load then waits
    on it forever. Every ascent load takes this lock first, so a baton found while holding it is such a leftover and is
    removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "ascent.lock", "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _compile_flags() -> list[str]:
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-fopenmp"] + (["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"] if avx2 else [])


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _included(source_name: str) -> list[str]:
    """Every kernel source of this directory that ``source_name`` #includes (``#include "..."``), directly or through
    another, once each: their bytes are part of the build hash, so editing any header rebuilds its modules."""
    found: list[str] = []
    pending = [source_name]
    while pending:
        text = Path(__file__).with_name(pending.pop()).read_bytes()
        for match in _LOCAL_INCLUDE.finditer(text):
            name = match.group(1).decode()
            if name not in found and name != source_name:
                found.append(name)
                pending.append(name)
    return found


def build_hash(source: Path, flags: list[str]) -> str:
    """The build directory's key: the bytes of ``source`` and of every header it includes, its directory (ninja's
    build file names the source by path, so two checkouts sharing one directory would rebuild each other's module)
    and the compile flags."""
    text = source.read_bytes() + b"".join(source.with_name(name).read_bytes() for name in _included(source.name))
    place = str(source.resolve().parent).encode()
    return hashlib.sha256(text + place + " ".join(flags).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def load_extension(source_name: str) -> ModuleType | None:
    """Build (once, cached on disk) and import the C++ extension ``source_name`` of this directory; None on failure.

    Wider ISA paths inside a source (AVX512-BF16, VNNI) use per-function ``target`` attributes with a runtime CPU
    check, so the module itself only assumes the baseline flags chosen here.
    """
    from torch.utils import cpp_extension

    source = Path(__file__).with_name(source_name)
    if not source.is_file():
        logger.warning("CPU kernel source %s is missing; using torch ops", source)
        return None
    flags = _compile_flags()
    source_hash = build_hash(source, flags)
    build_dir = _build_dir(source_hash)
    try:
        with exclusive_build(build_dir):
            return cpp_extension.load(name=f"ascent_{source.stem}_{source_hash}", sources=[str(source)],
                                      extra_cflags=flags, build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler / headers: fall back to the torch paths, once, loudly
        logger.warning("CPU kernels of %s unavailable (%s: %s); using torch ops", source_name, type(exc).__name__, exc)
        return None


def _load() -> ModuleType | None:
    return load_extension(_SOURCE.name)


def fused_ops_enabled() -> bool:
    """Whether the fused kernels should be used (env switch and the current profile's capability)."""
    if os.environ.get("ASCENT_CPU_FUSED_OPS", "1") == "0":
        return False
    from ascent.platform.device_config import get_current_profile
    from ascent.platform.profile import HardwareCapability

    return get_current_profile().supports(HardwareCapability.RUNTIME_CUSTOM_OPS)


def fused_ops() -> ModuleType | None:
    """The compiled kernel module (built on the first call), or None when the fused kernels do not apply."""
    return _load() if fused_ops_enabled() else None


def gemv_ops() -> ModuleType | None:
    """Small-M (decode) dense GEMV kernels for bf16/fp16 weights (``gemv_cpu.cpp``), or None when not applicable."""
    return load_extension("gemv_cpu.cpp") if fused_ops_enabled() else None


def quant_ops() -> ModuleType | None:
    """Small-M (decode) integer-weight kernels (``quant_gemv_cpu.cpp``), or None when not applicable."""
    return load_extension("quant_gemv_cpu.cpp") if fused_ops_enabled() else None


def sampling_ops() -> ModuleType | None:
    """Sampler kernels (``sampling_cpu.cpp``: greedy argmax, inverse-CDF draw), or None when not applicable."""
    return load_extension("sampling_cpu.cpp") if fused_ops_enabled() else None


def decode_stack_ops() -> ModuleType | None:
    """The whole-stack decode kernel (``decode_stack_cpu.cpp``), or None when not applicable."""
    return load_extension("decode_stack_cpu.cpp") if fused_ops_enabled() else None


def amx_ops() -> ModuleType | None:
    """AMX bf16 linear for mid-sized M (``amx_linear_cpu.cpp``), or None when not applicable (no AMX-BF16)."""
    module = load_extension("amx_linear_cpu.cpp") if fused_ops_enabled() else None
    return module if module is not None and module.amx_available() else None


def suffix_tree_ops() -> ModuleType | None:
    """The native suffix tree of suffix decoding (``suffix_tree_cpu.cpp``; host code, so any hardware profile), or
    None when ``ASCENT_NATIVE_SUFFIX_TREE=0`` or the build failed."""
    if os.environ.get("ASCENT_NATIVE_SUFFIX_TREE", "1") == "0":
        return None
    return load_extension("suffix_tree_cpu.cpp")
