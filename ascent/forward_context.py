"""The forward context: the one piece of global mutable state in the engine.

The model runner wraps every model forward in ``set_forward_context(attn_metadata)``; attention layers read the
backend metadata with ``get_forward_context()``. Outside such a block there is no context and reading it is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    """State shared by all layers during one forward pass.

    ``attn_metadata`` is the backend metadata built for this step (or a dict ``layer_name -> metadata`` when layers use
    different KV-cache groups); ``None`` means "no KV cache" (a dummy/profiling forward).
    """

    attn_metadata: Any


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Install a ``ForwardContext`` for the duration of the block; the previous one (if any) is restored on exit."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """The current context; raises RuntimeError when called outside ``set_forward_context``."""
    if _forward_context is None:
        raise RuntimeError(
            "no forward context is set: model forwards must run inside ascent.forward_context.set_forward_context()"
        )
    return _forward_context
