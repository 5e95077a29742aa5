"""End to end through ``get_model``: a ModelSlim W8A16 checkpoint written here by the published formula
(q = clamp(rint(W / s), -128, 127), s = row absmax / 127, zero offsets; spec §1.1/§2) loads by auto-detection and
its logits match HF transformers run on the dequantized weights (q * s). Also: checkpoint-name routing of quant
tensors (``weight_scale``/``deq_scale`` into fused params, the router ``mlp.gate`` kept apart from ``gate_proj``),
optional parameters, anti-outlier norm biases, and GGUF/dummy/float loading unaffected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from ascent.layers.linear import UnquantizedLinearMethod
from ascent.loader.base import get_model
from ascent.quantization.method_adapters import QuantLinearMethod
from tests.fixtures.tiny_models import build_model
from tests.reference.test_models_vs_hf import PagedHarness

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_w8a16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelSlim W8A16 per-channel symmetric: int8 [N, K], fp32 scale [N, 1]."""
    scale = weight.float().abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.clamp(torch.round(weight.float() / scale), -128, 127).to(torch.int8)
    return q, scale


def write_w8a16(src: Path, dst: Path, norm_bias: dict[str, torch.Tensor] | None = None,
                description_name: str = "quant_model_description_w8a16.json") -> dict[str, torch.Tensor]:
    """Copy the float model in ``src`` to a ModelSlim W8A16 checkpoint in ``dst``; returns the dequantized linear
    weights (checkpoint name -> q * s) for the reference."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors, desc, dequant = {}, {"model_quant_type": "W8A16", "version": "1.0.0"}, {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            q, s = quantize_w8a16(tensor)
            tensors.update({name: q, f"{module}.weight_scale": s, f"{module}.weight_offset": torch.zeros_like(s)})
            desc.update({name: "W8A16", f"{module}.weight_scale": "W8A16", f"{module}.weight_offset": "W8A16"})
            dequant[name] = q.float() * s
        else:
            tensors[name] = tensor
            desc[name] = "FLOAT"
    for norm, bias in (norm_bias or {}).items():
        tensors[f"{norm}.bias"] = bias
        tensors[f"{norm}.module.weight"] = tensors[f"{norm}.weight"].clone()  # legacy duplicate, must not fail
        desc.update({f"{norm}.bias": "FLOAT", f"{norm}.module.weight": "W8A16"})
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / description_name).write_text(json.dumps(desc))
    return dequant


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return build_model("qwen3", tmp_path_factory.mktemp("float") / "qwen3")


def engine_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return PagedHarness(model).step([("r", ids)])["r"]


def hf_reference(model_dir: Path, dequant: dict[str, torch.Tensor], ids: list[int],
                 qkv_bias: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """HF logits with every quantized linear replaced by its dequantized weight (and optional extra q/k/v biases)."""
    overrides = {"attention_bias": True} if qkv_bias else {}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **overrides)
    state = hf.state_dict()
    with torch.no_grad():
        for name, weight in dequant.items():
            state[name].copy_(weight)
        for name, value in (qkv_bias or {}).items():
            state[name].copy_(value)
        return hf(torch.tensor([ids])).logits[0].float()


def test_modelslim_w8a16_end_to_end(float_dir: Path, tmp_path: Path) -> None:
    quant_dir = tmp_path / "w8a16"
    dequant = write_w8a16(float_dir, quant_dir)
    config = AutoConfig.from_pretrained(str(quant_dir))
    model = get_model(str(quant_dir), config, torch.float32, "cpu")  # auto-detects the ModelSlim description
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj.quant_method, QuantLinearMethod)
    assert attn.qkv_proj.quant_method.scheme.spec.quant_type == "W8A16"
    ids = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = engine_logits(model, ids)
    ref = hf_reference(float_dir, dequant, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert attn.qkv_proj.weight.dtype == torch.int8 and attn.qkv_proj.weight_scale.shape == (128, 1)


def test_anti_outlier_norm_bias_end_to_end(float_dir: Path, tmp_path: Path) -> None:
    """``input_layernorm.bias`` b feeds only q/k/v, so the reference is HF with q/k/v biases W_deq @ b."""
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(64, generator=g) * 0.1
    norm = "model.layers.0.input_layernorm"
    quant_dir = tmp_path / "w8a16_m4"
    dequant = write_w8a16(float_dir, quant_dir, {norm: bias}, "quant_model_description.json")
    config = AutoConfig.from_pretrained(str(quant_dir))
    model = get_model(str(quant_dir), config, torch.float32, "cpu", quantization="ascend")
    assert torch.equal(model.model.layers[0].input_layernorm.bias, bias)
    assert torch.equal(model.model.layers[1].input_layernorm.bias, torch.zeros(64))  # optional, zero when absent
    qkv_bias = {}
    for layer in range(2):
        b = bias if layer == 0 else torch.zeros(64)
        for proj in ("q_proj", "k_proj", "v_proj"):
            qkv_bias[f"model.layers.{layer}.self_attn.{proj}.bias"] = dequant[
                f"model.layers.{layer}.self_attn.{proj}.weight"] @ b
    ids = torch.randint(3, 512, (10,), generator=g).tolist()
    ours = engine_logits(model, ids)
    ref = hf_reference(float_dir, dequant, ids, qkv_bias)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_quant_tensor_routing_and_router_name(tmp_path: Path) -> None:
    """``q_proj.weight_scale`` -> ``qkv_proj.weight_scale`` shard q; ``mlp.gate.weight`` never maps to gate_up."""
    from ascent.models.common import DecoderForCausalLM

    model = DecoderForCausalLM.__new__(DecoderForCausalLM)
    torch.nn.Module.__init__(model)
    model.tie_word_embeddings = False
    seen: list[tuple[str, object]] = []

    def loader(name):
        return lambda param, tensor, shard_id=None: seen.append((name, shard_id))

    for name in ("model.layers.0.self_attn.qkv_proj.weight_scale", "model.layers.0.self_attn.qkv_proj.deq_scale",
                 "model.layers.0.mlp.gate_up_proj.weight_offset", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.self_attn.attn.k_cache_scale"):
        param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
        param.weight_loader = loader(name)
        model.register_parameter(name.replace(".", "__"), param)
    params = {n.replace("__", "."): p for n, p in model.named_parameters()}
    model.named_parameters = lambda: iter(params.items())  # flat names as the real model has them
    loaded = model.load_weights([
        ("model.layers.0.self_attn.k_proj.weight_scale", torch.ones(1)),
        ("model.layers.0.self_attn.v_proj.deq_scale", torch.ones(1)),
        ("model.layers.0.mlp.up_proj.weight_offset", torch.ones(1)),
        ("model.layers.0.mlp.gate.weight", torch.ones(1)),
        ("model.layers.0.self_attn.k_proj.kv_cache_scale", torch.ones(1)),
        ("model.layers.0.input_layernorm.module.weight", torch.ones(1)),  # legacy key: skipped, no error
    ])
    assert seen == [("model.layers.0.self_attn.qkv_proj.weight_scale", "k"),
                    ("model.layers.0.self_attn.qkv_proj.deq_scale", "v"),
                    ("model.layers.0.mlp.gate_up_proj.weight_offset", 1),
                    ("model.layers.0.mlp.gate.weight", None),
                    ("model.layers.0.self_attn.attn.k_cache_scale", None)]
    assert loaded == {"model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.attn.k_cache_scale"}


def test_float_and_dummy_loading_unaffected(float_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(float_dir))
    model = get_model(str(float_dir), config, torch.float32, "cpu")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.quant_method, UnquantizedLinearMethod)
    assert model.model.layers[0].input_layernorm.bias is None
    dummy = get_model(str(float_dir), config, torch.float32, "cpu", load_format="dummy")
    assert isinstance(dummy.model.layers[0].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    with pytest.raises(ValueError, match="load format 'dummy'"):
        get_model(str(float_dir), config, torch.float32, "cpu", load_format="dummy", quantization="fp8")


def test_engine_args_carry_quantization(float_dir: Path) -> None:
    from ascent.args import EngineArgs

    config = EngineArgs(model=str(float_dir), quantization="ascend").create_engine_config()
    assert config.model_config.quantization == "ascend"
    assert EngineArgs(model=str(float_dir)).create_engine_config().model_config.quantization is None
    with pytest.raises(ValueError, match="quantization='int3' is invalid"):
        EngineArgs(model=str(float_dir), quantization="int3").create_engine_config()


def test_missing_linear_key_names_the_fix(float_dir: Path, tmp_path: Path) -> None:
    quant_dir = tmp_path / "broken"
    write_w8a16(float_dir, quant_dir, description_name="quant_model_description.json")
    desc = json.loads((quant_dir / "quant_model_description.json").read_text())
    del desc["model.layers.1.mlp.down_proj.weight"]
    (quant_dir / "quant_model_description.json").write_text(json.dumps(desc))
    config = AutoConfig.from_pretrained(str(quant_dir))
    with pytest.raises(KeyError, match=r"model.layers.1.mlp.down_proj.weight.*FLOAT"):
        get_model(str(quant_dir), config, torch.float32, "cpu")
