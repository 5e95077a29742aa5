"""GGUF files: HF-named float32 weights, an HF config and a fast tokenizer, all built from the GGUF contents.

Read with the ``gguf`` package (``GGUFReader`` memory-maps the file). Tensor names follow llama.cpp
(``blk.N.attn_q.weight`` ...) and are mapped to HF checkpoint names; llama.cpp's converter permutes the Q/K rows of
Llama models for its interleaved rotary layout, which ``iterate_gguf_weights`` undoes, so the yielded tensors equal the
original HF weights (up to quantization error).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class _ArchSpec:
    config_class: str  # transformers class name
    hf_architecture: str
    permute_qk: bool  # llama.cpp's converter permuted Q/K rows (interleaved rotary)


_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaConfig", "LlamaForCausalLM", True),
    "qwen2": _ArchSpec("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3": _ArchSpec("Qwen3Config", "Qwen3ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp stores that have no HF parameter (derived from the config at load time).
_NON_PARAMETER_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")

# token_type values of llama.cpp's vocabulary
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# ---------------------------------------------------------------------------------------------------------- reading
def _open_reader(path: str) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped, read-only); ValueError when it is not a GGUF file.

    Parsing the header (~100k vocabulary strings) takes seconds, and config, tokenizer and weights all read the same
    file at start-up, so readers are cached per (path, size, mtime)."""
    if not (isinstance(path, str) and os.path.isfile(path)):
        raise ValueError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    return _cached_reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path!r} is not a readable GGUF file: {exc}") from exc


def release_gguf_readers() -> None:
    """Drop the cached readers once start-up has read what it needs from them (config, tokenizer, weights). A reader
    keeps every metadata field's parts as numpy memmaps: SmolLM2's 49k-token vocabulary and its merges make ~500k
    Python objects and ~220 MiB, which a process serving for hours would otherwise carry, and walk on every full
    garbage collection. A later open parses the file again."""
    _cached_reader.cache_clear()


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    """Python value of metadata ``key`` (scalars, strings, lists), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: Any, key: str) -> Any:
    value = _meta(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value


def _arch(reader: Any) -> tuple[str, _ArchSpec]:
    arch = _require(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})")
    return arch, _ARCHS[arch]


def _per_layer(value: Any, layer: int) -> int:
    return int(value[layer]) if isinstance(value, (list, tuple)) else int(value)


# ---------------------------------------------------------------------------------------------------------- weights
def gguf_tensor_name_to_hf(name: str) -> str | None:
    """HF checkpoint name for llama.cpp tensor ``name``; None for tensors with no HF parameter (``rope_freqs``).

    Raises ValueError for names outside the supported dense decoder layout.
    """
    if name in _NON_PARAMETER_TENSORS:
        return None
    match = _BLOCK_RE.match(name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
    match = _GLOBAL_RE.match(name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no known HF equivalent")


def unpermute_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    The converter views the ``[n_head * head_dim, ...]`` rows as ``[n_head, 2, head_dim / 2]`` (HF's rotate-half
    halves) and stores them as ``[n_head, head_dim / 2, 2]`` (interleaved pairs). This applies the inverse; works for
    weights ``[out, in]`` and biases ``[out]``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot un-permute {rows} rows over n_head={n_head}")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    """float32 C-contiguous writable array of ``tensor`` in numpy (row-major, HF ``[out, in]``) order."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}") from exc
    return np.require(values.reshape(shape), dtype=np.float32, requirements=["C", "W"])


def iterate_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every parameter tensor of the GGUF file at ``path``.

    Tensors are float32 CPU tensors in HF layout (linear weights ``[out_features, in_features]``, norms ``[hidden]``,
    embeddings ``[vocab, hidden]``), dequantized one at a time from the memory-mapped file. Llama Q/K projections are
    un-permuted. ``lm_head.weight`` is only yielded when the file has an ``output.weight`` tensor (otherwise the
    embeddings are tied).
    """
    reader = _open_reader(path)
    arch, spec = _arch(reader)
    n_head = _require(reader, f"{arch}.attention.head_count")
    n_kv = _meta(reader, f"{arch}.attention.head_count_kv", n_head)
    for tensor in reader.tensors:
        hf_name = gguf_tensor_name_to_hf(tensor.name)
        if hf_name is None:
            continue
        values = _dequantize(tensor)
        if spec.permute_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            layer = int(hf_name.split(".")[2])
            heads = n_head if ".q_proj." in hf_name else n_kv
            values = unpermute_rotary_rows(values, _per_layer(heads, layer))
        yield hf_name, torch.from_numpy(values)


# ---------------------------------------------------------------------------------------------------------- config
def _rope_parameters(reader: Any, arch: str) -> dict[str, Any]:
    """transformers ``rope_parameters`` from ``{arch}.rope.*`` metadata."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_meta(reader, f"{arch}.rope.freq_base", 1e4))}
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    if kind in ("none", None) or (factor in (None, 0.0, 1.0) and kind != "yarn"):
        return params
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")
    params.update(rope_type=kind, factor=float(factor))
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _meta(reader, f"{arch}.rope.scaling.{gguf_key}")
        if value is not None and kind == "yarn":
            params[hf_key] = float(value)
    return params


def _rope_freq_factors(reader: Any) -> list[float] | None:
    """llama.cpp's per-frequency divisors of the rotary frequencies (``rope_freqs.weight`` [rotary_dim / 2]; the
    converter writes Llama 3.x's llama3 scaling this way), or None."""
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return [float(v) for v in _dequantize(tensor).reshape(-1)]
    return None


def _head_dim(reader: Any, arch: str, hidden: int, n_head: int) -> int:
    for key in (f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"):
        value = _meta(reader, key)
        if value is not None:
            return int(value)
    return hidden // n_head


def _vocab_size(reader: Any, arch: str) -> int:
    value = _meta(reader, f"{arch}.vocab_size")
    if value is not None:
        return int(value)
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError("GGUF file has neither a vocab_size key nor a token_embd tensor")


def _config_fields(reader: Any, arch: str) -> dict[str, Any]:
    names = {t.name for t in reader.tensors}
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = _per_layer(_require(reader, f"{arch}.attention.head_count"), 0)
    n_kv = _per_layer(_meta(reader, f"{arch}.attention.head_count_kv", n_head), 0)
    fields: dict[str, Any] = dict(
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=_per_layer(_require(reader, f"{arch}.feed_forward_length"), 0),
        num_hidden_layers=int(_require(reader, f"{arch}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=_head_dim(reader, arch, hidden, n_head),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(_require(reader, f"{arch}.context_length")),
        rope_parameters=_rope_parameters(reader, arch),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch != "qwen2":
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    factors = _rope_freq_factors(reader)
    if factors is not None:
        fields["rope_freq_factors"] = factors  # read by ascent.layers.rotary.rope_parameters_from_config
    return fields


def gguf_to_hf_config(path: str) -> Any:
    """A ``transformers.PretrainedConfig`` (LlamaConfig / Qwen2Config / Qwen3Config) from the GGUF metadata.

    ``architectures`` names the HF causal-LM class; ``tie_word_embeddings`` is True when the file has no
    ``output.weight``; ``dtype`` is left unset (GGUF weights have no single HF dtype).
    """
    import transformers

    reader = _open_reader(path)
    arch, spec = _arch(reader)
    config_class = getattr(transformers, spec.config_class)
    config = config_class(architectures=[spec.hf_architecture], **_config_fields(reader, arch))
    config._name_or_path = path
    return config


# ---------------------------------------------------------------------------------------------------------- tokenizer
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names -> the regex splits applied in order (each piece is split by the next regex).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_GPT2_SPLIT,) for name in ("default", "gpt2", "mpt", "olmo", "jais")},
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}
# llama.cpp emits a pre-token as one token when it is in the vocabulary (no merges) for these.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"}


def _byte_level_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """token -> id; normal tokens outside the byte-level alphabet are respelled in it, added tokens stay raw."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_to_char = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    name = pre or "default"
    if name not in _PRE_SPLITS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {sorted(_PRE_SPLITS)})")
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[name]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token_for(reader: Any, tokens: list[str], key: str) -> str | None:
    index = _meta(reader, f"tokenizer.ggml.{key}")
    if index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.{key}={index} is outside the vocabulary of {len(tokens)}")
    return tokens[int(index)]


def _backend_tokenizer(reader: Any, tokens: list[str], token_types: list[int]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pre = _meta(reader, "tokenizer.ggml.pre")
    merges = [tuple(m.split(" ")) for m in _require(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer.ggml.merges has entries that are not 'left right' pairs")
    vocab = _byte_level_vocab(tokens, token_types)
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    backend = Tokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tok, special=kind == _TOKEN_CONTROL, normalized=False)
        for tok, kind in zip(tokens, token_types)
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def gguf_tokenizer(path: str) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF tokenizer metadata.

    Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``): vocabulary and merges from the file,
    CONTROL tokens as special added tokens, USER_DEFINED tokens as plain added tokens, the pre-tokenizer regexes that
    llama.cpp uses for ``tokenizer.ggml.pre``, BOS/EOS added per ``add_bos_token`` / ``add_eos_token``, and the
    ``tokenizer.chat_template``. Token ids equal the GGUF ids.
    """
    from transformers import PreTrainedTokenizerFast

    reader = _open_reader(path)
    kind = _meta(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)")
    tokens = list(_require(reader, "tokenizer.ggml.tokens"))
    token_types = list(_meta(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    backend = _backend_tokenizer(reader, tokens, token_types)
    specials = {name: _token_for(reader, tokens, key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id"),
    )}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        clean_up_tokenization_spaces=False,
        add_bos_token=bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)),
        **{name: tok for name, tok in specials.items() if tok is not None},
    )
    template = _meta(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.name_or_path = path
    return tokenizer
