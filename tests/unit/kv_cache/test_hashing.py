"""Block hash chain against a direct hashlib/pickle recomputation of spec §2.2."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import subprocess
import sys

import pytest

from ascent.core.kv_cache.hashing import get_hash_function, make_block_hasher, none_hash
from ascent.core.request import Request
from ascent.sampling_params import SamplingParams


def _ref_sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _ref_chain(tokens: list[int], bs: int, seed: str, lora: str | None = None, salt: str | None = None) -> list[bytes]:
    parent = _ref_sha256(seed)
    out = []
    for i in range(len(tokens) // bs):
        keys = ([lora] if lora else []) + ([salt] if salt and i == 0 else [])
        parent = _ref_sha256((parent, tuple(tokens[i * bs : (i + 1) * bs]), tuple(keys) if keys else None))
        out.append(parent)
    return out


@pytest.fixture
def seed(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    return "1234"


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_chain_matches_reference_and_grows_incrementally(seed: str, bs: int) -> None:
    prompt = list(range(100, 137))
    req = Request("r", prompt, SamplingParams(), block_hasher=make_block_hasher(bs))
    assert req.block_hashes == _ref_chain(prompt, bs, seed)
    for t in range(5):
        req.append_output_token_ids(7 + t)
        assert req.block_hashes == _ref_chain(req.all_token_ids, bs, seed)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in req.block_hashes)


def test_extra_keys_lora_on_every_block_salt_on_block_zero(seed: str) -> None:
    tokens = list(range(12))
    hasher = make_block_hasher(4)
    salted = Request("s", tokens, SamplingParams(), block_hasher=hasher, cache_salt="salt")
    lora = Request("l", tokens, SamplingParams(), block_hasher=hasher, lora_name="adapter")
    plain = Request("p", tokens, SamplingParams(), block_hasher=hasher)
    assert salted.block_hashes == _ref_chain(tokens, 4, seed, salt="salt")
    assert lora.block_hashes == _ref_chain(tokens, 4, seed, lora="adapter")
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    assert not set(lora.block_hashes) & set(plain.block_hashes)


def test_partial_block_has_no_hash(seed: str) -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), block_hasher=make_block_hasher(4))
    assert req.block_hashes == []
    req.append_output_token_ids(4)
    assert req.block_hashes == _ref_chain([1, 2, 3, 4], 4, seed)


def test_none_hash_follows_pythonhashseed(seed: str) -> None:
    assert none_hash(get_hash_function("sha256")) == _ref_sha256(seed)


def test_none_hash_is_random_per_process_without_seed() -> None:
    code = "from ascent.core.kv_cache.hashing import none_hash, sha256; print(none_hash(sha256).hex())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    outs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]
    assert len(bytes.fromhex(outs[0].strip())) == 32
    assert outs[0] != outs[1]


def test_hash_algo_selection() -> None:
    with pytest.raises(ValueError, match="md5"):
        get_hash_function("md5")
    with pytest.raises(ValueError, match="0"):
        make_block_hasher(0)
    if importlib.util.find_spec("cbor2") is None:
        with pytest.raises(ValueError, match="cbor2"):
            make_block_hasher(4, "sha256_cbor")
    else:
        import cbor2

        fn = get_hash_function("sha256_cbor")
        assert fn((b"x", (1, 2), None)) == hashlib.sha256(cbor2.dumps((b"x", (1, 2), None), canonical=True)).digest()
