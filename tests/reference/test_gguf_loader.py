"""GGUF weights and config vs transformers' own GGUF loader, and vs the original weights of tiny written GGUFs."""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ascent.default_model import default_model_path
from ascent.loader.gguf import (_cached_reader, gguf_tensor_name_to_hf, gguf_to_hf_config, iterate_gguf_weights,
                                release_gguf_readers)
from ascent.loader.model_info import derive_max_model_len, get_model_dtype
from ascent.models.common import head_dim_of

torch.set_num_threads(1)

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def hf_state(smollm_path: str) -> dict[str, torch.Tensor]:
    """state_dict of transformers' GGUF load of SmolLM2 (float32), loaded once for the module."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model
    return state


def test_smollm_weights_equal_transformers(smollm_path: str, hf_state: dict[str, torch.Tensor]) -> None:
    seen = set()
    for name, tensor in iterate_gguf_weights(smollm_path):
        assert tensor.dtype == torch.float32
        ref = hf_state[name]
        assert tensor.shape == ref.shape, name
        assert (tensor - ref).abs().max().item() <= 1e-6, name
        seen.add(name)
    assert "lm_head.weight" not in seen  # tied embeddings: transformers' lm_head is the embedding matrix
    assert torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"])
    assert seen == set(hf_state) - {"lm_head.weight"}


def test_smollm_config_equals_transformers(smollm_path: str) -> None:
    from transformers import AutoConfig

    ours = gguf_to_hf_config(smollm_path)
    ref = AutoConfig.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))
    assert type(ours) is type(ref)
    assert ours.architectures == ["LlamaForCausalLM"]
    for field in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "hidden_act",
    ):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope_parameters["rope_type"] == ref.rope_parameters["rope_type"]
    assert get_model_dtype(ours, "auto", "cpu") is torch.bfloat16  # GGUF has no single HF dtype
    assert derive_max_model_len(ours, None) == 8192


# ------------------------------------------------------------------------------------- tiny GGUFs written here
def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf ``LlamaModel.permute``: rows [n_head, 2, d/2] stored as [n_head, d/2, 2]."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
# tensor -> storage type (everything else F32); the Q8_0 one is also permuted for llama.
_TENSOR_TYPES = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.F16, "blk.0.ffn_gate.weight": Q.BF16}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK['.'.join(rest[:-1])]}.{rest[-1]}"


def _write_tiny_gguf(kind: str, path: Path) -> tuple[object, dict[str, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=(kind == "qwen3"),
    )
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    if kind == "qwen2":  # head_dim is hidden_size / num_attention_heads; q/k/v carry biases
        fields.pop("head_dim")
    config = config_cls(**fields)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")

    writer = gguf.GGUFWriter(str(path), kind)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if kind == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    else:
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    for hf_name, tensor in state.items():
        name = _gguf_name(hf_name)
        array = tensor.numpy().astype(np.float32)
        if kind == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif kind == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = _TENSOR_TYPES.get(name, Q.F32)
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, state


def _tolerance(name: str, original: torch.Tensor) -> torch.Tensor | float:
    qtype = _TENSOR_TYPES.get(_gguf_name(name), Q.F32)
    if qtype == Q.Q8_0:
        # Q8_0: per 32-value block, scale d = amax/127 (fp16), error <= d/2 + 127 * |d - fp16(d)|.
        blocks = original.reshape(original.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
        return (0.6 * blocks / 127).expand(-1, -1, 32).reshape(original.shape)
    if qtype == Q.F16:
        return original.abs() * 2.0**-11 + 1e-7
    if qtype == Q.BF16:
        return original.abs() * 2.0**-8
    return 0.0


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_tiny_gguf_round_trip(kind: str, tmp_path: Path) -> None:
    config, state = _write_tiny_gguf(kind, tmp_path / f"{kind}.gguf")
    loaded = dict(iterate_gguf_weights(str(tmp_path / f"{kind}.gguf")))
    assert set(loaded) == set(state)
    for name, original in state.items():
        got = loaded[name]
        assert got.shape == original.shape and got.dtype == torch.float32, name
        error = (got - original).abs()
        assert bool((error <= _tolerance(name, original)).all()), (name, error.max().item())
    # the Q8_0 tensor really was quantized, and un-permuting mattered
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(loaded[q0], state[q0])
    if kind == "llama":
        permuted = torch.from_numpy(llama_cpp_permute(state[q0].numpy(), config.num_attention_heads))
        assert (loaded[q0] - state[q0]).abs().max() < (permuted - state[q0]).abs().max() / 10


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_tiny_gguf_config(kind: str, tmp_path: Path) -> None:
    config, _ = _write_tiny_gguf(kind, tmp_path / f"{kind}.gguf")
    ours = gguf_to_hf_config(str(tmp_path / f"{kind}.gguf"))
    assert type(ours) is type(config)
    assert ours.architectures == [type(config).__name__.replace("Config", "ForCausalLM")]
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id",
    ):
        assert getattr(ours, field) == getattr(config, field), field
    assert head_dim_of(ours) == head_dim_of(config) == 16
    assert math.isclose(ours.rms_norm_eps, config.rms_norm_eps, rel_tol=1e-6)
    assert ours.rope_parameters["rope_theta"] == 5000.0


def test_rope_scaling_metadata(tmp_path: Path) -> None:
    path = tmp_path / "yarn.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for add, value in (
        (writer.add_block_count, 1), (writer.add_context_length, 4096), (writer.add_embedding_length, 64),
        (writer.add_feed_forward_length, 96), (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_key_length, 16), (writer.add_rope_freq_base, 1e6), (writer.add_vocab_size, 32),
        (writer.add_rope_scaling_type, gguf.RopeScalingType.YARN), (writer.add_rope_scaling_factor, 4.0),
        (writer.add_rope_scaling_orig_ctx_len, 1024),
    ):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    rope = gguf_to_hf_config(str(path)).rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 1024 and rope["rope_theta"] == 1e6


def test_bad_inputs_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        gguf_tensor_name_to_hf("blk.0.ssm_conv1d.weight")
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="missing.gguf"):
        gguf_to_hf_config(missing)
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'"):
        gguf_to_hf_config(str(path))
    with pytest.raises(ValueError, match="'gpt2'"):
        next(iterate_gguf_weights(str(path)))


def test_rope_freqs_tensor_reproduces_llama3_scaling(tmp_path: Path) -> None:
    """llama.cpp's converter writes Llama 3.x's llama3 rope scaling as ``rope_freqs.weight`` (per-frequency
    divisors, no scaling metadata); the frequencies must equal transformers' llama3 RoPE of the original config."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ascent.layers.rotary import compute_inv_freq, rope_parameters_from_config

    head, theta = 32, 500000.0
    hf = LlamaConfig(hidden_size=4 * head, num_attention_heads=4, head_dim=head, max_position_embeddings=1024,
                     rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    llama3_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    base_inv = 1.0 / theta ** (torch.arange(0, head, 2, dtype=torch.float32) / head)
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        (writer.add_block_count, 1), (writer.add_context_length, 1024), (writer.add_embedding_length, 4 * head),
        (writer.add_feed_forward_length, 96), (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_rope_dimension_count, head), (writer.add_rope_freq_base, theta), (writer.add_vocab_size, 32),
    ):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 4 * head), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", (base_inv / llama3_inv).numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = rope_parameters_from_config(gguf_to_hf_config(str(path)))
    inv, attention_factor, _ = compute_inv_freq(head, 1024, params)
    torch.testing.assert_close(inv, llama3_inv, rtol=1e-6, atol=0)
    assert attention_factor == 1.0 and not torch.allclose(inv, base_inv)  # the factors mattered
    with pytest.raises(ValueError, match="freq_factors has 3 entries"):
        compute_inv_freq(head, 1024, {**params, "freq_factors": [1.0, 2.0, 3.0]})


def test_readers_are_shared_until_released(tmp_path: Path) -> None:
    path = str(tmp_path / "llama.gguf")
    _write_tiny_gguf("llama", tmp_path / "llama.gguf")
    release_gguf_readers()
    gguf_to_hf_config(path)
    dict(iterate_gguf_weights(path))
    info = _cached_reader.cache_info()
    assert info.currsize == 1 and info.hits >= 1  # config and weights read one parsed file
    release_gguf_readers()
    assert _cached_reader.cache_info().currsize == 0
    assert gguf_to_hf_config(path).num_hidden_layers == 2  # a later open parses the file again
