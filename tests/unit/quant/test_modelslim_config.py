"""ModelSlim description logic (spec §1.1, §12.6): file discovery, fused shards, skip rule, MoE, name mappings,
missing keys, spec fields, C8 KV layers, anti-outlier norm bias and the 310P config."""

from __future__ import annotations

import logging

import pytest
import torch

from ascent.layers.linear import QKVParallelLinear, RowParallelLinear
from ascent.layers.norm import RMSNorm
from ascent.quantization.configs.modelslim import ModelSlimConfig
from ascent.quantization.configs.modelslim_310p import ModelSlimConfig310P
from ascent.quantization.configs.modelslim_mapping import first_layer_id, rename_components
from ascent.quantization.method_adapters import quant_method_for
from ascent.quantization.registry import DEFAULT_REGISTRY, REGISTRY_310P
from tests.unit.quant.helpers import write_json

L0 = "model.layers.0"
QKV = {f"{L0}.self_attn.{p}.weight": "W8A8" for p in ("q_proj", "k_proj", "v_proj")}


def cfg(desc: dict, model_type: str | None = "qwen3") -> ModelSlimConfig:
    return ModelSlimConfig(desc, model_type)


class _Hf:
    model_type = "qwen3"
    architectures = ["Qwen3ForCausalLM"]


def test_description_file_discovery(tmp_path, caplog) -> None:
    write_json(tmp_path / "config.json", {"model_type": "qwen3"})
    with pytest.raises(ValueError, match="ModelSlim Quantization Config Not Found") as err:
        ModelSlimConfig.from_model_dir(str(tmp_path), _Hf())
    assert "config.json" in str(err.value)
    write_json(tmp_path / "quant_model_description_w8a8.json", {"model_quant_type": "W8A8", **QKV})
    with caplog.at_level(logging.WARNING):
        config = ModelSlimConfig.from_model_dir(str(tmp_path), _Hf())
    assert "quant_model_description_w8a8.json" in caplog.text
    assert config.meta["model_quant_type"] == "W8A8"
    write_json(tmp_path / "quant_model_description_w8a16.json", {})
    with pytest.raises(ValueError, match="2 ModelSlim descriptions"):
        ModelSlimConfig.from_model_dir(str(tmp_path), _Hf())
    write_json(tmp_path / "quant_model_description.json", {"version": "1.0.0", "group_size": 64, **QKV})
    config = ModelSlimConfig.from_model_dir(str(tmp_path), _Hf())  # the exact name wins over the variants
    assert config.meta == {"version": "1.0.0", "group_size": 64}


def test_non_tensor_keys_parsed() -> None:
    desc = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0", "group_size": 0, "kv_cache_type": "C8",
            "fa_quant_type": "FAKQuant", "indexer_quant_type": "INT8_DYNAMIC", "max_supported_tp": 8}
    assert cfg(desc).meta == desc


def test_fused_shards_agree_mismatch_and_float() -> None:
    prefix = f"{L0}.self_attn.qkv_proj"
    spec = cfg(QKV).get_spec(prefix, "linear")
    assert spec.quant_type == "W8A8" and spec.source_format == "modelslim"
    with pytest.raises(ValueError, match=f"Not all shards of {prefix} are quantized with same quant type"):
        cfg({**QKV, f"{L0}.self_attn.v_proj.weight": "W8A8_DYNAMIC"}).get_spec(prefix, "linear")
    with pytest.raises(ValueError, match=f"Detected some but not all shards of {prefix}"):
        cfg({**QKV, f"{L0}.self_attn.k_proj.weight": "FLOAT"}).get_spec(prefix, "linear")
    assert cfg({k: "FLOAT" for k in QKV}).get_spec(prefix, "linear") is None


def test_missing_shard_keyerror_except_gemma4_v_proj() -> None:
    desc = {k: v for k, v in QKV.items() if "v_proj" not in k}
    prefix = f"{L0}.self_attn.qkv_proj"
    with pytest.raises(KeyError, match=rf"{L0}.self_attn.v_proj.weight.*add"):
        cfg(desc).get_spec(prefix, "linear")
    assert cfg(desc, "gemma4").get_spec(prefix, "linear").quant_type == "W8A8"
    no_k = {k: v for k, v in desc.items() if "k_proj" not in k}
    with pytest.raises(KeyError, match="k_proj.weight"):
        cfg(no_k, "gemma4").get_spec(prefix, "linear")


def test_moe_uses_expert_zero() -> None:
    desc = {f"model.layers.1.mlp.experts.0.{p}.weight": "W8A8_DYNAMIC" for p in ("gate_proj", "up_proj", "down_proj")}
    desc["model.layers.1.mlp.experts.1.gate_proj.weight"] = "W4A8_DYNAMIC"  # ignored: expert 0 decides
    desc["model.layers.1.mlp.gate.weight"] = "FLOAT"
    config = cfg(desc, "qwen3_moe")
    spec = config.get_spec("model.layers.1.mlp.experts", "moe")
    assert (spec.quant_type, spec.layer_type, spec.act_strategy) == ("W8A8_DYNAMIC", "moe", "token")
    assert config.get_spec("model.layers.1.mlp.gate", "linear") is None
    with pytest.raises(ValueError, match="Not all shards"):
        cfg({**desc, "model.layers.1.mlp.experts.0.down_proj.weight": "W8A8"}, "qwen3_moe").get_spec(
            "model.layers.1.mlp.experts", "moe")


def test_skip_rule_is_component_anchored() -> None:
    desc = {f"{L0}.mlp.gate_proj.weight": "FLOAT", f"{L0}.mlp.gate.weight": "W8A8_DYNAMIC",
            f"{L0}.mlp.up_proj.weight": "FLOAT"}
    config = cfg(desc)
    # spec §11.7: a plain startswith would let "mlp.gate" match "mlp.gate_proj.weight" (FLOAT) and skip the router
    assert config.get_spec(f"{L0}.mlp.gate", "linear").quant_type == "W8A8_DYNAMIC"
    assert config.get_spec(f"{L0}.mlp.gate_up_proj", "linear") is None
    assert cfg({f"{L0}.o_proj.weight": "W8A8", f"{L0}.o_proj.inner.weight": "FLOAT"}).get_spec(
        f"{L0}.o_proj", "linear") is None


def test_rename_components_never_doubles() -> None:
    assert rename_components("model.layers.0.mlp.gate_up_proj", "gate", "gate_up_proj") == \
        "model.layers.0.mlp.gate_up_proj"
    assert rename_components("a.mlp.gate.weight", "gate", "router") == "a.mlp.router.weight"
    assert rename_components("a.mtp_block.b", "mtp_block", "") == "a.b"
    assert first_layer_id("model.layers.12.mlp.experts.3.w1.weight") == 12  # not "123" (spec §11.7)
    assert first_layer_id("lm_head.weight") is None


@pytest.mark.parametrize("model_type,desc_key,prefix,layer_type", [
    ("step3p5_mtp", "model.layers.3.mlp.down_proj.weight", "model.layers.3.mtp_block.mlp.down_proj", "linear"),
    ("step3p5", "language_model.model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj", "linear"),
    ("gemma4", "model.layers.0.experts.0.gate_proj.weight", "model.layers.0.moe.experts", "moe"),
    ("minimax_m2", "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.experts", "moe"),
    ("bailing_hybrid", "model.layers.0.attention.dense.weight", "model.layers.0.self_attn.o_proj", "linear"),
    ("bailing_hybrid", "model.layers.1.attention.q_proj.weight", "model.layers.1.linear_attn.q_proj", "linear"),
    ("deepseek_v4", "layers.0.attn.wq_a.weight", "model.layers.0.self_attn.wq_a", "linear"),
    ("deepseek_v4", "layers.0.ffn.w2.weight", "model.layers.0.mlp.down_proj", "linear"),
    ("qwen3", "transformer.shared_head.output.weight", "shared_head.head", "linear"),
    ("qwen3", "model.layers.4.shared_head.proj.weight", "model.layers.4.proj", "linear"),
    ("qwen3", "model.layers.0.mlp.down_proj.weight_packed", "model.layers.0.mlp.down_proj", "linear"),
])
def test_prefix_and_alias_mappings(model_type: str, desc_key: str, prefix: str, layer_type: str) -> None:
    desc = {desc_key: "W8A8_DYNAMIC"}
    if layer_type == "moe":  # every expert-0 shard must be present
        for a, b in (("w1", "w2"), ("w1", "w3"), ("gate_proj", "up_proj"), ("gate_proj", "down_proj")):
            desc[desc_key.replace(a, b)] = "W8A8_DYNAMIC"
    assert cfg(desc, model_type).get_spec(prefix, layer_type).quant_type == "W8A8_DYNAMIC"


def test_dsv4_hc_head_fn_augments_without_model_type() -> None:
    config = cfg({"hc_head_fn": "FLOAT", "layers.0.attn.wo_a.weight": "W8A8", "head.weight": "FLOAT"}, None)
    assert config.get_spec("model.layers.0.self_attn.wo_a", "linear").quant_type == "W8A8"
    assert config.get_spec("lm_head", "embedding") is None


def test_lm_head_alias_and_missing_non_quantizable(caplog) -> None:
    config = cfg({"language_model.lm_head.weight": "W8A16", **QKV})
    assert config.get_spec("lm_head", "embedding").quant_type == "W8A16"  # the adapter rejects it later
    with caplog.at_level(logging.WARNING):
        assert cfg(QKV).get_spec("lm_head", "embedding") is None
        assert cfg(QKV).get_spec("model.embed_tokens", "embedding") is None
        assert cfg(QKV).get_spec("visual.blocks.0.attn.qkv", "linear") is None
    assert "lm_head.weight" in caplog.text and "model.embed_tokens.weight" in caplog.text
    assert "visual.blocks.0.attn.qkv.weight" in caplog.text
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.down_proj.weight.*\"FLOAT\""):
        cfg(QKV).get_spec(f"{L0}.mlp.down_proj", "linear")


def test_spec_fields_per_type() -> None:
    key = f"{L0}.mlp.down_proj"

    def spec_of(quant_type: str, **meta):
        return cfg({f"{key}.weight": quant_type, **meta}).get_spec(key, "linear")

    s = spec_of("W8A8")
    assert (s.weight_bits, s.weight_type, s.weight_strategy, s.act_bits, s.act_strategy, s.act_dynamic,
            s.act_symmetric) == (8, "int", "channel", 8, "tensor", False, False)
    s = spec_of("W8A8_DYNAMIC")
    assert (s.act_bits, s.act_strategy, s.act_dynamic, s.act_symmetric) == (8, "token", True, True)
    s = spec_of("W8A16")
    assert (s.weight_bits, s.weight_strategy, s.act_bits) == (8, "channel", None)
    assert (spec_of("W8A16", group_size=128).weight_strategy, spec_of("W8A16", group_size=128).group_size) == (
        "group", 128)
    assert (spec_of("W4A16").weight_bits, spec_of("W4A16").group_size) == (4, 32)
    assert spec_of("W4A16", group_size=128).group_size == 128
    s = spec_of("W4A8_DYNAMIC")
    assert (s.weight_bits, s.act_bits, s.act_strategy, dict(s.extra)["packed_along"]) == (4, 8, "token", "output")
    s = spec_of("W8A8_MXFP8")
    assert (s.weight_type, s.group_size, s.act_type, s.act_group_size) == ("float", 32, "float", 32)
    for name in ("W4A4_MXFP4", "W4A8_MXFP", "W4A16_MXFP4", "W4A4_FLATQUANT_DYNAMIC", "W4A4_DYNAMIC",
                 "W8A8FP8_DYNAMIC", "W8A8_MIX", "NF4"):
        assert spec_of(name).quant_type == name
    with pytest.raises(NotImplementedError, match=r"quant_type='NF4' for layer_type='linear'"):
        quant_method_for(cfg({f"{L0}.self_attn.o_proj.weight": "NF4"}), _row(), f"{L0}.self_attn.o_proj")


def _row() -> RowParallelLinear:
    return RowParallelLinear(16, 8, bias=False, params_dtype=torch.float32)


def test_c8_kv_layers_and_attention_spec() -> None:
    desc = {**QKV, "kv_cache_type": "C8", f"{L0}.self_attn.k_proj.kv_cache_scale": "W8A8",
            "model.layers.1.self_attn.q_proj.weight": "W8A8"}
    config = cfg(desc)
    spec = config.get_spec(f"{L0}.self_attn.attn", "attention")
    assert (spec.quant_type, spec.layer_type) == ("C8", "attention")
    assert config.get_spec("model.layers.1.self_attn.attn", "attention") is None
    fa = cfg({"fa_quant_type": "FAKQuant", "model.layers.2.self_attn.fa_k.scale": "W8A8"})
    assert fa.get_spec("model.layers.2.self_attn.mla_attn", "attention").quant_type == "FAKQuant"
    idx = cfg({"model.layers.0.self_attn.indexer.quant_type": "INT8_DYNAMIC"})
    assert idx.get_spec("model.layers.0.self_attn.attn", "attention").quant_type == "INT8_DYNAMIC"


def test_anti_outlier_norm_bias() -> None:
    desc = {**QKV, f"{L0}.input_layernorm.bias": "FLOAT", f"{L0}.input_layernorm.weight": "FLOAT"}
    config = cfg(desc)
    assert config.norm_bias and not cfg(QKV).norm_bias
    holder = torch.nn.ModuleDict({"a": RMSNorm(8, 1e-6, torch.float32), "b": RMSNorm(8, 1e-6, torch.float32)})
    config.prepare_model(holder)
    norm = holder["a"]
    assert torch.equal(norm.bias, torch.zeros(8)) and norm.bias.quant_optional
    g = torch.Generator().manual_seed(0)
    norm.weight.data = torch.rand(8, generator=g) + 0.5
    norm.bias.data = torch.randn(8, generator=g)
    x, r = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)

    def ref(v: torch.Tensor) -> torch.Tensor:  # y = x / rms(x) * w + b
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight + norm.bias

    torch.testing.assert_close(norm(x), ref(x))
    y, s = norm(x, r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, ref(x + r))


def test_310p_config_embeddings_float_and_registry() -> None:
    desc = {**QKV, "model.embed_tokens.weight": "W8A8", "lm_head.weight": "W8A8"}
    config = ModelSlimConfig310P(desc, "qwen3")
    assert config.registry is REGISTRY_310P and cfg(desc).registry is DEFAULT_REGISTRY
    assert config.get_spec("model.embed_tokens", "embedding") is None
    assert config.get_spec("lm_head", "embedding") is None
    assert config.get_spec(f"{L0}.self_attn.qkv_proj", "linear").quant_type == "W8A8"


@pytest.mark.parametrize("config_cls", [ModelSlimConfig, ModelSlimConfig310P])
def test_w8a8sc_rejected_in_both_registries(config_cls) -> None:
    config = config_cls({f"{L0}.self_attn.{p}.weight": "W8A8SC" for p in ("q_proj", "k_proj", "v_proj")}, "qwen3")
    with pytest.raises(ValueError, match="W8A8SC is a 310P-only compressed format; re-export as W8A8S/W8A8"):
        QKVParallelLinear(16, 4, 2, 2, bias=False, params_dtype=torch.float16, quant_config=config,
                          prefix=f"{L0}.self_attn.qkv_proj")
