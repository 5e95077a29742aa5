"""Process-group reuse registry: one communicator per (ranks, backend, options, reuse domain).

Groups with identical members and settings (e.g. "world" and "tp" when TP spans the world, or a CPU group and a
"device" group on CPU where both are gloo) share one process group instead of building a second communicator.

Key = ``(backend, sorted ranks, normalised options, reuse domain)``. Options are normalised to a tuple of sorted
``(name, value)`` pairs with runtime identity fields (group names) dropped; options that cannot be normalised, and
groups whose actual members differ from the requested ranks, **fail closed**: the handle is created and returned but
never shared. The reuse domain is ``"shared"`` except for groups that must stay isolated (``eplb*``, ``mc2``), which
use their own name. Leases are reference counted; the handle is destroyed when the last lease is released, except
the non-member sentinel (ranks outside a group receive it from ``new_group``), which is never destroyed.

Creation is a collective in ``torch.distributed``: every rank must acquire the same keys in the same order, which
keeps cache hits and misses identical across ranks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

SHARED_DOMAIN = "shared"
ISOLATED_GROUP_PREFIXES = ("eplb", "mc2")
IDENTITY_OPTION_FIELDS = frozenset({"group_name", "group_desc", "pg_name", "name"})

_UNFREEZABLE = object()


@dataclass(frozen=True)
class PGKey:
    backend: str
    ranks: tuple[int, ...]
    options: tuple[tuple[str, Any], ...]
    reuse_domain: str


@dataclass(eq=False)
class PGLease:
    """One acquisition of a group: ``handle`` is the process group; ``key`` is None when the group is not shared."""

    handle: Any
    key: PGKey | None
    released: bool = False


@dataclass(eq=False)
class _Entry:
    handle: Any
    destroy_fn: Callable[[Any], None]
    refcount: int = 0


def reuse_domain_for(group_name: str) -> str:
    """``"shared"`` for ordinary groups; the group's own name for isolated ones (``eplb*``, ``mc2``)."""
    return group_name if group_name.startswith(ISOLATED_GROUP_PREFIXES) else SHARED_DOMAIN


def _freeze(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, timedelta):
        return ("timedelta", value.total_seconds())
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            fv = _freeze(v)
            if fv is _UNFREEZABLE:
                return _UNFREEZABLE
            items.append((str(k), fv))
        return tuple(sorted(items))
    if isinstance(value, (list, tuple)):
        frozen = tuple(_freeze(v) for v in value)
        return _UNFREEZABLE if any(v is _UNFREEZABLE for v in frozen) else frozen
    return _UNFREEZABLE


def normalize_options(options: Any) -> tuple[tuple[str, Any], ...] | None:
    """Sorted ``(name, value)`` pairs without identity fields; ``()`` for None; None when not normalisable."""
    if options is None:
        return ()
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        options = dataclasses.asdict(options)
    if not isinstance(options, Mapping):
        return None
    kept = {k: v for k, v in options.items() if str(k) not in IDENTITY_OPTION_FIELDS}
    frozen = _freeze(kept)
    return None if frozen is _UNFREEZABLE else frozen


def make_key(ranks: Iterable[int], backend: str, options: Any = None,
             reuse_domain: str = SHARED_DOMAIN) -> PGKey | None:
    """The registry key, or None when ``options`` cannot be normalised (no reuse)."""
    sorted_ranks = tuple(sorted(int(r) for r in ranks))
    if not sorted_ranks or len(set(sorted_ranks)) != len(sorted_ranks):
        raise ValueError(f"ranks={list(ranks)!r} must be non-empty and distinct")
    if not backend:
        raise ValueError(f"backend={backend!r} must be a non-empty name")
    norm = normalize_options(options)
    return None if norm is None else PGKey(str(backend).lower(), sorted_ranks, norm, reuse_domain)


class ProcessGroupRegistry:
    """Reference-counted cache of process-group handles.

    ``destroy_fn(handle)`` destroys a group; ``ranks_of(handle)`` returns its global ranks (None = not checked);
    ``is_sentinel(handle)`` recognises the non-member placeholder, which is cached but never destroyed.
    """

    def __init__(
        self,
        destroy_fn: Callable[[Any], None],
        ranks_of: Callable[[Any], Sequence[int]] | None = None,
        is_sentinel: Callable[[Any], bool] = lambda handle: False,
    ) -> None:
        self._destroy_fn = destroy_fn
        self._ranks_of = ranks_of
        self._is_sentinel = is_sentinel
        self._entries: dict[PGKey, _Entry] = {}
        self._unshared: dict[int, tuple[Any, Callable[[Any], None]]] = {}
        self._lock = threading.RLock()
        self.hits = 0
        self.misses = 0

    def acquire(
        self,
        ranks: Iterable[int],
        backend: str,
        options: Any,
        reuse_domain: str,
        create_fn: Callable[[], Any],
        destroy_fn: Callable[[Any], None] | None = None,
    ) -> PGLease:
        """Return a lease on the cached group for this key, creating it with ``create_fn()`` on a miss."""
        ranks = list(ranks)
        key = make_key(ranks, backend, options, reuse_domain)
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                entry.refcount += 1
                self.hits += 1
                return PGLease(entry.handle, key)
            self.misses += 1
            handle = create_fn()
            destroy = destroy_fn or self._destroy_fn
            if key is None or not self._members_match(handle, key):
                self._unshared[id(handle)] = (handle, destroy)
                return PGLease(handle, None)
            self._entries[key] = _Entry(handle, destroy, refcount=1)
            return PGLease(handle, key)

    def _members_match(self, handle: Any, key: PGKey) -> bool:
        if self._ranks_of is None or self._is_sentinel(handle):
            return True
        return tuple(sorted(self._ranks_of(handle))) == key.ranks

    def release(self, lease: PGLease) -> None:
        """Drop one lease; destroys the group when no lease remains (never the non-member sentinel)."""
        with self._lock:
            if lease.released:
                raise ValueError(f"lease for key {lease.key!r} was already released")
            lease.released = True
            if lease.key is None:
                found = self._unshared.pop(id(lease.handle), None)
                if found is not None:
                    self._destroy(*found)
                return
            entry = self._entries.get(lease.key)
            if entry is None:  # cleared by ``clear()``
                return
            entry.refcount -= 1
            if entry.refcount == 0:
                del self._entries[lease.key]
                self._destroy(entry.handle, entry.destroy_fn)

    def _destroy(self, handle: Any, destroy: Callable[[Any], None]) -> None:
        if not self._is_sentinel(handle):
            destroy(handle)

    def refcount(self, key: PGKey) -> int:
        entry = self._entries.get(key)
        return entry.refcount if entry is not None else 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self, destroy: bool = True) -> None:
        """Forget every cached group (destroying them unless ``destroy`` is False); outstanding leases become void."""
        with self._lock:
            entries = list(self._entries.values()) + [_Entry(h, d) for h, d in self._unshared.values()]
            self._entries.clear()
            self._unshared = {}
            if destroy:
                for entry in reversed(entries):
                    self._destroy(entry.handle, entry.destroy_fn)
