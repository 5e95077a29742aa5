"""Chained block hashes for prefix caching (engine_core spec §2.2).

``hash_i = H((hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))`` over *full* blocks only.
``extra_keys_i`` is None or a tuple, in order: the LoRA name, then ``cache_salt`` (block 0 only).
``NONE_HASH`` = H(PYTHONHASHSEED) when that variable is set, else 32 random bytes fixed for the process, so hashes
are reproducible across processes only when PYTHONHASHSEED is set.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
from typing import Any, Callable, Protocol

HashFunction = Callable[[Any], bytes]

_PROCESS_RANDOM_NONE_HASH = os.urandom(32)


class _Hashable(Protocol):
    all_token_ids: list[int]
    block_hashes: list[bytes]
    lora_name: str | None
    cache_salt: str | None


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickled object (highest protocol)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding (language-independent); needs the ``cbor2`` package."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def get_hash_function(hash_algo: str) -> HashFunction:
    """Hash function for ``prefix_caching_hash_algo``: "sha256" always, "sha256_cbor" only if cbor2 is installed."""
    if hash_algo == "sha256":
        return sha256
    if hash_algo == "sha256_cbor":
        if importlib.util.find_spec("cbor2") is None:
            raise ValueError("hash_algo 'sha256_cbor' requires the cbor2 package, which is not installed.")
        return sha256_cbor
    raise ValueError(f"Unsupported hash_algo {hash_algo!r}; expected 'sha256' or 'sha256_cbor'.")


def none_hash(hash_fn: HashFunction) -> bytes:
    """The parent hash of block 0: H(PYTHONHASHSEED) if set, else a per-process random value."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return _PROCESS_RANDOM_NONE_HASH
    return hash_fn(seed)


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_hash: bytes | None,
    token_ids: list[int] | tuple[int, ...],
    extra_keys: tuple[Any, ...] | None = None,
    root_hash: bytes | None = None,
) -> bytes:
    """Hash of one full block chained to ``parent_hash`` (``root_hash`` or NONE_HASH for block 0)."""
    if parent_hash is None:
        parent_hash = root_hash if root_hash is not None else none_hash(hash_fn)
    return hash_fn((parent_hash, tuple(token_ids), extra_keys))


def block_extra_keys(lora_name: str | None, cache_salt: str | None, block_index: int) -> tuple[Any, ...] | None:
    """Extra hash keys of block ``block_index``: LoRA name, then the cache salt on block 0; None when empty."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def make_block_hasher(block_size: int, hash_algo: str = "sha256") -> Callable[[_Hashable], list[bytes]]:
    """Build the ``Request(block_hasher=...)`` callable.

    The callable returns the hashes of the request's *new* full blocks, i.e. blocks
    ``len(request.block_hashes) .. num_tokens // block_size - 1``, chained onto ``request.block_hashes[-1]``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    hash_fn = get_hash_function(hash_algo)
    root = none_hash(hash_fn)

    def hasher(request: _Hashable) -> list[bytes]:
        start = len(request.block_hashes)
        end = len(request.all_token_ids) // block_size
        parent = request.block_hashes[-1] if start > 0 else None
        out: list[bytes] = []
        for i in range(start, end):
            tokens = request.all_token_ids[i * block_size : (i + 1) * block_size]
            extra = block_extra_keys(request.lora_name, request.cache_salt, i)
            parent = hash_block_tokens(hash_fn, parent, tokens, extra, root)
            out.append(parent)
        return out

    return hasher
