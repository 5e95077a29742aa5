"""Native HF FP8 (spec §1.3) and ModelOpt MXFP8 (spec §1.4) configs."""

from __future__ import annotations

import pytest

from ascent.quantization.configs.fp8 import Fp8Config
from ascent.quantization.configs.modelopt import ModelOptMxfp8Config, load_modelopt_config
from ascent.quantization.configs.modelslim_mapping import packed_modules_for
from tests.unit.quant.helpers import write_json

DSV3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
L0 = "model.layers.0"


def test_fp8_block_spec() -> None:
    config = Fp8Config(DSV3_FP8, packed_modules_for("deepseek_v3"))
    spec = config.get_spec(f"{L0}.self_attn.kv_a_proj_with_mqa", "linear")
    assert (spec.quant_type, spec.source_format, spec.weight_type, spec.block_structure) == (
        "FP8_BLOCK", "fp8", "float", (128, 128))
    assert (spec.act_type, spec.act_strategy, spec.act_group_size, spec.act_dynamic) == ("float", "group", 128, True)
    assert config.get_spec("model.layers.3.mlp.experts", "moe").layer_type == "moe"
    assert config.get_spec("lm_head", "embedding") is None
    assert config.get_spec(f"{L0}.self_attn.attn", "attention") is None


def test_fp8_per_tensor_and_validation() -> None:
    spec = Fp8Config({"quant_method": "fp8", "activation_scheme": "dynamic"}).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.weight_strategy, spec.act_strategy) == ("W8A8FP8_DYNAMIC", "tensor", "token")
    for bad in ([128], [128, 0], [128, "128"], 128, [128.0, 128]):
        with pytest.raises(ValueError, match=rf"weight_block_size={bad!r}".replace("[", r"\[").replace("]", r"\]")):
            Fp8Config({**DSV3_FP8, "weight_block_size": bad})
    with pytest.raises(ValueError, match="activation_scheme='mixed'"):
        Fp8Config({**DSV3_FP8, "activation_scheme": "mixed"})
    with pytest.raises(NotImplementedError, match="static"):  # block scales with static activations
        Fp8Config({**DSV3_FP8, "activation_scheme": "static"}).get_spec(f"{L0}.mlp.down_proj", "linear")
    spec = Fp8Config({"quant_method": "fp8", "activation_scheme": "static"}).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.weight_strategy, spec.act_strategy, spec.act_dynamic) == (
        "W8A8FP8", "tensor", "tensor", False)


def test_fp8_ignored_layers_and_fused() -> None:
    qc = {**DSV3_FP8, "ignored_layers": [f"{L0}.self_attn.q_proj", f"{L0}.self_attn.k_proj",
                                         f"{L0}.self_attn.v_proj", "lm_head"],
          "modules_to_not_convert": ["model.layers.1.mlp"]}
    config = Fp8Config(qc, packed_modules_for("qwen3"))
    assert config.get_spec(f"{L0}.self_attn.qkv_proj", "linear") is None
    assert config.get_spec(f"{L0}.self_attn.o_proj", "linear").quant_type == "FP8_BLOCK"
    assert config.get_spec("model.layers.1.mlp.gate_up_proj", "linear") is None
    assert config.get_spec("model.layers.11.mlp.gate_up_proj", "linear") is not None  # anchored: 1 != 11
    partial = Fp8Config({**DSV3_FP8, "ignored_layers": [f"{L0}.self_attn.q_proj"]}, packed_modules_for("qwen3"))
    with pytest.raises(ValueError, match="some but not all shards"):
        partial.get_spec(f"{L0}.self_attn.qkv_proj", "linear")


def test_modelopt_mxfp8(tmp_path) -> None:
    qc = {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head", "*.mlp.gate"]}
    config = ModelOptMxfp8Config(qc, packed_modules_for("minimax_m2"))
    spec = config.get_spec(f"{L0}.self_attn.qkv_proj", "linear")
    assert (spec.quant_type, spec.source_format, spec.group_size, spec.act_group_size) == (
        "W8A8_MXFP8", "modelopt", 32, 32)
    assert config.get_spec(f"{L0}.block_sparse_moe.experts", "moe").quant_type == "W8A8_MXFP8"
    assert config.get_spec(f"{L0}.mlp.gate", "linear") is None
    assert config.get_spec("lm_head", "embedding") is None
    assert config.get_spec("model.vision_tower.blocks.0.attn.qkv", "linear") is None
    assert config.get_spec("model.embed_tokens", "embedding") is None
    assert config.get_spec(f"{L0}.self_attn.attn", "attention") is None
    write_json(tmp_path / "config.json", {"quantization_config": {"quant_method": "mxfp8"}})
    assert load_modelopt_config(tmp_path) == {"quant_method": "mxfp8"}
    write_json(tmp_path / "config.json", {})
    assert load_modelopt_config(tmp_path) is None
    write_json(tmp_path / "hf_quant_config.json", {"quantization": {"quant_algo": "MXFP8", "exclude_modules": []}})
    assert load_modelopt_config(tmp_path)["quant_algo"] == "MXFP8"
    with pytest.raises(NotImplementedError, match="NVFP4"):
        ModelOptMxfp8Config({"quant_algo": "NVFP4"})
