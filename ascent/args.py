"""EngineArgs: the user-facing engine options; CLI flags are generated from the dataclass fields (vLLM names)."""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ascent.config import (
    HARDWARE_PROFILES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_json_object,
)

_DECIMAL_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str | int, name: str = "value") -> int:
    """An integer such as ``4096``, ``25.6k`` (lowercase suffix: powers of 1000), ``16K`` / ``16Ki`` / ``2GiB``
    (uppercase suffix: powers of 1024, whole numbers only) -- vLLM's ``human_readable_int`` plus IEC spellings.
    ValueError naming ``name`` and the value otherwise."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)(i?B|i)?\s*", value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer such as 4096, 25.6k, 16K or 2GiB.")
    number, suffix, iec = m.groups()
    if iec and suffix.upper() in _BINARY_SUFFIXES:
        suffix = suffix.upper()  # 2GiB, 512Mi, 4kiB: binary whatever the case
    if suffix in _BINARY_SUFFIXES:
        if "." in number:
            raise ValueError(f"{name}={value!r} is invalid: decimals need a decimal suffix "
                             f"({number}{suffix.lower()}), not the binary {suffix}.")
        return int(number) * _BINARY_SUFFIXES[suffix]
    if "." in number and not suffix:
        raise ValueError(f"{name}={value!r} is invalid: expected a whole number.")
    return int(float(number) * _DECIMAL_SUFFIXES[suffix])


def parse_size(value: str | int) -> int:
    """``--kv-cache-memory-bytes``: a byte count in ``human_readable_int`` form (536870912, 512M, 2GiB, 1.5g)."""
    return human_readable_int(value, "kv_cache_memory_bytes")


def cli_int_arg(name: str) -> Any:
    """An argparse ``type`` parsing ``human_readable_int`` and reporting its message."""

    def parse(value: str) -> int:
        try:
            return human_readable_int(value, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = name
    return parse


def _opt(help: str, choices: tuple[str, ...] | None = None, short: str | None = None, parse: Any = None) -> Any:
    return {"help": help, "choices": choices, "short": short, "parse": parse}


@dataclass
class EngineArgs:
    """All engine options. Field names equal vLLM's ``EngineArgs``; each becomes ``--kebab-case-name``."""

    model: str | None = field(default=None, metadata=_opt(
        "HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct GGUF)"))
    tokenizer: str | None = field(default=None, metadata=_opt("tokenizer directory (default: the model's)"))
    dtype: str = field(default="auto", metadata=_opt(
        "weight/activation dtype", ("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "maximum context length (prompt + output); accepts 4096, 32k, 32K", parse=cli_int_arg("max_model_len")))
    seed: int = field(default=0, metadata=_opt("engine random seed"))
    generation_config: str = field(default="auto", metadata=_opt(
        "default sampling values and EOS ids: 'auto' (the model's generation_config.json), 'vllm' (none) or a "
        "directory holding a generation_config.json"))
    override_generation_config: str | dict | None = field(default=None, metadata=_opt(
        "JSON merged over the generation config, e.g. '{\"temperature\": 0.5}'"))
    max_logprobs: int = field(default=20, metadata=_opt(
        "most logprobs / prompt_logprobs per token a request may ask for (-1 = the whole vocabulary)"))
    block_size: int | None = field(default=None, metadata=_opt(
        "KV cache block size in tokens (default 16, or the profile's kernel block size)"))
    enable_prefix_caching: bool = field(default=True, metadata=_opt("reuse KV blocks of identical prefixes"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=_opt(
        "bytes for the KV cache (accepts 512M, 2GiB, 1.5g); default 25% of available memory",
        parse=cli_int_arg("kv_cache_memory_bytes")))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_opt("exact number of KV blocks"))
    max_num_seqs: int = field(default=256, metadata=_opt("maximum concurrently running sequences"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_opt(
        "token budget of one engine step (accepts 8192, 8k, 8K)", parse=cli_int_arg("max_num_batched_tokens")))
    enable_chunked_prefill: bool = field(default=True, metadata=_opt("split long prefills across steps"))
    long_prefill_token_threshold: int = field(default=0, metadata=_opt("cap on one request's chunk (0 = off)"))
    scheduling_policy: str = field(default="fcfs", metadata=_opt("admission order", SCHEDULING_POLICIES))
    tensor_parallel_size: int = field(default=1, metadata=_opt("tensor parallel size", short="-tp"))
    enable_expert_parallel: bool = field(default=False, metadata=_opt(
        "shard MoE experts across the TP ranks (expert parallelism) instead of slicing each expert"))
    eplb_config: str | dict | None = field(default=None, metadata=_opt(
        "expert-parallel load balancing JSON, e.g. '{\"policy\": \"swift\", \"num_redundant_experts\": 2}'"))
    load_format: str = field(default="auto", metadata=_opt("weight loader", LOAD_FORMATS))
    quantization: str | None = field(default=None, metadata=_opt(
        "quantization method of the checkpoint (default: detect it; 'none' loads as float)", QUANTIZATION_METHODS,
        short="-q"))
    speculative_config: str | dict | None = field(default=None, metadata=_opt(
        "speculative decoding JSON with vLLM's keys, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'"))
    hardware_profile: str = field(default="auto", metadata=_opt("hardware family profile", HARDWARE_PROFILES))
    num_threads: int | None = field(default=None, metadata=_opt("torch intra-op threads (default: torch's)"))
    trust_remote_code: bool = field(default=False, metadata=_opt(
        "accepted for vLLM compatibility: ascent runs its own model implementations and never executes code from "
        "a checkpoint"))
    enforce_eager: bool = field(default=True, metadata=_opt(
        "accepted for vLLM compatibility: ascent has no graph capture and always runs eagerly"))
    disable_log_stats: bool = field(default=False, metadata=_opt("disable the periodic stats log line"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (booleans get ``--flag/--no-flag``)."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            meta = f.metadata
            names = ["--" + f.name.replace("_", "-")] + ([meta["short"]] if meta.get("short") else [])
            help_text = meta.get("help")  # argparse %-formats help strings: a literal % must be doubled
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default,
                                      "help": help_text.replace("%", "%%") if help_text else help_text}
            typ = _base_type(hints[f.name])
            if typ is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = meta.get("parse") or typ
                if meta.get("choices"):
                    kwargs["choices"] = meta["choices"]
            group.add_argument(*names, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def __post_init__(self) -> None:
        for name in _HUMAN_READABLE_INTS:
            if isinstance(getattr(self, name), str):
                setattr(self, name, human_readable_int(getattr(self, name), name))
        _check_field_types(self)

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model files and build a validated EngineConfig (reads config metadata, not weights)."""
        from ascent.default_model import resolve_model_path
        from ascent.loader.model_info import derive_max_model_len, load_hf_config

        device_config = DeviceConfig(hardware_profile=self.hardware_profile, num_threads=self.num_threads)
        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        model_config = ModelConfig(
            model=model_path,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=derive_max_model_len(hf_config, self.max_model_len),
            seed=self.seed,
            quantization=self.quantization,
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            override_generation_config=parse_json_object("override_generation_config",
                                                         self.override_generation_config or {}),
            hf_config=hf_config,
            torch_dtype=_resolve_dtype(device_config, hf_config, self.dtype),
        )
        _check_int("seed", self.seed, 0)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=_resolve_block_size(device_config.profile, self.block_size),
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                scheduling_policy=self.scheduling_policy,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           enable_expert_parallel=self.enable_expert_parallel),
            load_config=LoadConfig(load_format=self.load_format),
            device_config=device_config,
            disable_log_stats=self.disable_log_stats,
            speculative_config=_parse_speculative_config(self.speculative_config),
            eplb_config=_parse_eplb_config(self.eplb_config),
        )
        config.finalize()
        return config


def _resolve_dtype(device_config: DeviceConfig, hf_config: Any, requested: str) -> Any:
    """``--dtype auto`` -> the model's dtype when the profile allows it, else the profile default (310p: fp16);
    an explicit dtype the profile does not allow (e.g. bf16 under 310p) is a ValueError naming both."""
    from ascent.loader.model_info import get_model_dtype

    profile = device_config.profile
    model_dtype = get_model_dtype(hf_config, requested, device_config.device.type)
    if requested == "auto":
        return model_dtype if profile.allows_dtype(model_dtype) else profile.default_dtype
    return profile.check_dtype(model_dtype)


def _resolve_block_size(profile: Any, requested: int | None) -> int:
    """Default 16 unless the profile's kernels need specific block sizes (then its first); explicit sizes are checked."""
    if requested is None:
        return profile.kernel_block_sizes[0] if profile.kernel_block_sizes else 16
    return profile.check_block_size(requested)


def _parse_speculative_config(value: Any) -> Any:
    if value is None or value == "":
        return None
    from ascent.spec_decode.base import SpeculativeConfig

    if isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_json(value)


def _parse_eplb_config(value: Any) -> Any:
    if value is None or value == "":
        return None
    from ascent.eplb.config import EplbConfig

    return value if isinstance(value, EplbConfig) else EplbConfig.from_json(value)


# Fields given as human-readable strings from Python too ("32k", "2GiB").
_HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")
# Options vLLM declares Optional, where None selects the default.
_NONE_MEANS_DEFAULT = ("max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching")


def _check_field_types(args: EngineArgs) -> None:
    """A ValueError naming the option for a value of the wrong type (``max_num_seqs="4"``, ``num_threads=2.5``,
    ``enable_prefix_caching="no"``), instead of a TypeError deep inside; JSON-config options are parsed later."""
    hints = typing.get_type_hints(type(args))
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if value is None and f.name in _NONE_MEANS_DEFAULT:
            setattr(args, f.name, f.default)
            continue
        allowed = _allowed_types(hints[f.name])
        if dict in allowed or (value is None and type(None) in allowed):
            continue
        if bool in allowed:
            ok = isinstance(value, bool)
        elif int in allowed:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if ok:
                setattr(args, f.name, int(value))
        else:
            ok = isinstance(value, tuple(t for t in allowed if t is not type(None)))
        if not ok:
            kind = "a boolean" if bool in allowed else "an integer" if int in allowed else "a string"
            raise ValueError(f"{f.name}={value!r} is invalid: must be {kind}.")


def _allowed_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {minimum}.")


def _base_type(hint: Any) -> type:
    """``int | None`` -> int, ``str`` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint
