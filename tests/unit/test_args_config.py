"""EngineArgs -> CLI flags (vLLM names) and validation errors that name the bad value."""

from __future__ import annotations

import argparse

import pytest

from ascent.args import EngineArgs, parse_size
from ascent.config import CacheConfig, DeviceConfig, SchedulerConfig


def _parse(argv: list[str]) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_flags_use_vllm_names_and_types():
    args = _parse(["--model", "m", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "64", "--block-size", "32", "--no-enable-prefix-caching",
                   "--kv-cache-memory-bytes", "512M", "--seed", "3", "--hardware-profile", "cpu", "-tp", "1"])
    assert args.model == "m" and args.dtype == "float32" and args.max_model_len == 128
    assert args.max_num_seqs == 4 and args.max_num_batched_tokens == 64 and args.block_size == 32
    assert args.enable_prefix_caching is False and args.kv_cache_memory_bytes == 512 << 20
    assert args.seed == 3 and args.hardware_profile == "cpu" and args.tensor_parallel_size == 1


def test_defaults_match_vllm(tiny_llama_dir):
    args = _parse([])
    assert args.enable_prefix_caching is True and args.block_size is None and args.max_num_seqs == 256
    assert args.dtype == "auto" and args.scheduling_policy == "fcfs"
    config = EngineArgs(model=tiny_llama_dir).create_engine_config()
    assert config.cache_config.block_size == 16 and config.device_config.profile.name == "cpu"


def test_profile_drives_dtype_and_block_size(tiny_llama_dir):
    import torch

    config = EngineArgs(model=tiny_llama_dir, hardware_profile="310p").create_engine_config()
    assert config.model_config.torch_dtype == torch.float16  # fp16-only family
    assert config.cache_config.block_size == 128  # the 310P kernels' block size
    with pytest.raises(ValueError, match="bfloat16"):
        EngineArgs(model=tiny_llama_dir, hardware_profile="310p", dtype="bfloat16").create_engine_config()
    with pytest.raises(ValueError, match="block_size=16"):
        EngineArgs(model=tiny_llama_dir, hardware_profile="310p", block_size=16).create_engine_config()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            EngineArgs(model=tiny_llama_dir, hardware_profile="cuda").create_engine_config()


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("2GiB", 2 << 30), ("1.5g", 1_500_000_000),
                                           ("64k", 64_000), ("64K", 64 << 10), ("25.6k", 25_600), ("512Mi", 512 << 20),
                                           ("4kiB", 4 << 10)])
def test_parse_size(text, expected):
    """vLLM's human_readable_int: lowercase suffixes are powers of 1000, uppercase (and IEC) powers of 1024."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "1.5G", "1.5", "-3", ""])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        parse_size(text)


def test_cli_accepts_human_readable_ints_and_reports_bad_ones(capsys):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--max-model-len", "1k", "--max-num-batched-tokens", "2K", "--kv-cache-memory-bytes", "2GiB"]))
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_memory_bytes) == (1000, 2048, 2 << 30)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory-bytes", "1x"])
    assert "kv_cache_memory_bytes='1x' is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("field,value,why", [
    ("max_num_seqs", "4", "integer"), ("num_threads", 2.5, "integer"), ("max_num_batched_tokens", [8], "integer"),
    ("enable_prefix_caching", "no", "boolean"), ("long_prefill_token_threshold", True, "integer"),
    ("dtype", 16, "string"),
])
def test_engine_args_of_the_wrong_type_name_the_field(field, value, why):
    with pytest.raises(ValueError, match=f"{field}=.*must be {'an' if why == 'integer' else 'a'} {why}"):
        EngineArgs(**{field: value})


def test_none_selects_the_default_where_vllm_allows_it():
    args = EngineArgs(max_num_seqs=None, enable_chunked_prefill=None, enable_prefix_caching=None,
                      max_model_len="32k")
    assert (args.max_num_seqs, args.enable_chunked_prefill, args.enable_prefix_caching) == (256, True, True)
    assert args.max_model_len == 32_000


def test_token_budget_below_max_num_seqs_and_kv_below_max_model_len_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be at least max_num_seqs=16"):
        EngineArgs(model=tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=16).create_engine_config()
    from ascent import LLM

    with pytest.raises(ValueError, match="fewer than one request of max_model_len=512.*at most 48"):
        LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes="32K", max_num_seqs=4)


@pytest.mark.parametrize("factory,bad", [
    (lambda: CacheConfig(block_size=3), "block_size=3"),
    (lambda: CacheConfig(kv_cache_memory_bytes=0), "kv_cache_memory_bytes=0"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs=0"),
    (lambda: SchedulerConfig(max_num_batched_tokens=-5), "max_num_batched_tokens=-5"),
    (lambda: SchedulerConfig(scheduling_policy="lifo"), "lifo"),
    (lambda: DeviceConfig(hardware_profile="tpu"), "tpu"),
    (lambda: DeviceConfig(num_threads=0), "num_threads=0"),
])
def test_invalid_config_values_name_the_value(factory, bad):
    with pytest.raises(ValueError, match=bad):
        factory()


def test_invalid_engine_args_at_config_creation(tiny_llama_dir):
    with pytest.raises(ValueError, match="int8"):
        EngineArgs(model=tiny_llama_dir, dtype="int8").create_engine_config()
    with pytest.raises(ValueError, match="99999"):
        EngineArgs(model=tiny_llama_dir, max_model_len=99999).create_engine_config()
    with pytest.raises(ValueError, match="no-such-model"):
        EngineArgs(model="/no-such-model").create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineArgs(model=tiny_llama_dir, tensor_parallel_size=0).create_engine_config()


def test_bad_tokenizer_path_is_named_as_the_tokenizer(tiny_llama_dir):
    from ascent.tokenizer import get_tokenizer

    with pytest.raises(ValueError, match="^tokenizer '/no-such-tokenizer' is neither"):
        get_tokenizer(tiny_llama_dir, "/no-such-tokenizer")
