"""Auto-detection priority and the ``--quantization`` factory (spec §1.5), plus the generated CLI flag."""

from __future__ import annotations

import argparse
import logging

import pytest

from ascent.args import EngineArgs
from ascent.config import ModelConfig
from ascent.quantization.configs.compressed_tensors import CompressedTensorsConfig
from ascent.quantization.configs.fp8 import Fp8Config
from ascent.quantization.configs.modelopt import ModelOptMxfp8Config
from ascent.quantization.configs.modelslim import ModelSlimConfig
from ascent.quantization.configs.modelslim_310p import ModelSlimConfig310P
from ascent.quantization.detect import detect_quantization_method, get_quantization_config
from ascent.quantization.registry import DEFAULT_REGISTRY, REGISTRY_310P
from tests.unit.quant.helpers import write_json

CT = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"], "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
DESC = {"model_quant_type": "W8A8", "model.layers.0.self_attn.q_proj.weight": "W8A8"}


class Hf:
    model_type = "qwen3"
    architectures = ["Qwen3ForCausalLM"]


def model_dir(tmp_path, quant_config=None, description=None, name="quant_model_description.json"):
    write_json(tmp_path / "config.json", {"model_type": "qwen3", **(
        {"quantization_config": quant_config} if quant_config else {})})
    if description is not None:
        write_json(tmp_path / name, description)
    return tmp_path


def test_detect_priority(tmp_path) -> None:
    assert detect_quantization_method(model_dir(tmp_path)) is None
    assert detect_quantization_method(model_dir(tmp_path, FP8)) == "fp8"
    assert detect_quantization_method(model_dir(tmp_path, CT)) == "compressed-tensors"
    assert detect_quantization_method(model_dir(tmp_path, {"quant_method": "modelopt_mxfp8"})) == "modelopt"
    assert detect_quantization_method(model_dir(tmp_path, CT, DESC)) == "ascend"  # ModelSlim wins
    assert detect_quantization_method(tmp_path / "missing") is None


def test_detect_msmodelslim_default_name(tmp_path) -> None:
    assert detect_quantization_method(model_dir(tmp_path, None, DESC, "quant_model_description_w8a8.json")) == "ascend"


def test_factory_auto_and_explicit(tmp_path, caplog) -> None:
    path = model_dir(tmp_path, CT)
    config = get_quantization_config(None, path, Hf())
    assert isinstance(config, CompressedTensorsConfig) and config.registry is DEFAULT_REGISTRY
    assert isinstance(get_quantization_config("auto", path, Hf()), CompressedTensorsConfig)
    assert get_quantization_config("none", path, Hf()) is None
    write_json(path / "quant_model_description.json", DESC)
    assert isinstance(get_quantization_config("auto", path, Hf()), ModelSlimConfig)
    with caplog.at_level(logging.WARNING):
        config = get_quantization_config("compressed-tensors", path, Hf())
    assert isinstance(config, CompressedTensorsConfig)
    assert "overrides the detected method ascend" in caplog.text
    assert isinstance(get_quantization_config("modelslim", path, Hf()), ModelSlimConfig)


def test_factory_errors(tmp_path) -> None:
    path = model_dir(tmp_path)
    assert get_quantization_config(None, path, Hf()) is None
    with pytest.raises(ValueError, match="ModelSlim Quantization Config Not Found") as err:
        get_quantization_config("ascend", path, Hf())
    assert "config.json" in str(err.value)
    with pytest.raises(ValueError, match=r"quantization='awq' is invalid: must be one of .*'compressed-tensors'"):
        get_quantization_config("awq", path, Hf())
    model_dir(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        get_quantization_config(None, path, Hf())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert get_quantization_config(None, gguf, Hf()) is None
    with pytest.raises(ValueError, match="GGUF"):
        get_quantization_config("fp8", gguf, Hf())


def test_factory_fp8_modelopt_and_310p(tmp_path) -> None:
    assert isinstance(get_quantization_config(None, model_dir(tmp_path, FP8), Hf()), Fp8Config)
    path = model_dir(tmp_path, {"quant_method": "modelopt_mxfp8", "quant_algo": "MXFP8"})
    assert isinstance(get_quantization_config("mxfp8", path, Hf()), ModelOptMxfp8Config)
    path = model_dir(tmp_path, None, DESC)
    config = get_quantization_config("ascend", path, Hf(), profile_name="310p")
    assert isinstance(config, ModelSlimConfig310P) and config.registry is REGISTRY_310P
    assert get_quantization_config("ascend", path, Hf(), profile_name="a3").registry is DEFAULT_REGISTRY


def test_cli_flag_and_validation() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "ascend"]))
    assert args.quantization == "ascend"
    assert EngineArgs.from_cli_args(parser.parse_args(["-q", "compressed-tensors"])).quantization == \
        "compressed-tensors"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "bogus"])
    assert ModelConfig(model="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization='bogus' is invalid"):
        ModelConfig(model="m", quantization="bogus")
