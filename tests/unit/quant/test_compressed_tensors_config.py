"""compressed-tensors ``quantization_config`` -> QuantSpec (spec §1.2). The config dicts are the ones llmcompressor /
compressed-tensors write (specs/feasibility.md §4, specs/quantization.md §1.2), as literals; one test also
cross-checks the mapping against the presets of the installed compressed-tensors package."""

from __future__ import annotations

import pytest

from ascent.quantization.configs.compressed_tensors import CompressedTensorsConfig, args_to_quant_type
from ascent.quantization.configs.modelslim_mapping import packed_modules_for

W8A8_INT_DYN = {  # llmcompressor 0.14 W8A8 preset (feasibility.md §4)
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False,
                    "observer": "memoryless_minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True},
        "output_activations": None}},
    "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}
W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False,
        "actorder": "static"}}}}
FP8_BLOCK = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                              "block_structure": [128, 128], "symmetric": True, "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                        "group_size": 128, "symmetric": True, "dynamic": True}}}}
L0 = "model.layers.0"


def ct(qc: dict, model_type: str = "qwen3") -> CompressedTensorsConfig:
    return CompressedTensorsConfig(qc, packed_modules_for(model_type))


def group(weights: dict, acts: dict | None = None, targets=("Linear",), fmt: str | None = None) -> dict:
    g = {"targets": list(targets), "weights": weights}
    if acts is not None:
        g["input_activations"] = acts
    if fmt is not None:
        g["format"] = fmt
    return g


def qc_of(fmt: str, *groups: dict, ignore=("lm_head",), **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}, **extra}


W8_CH = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
A8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
A8_TENSOR = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False}


def test_w8a8_dynamic_preset_and_fused_expansion() -> None:
    config = ct(W8A8_INT_DYN)
    spec = config.get_spec(f"{L0}.self_attn.qkv_proj", "linear")
    assert (spec.quant_type, spec.source_format, spec.act_strategy, spec.act_dynamic) == (
        "W8A8_DYNAMIC", "compressed-tensors", "token", True)
    assert config.checkpoint_names(f"{L0}.self_attn.qkv_proj", "linear") == [
        f"{L0}.self_attn.q_proj", f"{L0}.self_attn.k_proj", f"{L0}.self_attn.v_proj"]
    assert config.get_spec("lm_head", "embedding") is None  # ignored
    assert config.get_spec("model.embed_tokens", "embedding") is None  # "Linear" does not target embeddings
    assert config.get_spec(f"{L0}.self_attn.attn", "attention") is None  # kv_cache_scheme null


def test_w8a8_static_w4a16_fp8_block() -> None:
    spec = ct(qc_of("int-quantized", group(W8_CH, A8_TENSOR))).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.act_dynamic, spec.act_strategy) == ("W8A8", False, "tensor")
    spec = ct(W4A16).get_spec(f"{L0}.mlp.gate_up_proj", "linear")
    assert (spec.quant_type, spec.weight_bits, spec.group_size, spec.act_bits) == ("W4A16", 4, 128, None)
    spec = ct(FP8_BLOCK).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.block_structure, spec.act_group_size) == ("FP8_BLOCK", (128, 128), 128)


def test_w4a8_reads_weights_group_size_and_asym_w4a16() -> None:
    w4g = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True, "dynamic": False}
    spec = ct(qc_of("int-quantized", group(w4g, A8_TOKEN))).get_spec(f"{L0}.mlp.experts", "moe")
    assert (spec.quant_type, spec.layer_type, spec.group_size) == ("W4A8_DYNAMIC", "moe", 64)  # not 32: bug §11.2
    w4c = {**w4g, "strategy": "channel", "group_size": None}
    assert ct(qc_of("int-quantized", group(w4c, A8_TOKEN))).get_spec(
        f"{L0}.mlp.down_proj", "linear").weight_strategy == "channel"
    asym = ct(qc_of("pack-quantized", group({**w4g, "group_size": 128, "symmetric": False})))
    spec = asym.get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.weight_symmetric) == ("W4A16", False)
    w8 = ct(qc_of("pack-quantized", group({**w4g, "num_bits": 8, "group_size": 128})))
    assert w8.get_spec(f"{L0}.mlp.down_proj", "linear").quant_type == "W8A16"


def test_fp8_dynamic_and_mx_formats() -> None:
    f8c = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    f8tok = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    assert ct(qc_of("float-quantized", group(f8c, f8tok))).get_spec(
        f"{L0}.mlp.down_proj", "linear").quant_type == "W8A8FP8_DYNAMIC"
    mx = lambda bits: {"num_bits": bits, "type": "float", "strategy": "group", "group_size": 32,  # noqa: E731
                       "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
    mxa = lambda bits: {**mx(bits), "dynamic": True}  # noqa: E731
    cases = [("mxfp8-quantized", mx(8), mxa(8), "W8A8_MXFP8"), ("mxfp4-pack-quantized", mx(4), mxa(4), "W4A4_MXFP4"),
             ("mxfp4-pack-quantized", mx(4), mxa(8), "W4A8_MXFP"), ("mxfp4-pack-quantized", mx(4), None, "W4A16_MXFP4")]
    for fmt, w, a, expected in cases:
        assert ct(qc_of(fmt, group(w, a))).get_spec(f"{L0}.mlp.down_proj", "linear").quant_type == expected


def test_unknown_combination_names_format_and_args() -> None:
    fp8_static = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    spec = ct(qc_of("float-quantized", group(fp8_static, fp8_static))).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert (spec.quant_type, spec.weight_strategy, spec.act_strategy, spec.act_dynamic) == (
        "W8A8FP8", "tensor", "tensor", False)  # llm-compressor's "FP8" preset
    static_token = {**fp8_static, "strategy": "token"}
    with pytest.raises(NotImplementedError, match=r"format='float-quantized'.*'strategy': 'token'"):
        ct(qc_of("float-quantized", group(fp8_static, static_token))).get_spec(f"{L0}.mlp.down_proj", "linear")
    nv = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": False}
    with pytest.raises(NotImplementedError, match="nvfp4-pack-quantized"):
        ct(qc_of("nvfp4-pack-quantized", group(nv, {**nv, "dynamic": "local"}))).get_spec(f"{L0}.o", "linear")
    with pytest.raises(NotImplementedError, match="'sparse-bitmask'"):
        ct(qc_of("sparse-bitmask", group(W8_CH)))


def test_targets_regex_exact_priority_and_group_format_override() -> None:
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    qc = qc_of("int-quantized", group(W8_CH, A8_TOKEN),
               group(w4, targets=["re:.*down_proj$"], fmt="pack-quantized"),
               group(W8_CH, A8_TENSOR, targets=[f"{L0}.mlp.down_proj"]),
               ignore=["lm_head", "re:.*layers\\.1\\..*"])
    config = ct(qc)
    assert config.get_spec(f"{L0}.mlp.down_proj", "linear").quant_type == "W8A8"  # exact name beats regex
    assert config.get_spec("model.layers.2.mlp.down_proj", "linear").quant_type == "W4A16"  # regex beats class
    assert config.get_spec("model.layers.2.mlp.gate_up_proj", "linear").quant_type == "W8A8_DYNAMIC"  # class
    assert config.get_spec("model.layers.1.mlp.gate_up_proj", "linear") is None  # ignored by regex


def test_fused_shards_must_agree_on_ignore_and_group() -> None:
    config = ct(qc_of("int-quantized", group(W8_CH, A8_TOKEN), ignore=[f"{L0}.self_attn.k_proj"]))
    with pytest.raises(ValueError, match="ignore status"):
        config.get_spec(f"{L0}.self_attn.qkv_proj", "linear")
    config = ct(qc_of("int-quantized", group(W8_CH, A8_TOKEN, targets=["re:.*q_proj"])))
    with pytest.raises(ValueError, match="config group"):
        config.get_spec(f"{L0}.self_attn.qkv_proj", "linear")
    all_ignored = ct(qc_of("int-quantized", group(W8_CH, A8_TOKEN), ignore=["re:.*self_attn.*"]))
    assert all_ignored.get_spec(f"{L0}.self_attn.qkv_proj", "linear") is None


def test_moe_linear_target_and_expert_zero_name() -> None:
    config = ct(W8A8_INT_DYN, "qwen3_moe")
    assert config.checkpoint_names("model.layers.1.mlp.experts", "moe") == ["model.layers.1.mlp.experts.0.gate_proj"]
    assert config.get_spec("model.layers.1.mlp.experts", "moe").layer_type == "moe"
    only_attn = ct(qc_of("int-quantized", group(W8_CH, A8_TOKEN, targets=["re:.*self_attn.*"])), "qwen3_moe")
    assert only_attn.get_spec("model.layers.1.mlp.experts", "moe") is None
    by_name = ct(qc_of("int-quantized", group(W8_CH, A8_TOKEN, targets=["re:.*experts\\.0\\.gate_proj$"])))
    assert by_name.get_spec("model.layers.1.mlp.experts", "moe").quant_type == "W8A8_DYNAMIC"


def test_kv_cache_scheme_routes_to_attention_spec(caplog) -> None:
    qc = {**W8A8_INT_DYN, "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor",
                                               "symmetric": True, "dynamic": False}}
    with caplog.at_level("WARNING"):
        spec = ct(qc).get_spec(f"{L0}.self_attn.attn", "attention")
    assert "kv_cache_scheme" in caplog.text and "not applied" in caplog.text  # not silently ignored
    assert (spec.quant_type, spec.layer_type, spec.source_format) == ("C8", "attention", "compressed-tensors")
    fp8_kv = {**W8A8_INT_DYN, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                   "dynamic": False}}
    assert ct(fp8_kv).get_spec(f"{L0}.self_attn.attn", "attention").quant_type == "KV_FLOAT8"


@pytest.mark.parametrize("preset,fmt,expected", [
    ("W8A8", "int-quantized", "W8A8_DYNAMIC"), ("INT8", "int-quantized", "W8A8_DYNAMIC"),
    ("W4A16", "pack-quantized", "W4A16"), ("W4A16_ASYM", "pack-quantized", "W4A16"),
    ("W8A16", "pack-quantized", "W8A16"), ("FP8_DYNAMIC", "float-quantized", "W8A8FP8_DYNAMIC"),
    ("FP8_BLOCK", "float-quantized", "FP8_BLOCK"), ("W4A8", "int-quantized", "W4A8_DYNAMIC"),
    ("MXFP4", "mxfp4-pack-quantized", "W4A4_MXFP4"), ("MXFP8", "mxfp8-quantized", "W8A8_MXFP8"),
])
def test_installed_compressed_tensors_presets(preset: str, fmt: str, expected: str) -> None:
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    weights, acts = scheme["weights"], scheme.get("input_activations")
    config = ct(qc_of(fmt, group(weights, acts)))
    assert config.get_spec(f"{L0}.mlp.down_proj", "linear").quant_type == expected
    assert args_to_quant_type(fmt, config.groups[0][2], config.groups[0][3]) == expected


def test_actorder_is_recorded_and_refused_where_no_scheme_permutes() -> None:
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, "actorder": "group"}
    spec = ct(qc_of("pack-quantized", group(w4))).get_spec(f"{L0}.mlp.down_proj", "linear")
    assert spec.quant_type == "W4A16" and spec.extra["actorder"] == "group"
    a8 = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    with pytest.raises(NotImplementedError, match="actorder='group'.*W4A8_DYNAMIC"):
        ct(qc_of("int-quantized", group(w4, a8))).get_spec(f"{L0}.mlp.down_proj", "linear")
