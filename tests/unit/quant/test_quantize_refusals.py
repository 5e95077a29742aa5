"""What `ascent quantize` and the quantized loaders refuse instead of writing or serving something wrong: a non-empty
or file output, a mixture-of-experts model, a pack-quantized K that fills no whole word, zero points the
activation-quantized kernels would ignore, and a quantized checkpoint loaded without its quantization config."""

from __future__ import annotations

import json

import pytest
import torch

from ascent import LLM
from ascent.entrypoints.cli import main as cli_main
from ascent.quantization.configs.compressed_tensors import args_to_quant_type
from tests.fixtures.tiny_models import build_model
from tests.fixtures.tiny_moe import build_moe_model

W8_CH = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False,
         "group_size": None}
A8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True, "group_size": None}
A8_TENSOR = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False,
             "group_size": None}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_model("qwen3", tmp_path_factory.mktemp("tiny_q3"), seed=3, hidden_size=128, intermediate_size=256,
                       head_dim=32)


def _quantize(capsys, *argv) -> tuple[int, str]:
    rc = cli_main(["quantize", *map(str, argv)])
    return rc, capsys.readouterr().err


def test_output_must_be_new_or_empty(tiny_dir, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    rc, err = _quantize(capsys, tiny_dir, a_file, "--scheme", "w8a16")
    assert rc == 2 and "not a directory" in err
    rc, err = _quantize(capsys, tiny_dir, tiny_dir, "--scheme", "w8a16")  # the source itself
    assert rc == 2 and "not empty" in err
    assert json.loads((tiny_dir / "config.json").read_text()).get("quantization_config") is None
    rc, _ = _quantize(capsys, tiny_dir, tmp_path / "ok", "--scheme", "w8a16")
    assert rc == 0 and (tmp_path / "ok" / "config.json").is_file()


def test_mixture_of_experts_models_are_refused(tmp_path, capsys):
    moe = build_moe_model(tmp_path / "moe")
    rc, err = _quantize(capsys, moe, tmp_path / "out", "--scheme", "w8a8_dynamic")
    assert rc == 2 and "mixture-of-experts" in err and not (tmp_path / "out").exists()


def test_pack_quantized_needs_whole_words(tmp_path, capsys):
    odd = build_model("llama", tmp_path / "odd", seed=1, hidden_size=64, intermediate_size=98)
    rc, err = _quantize(capsys, odd, tmp_path / "out", "--scheme", "w8a16")
    assert rc == 2 and "K=98" in err and "down_proj" in err
    rc, _ = _quantize(capsys, odd, tmp_path / "ms", "--scheme", "w8a16", "--format", "modelslim")
    assert rc == 0


@pytest.mark.parametrize("w,a", [({**W8_CH, "symmetric": False}, A8_TOKEN), (W8_CH, {**A8_TENSOR, "symmetric": False})])
def test_zero_points_with_quantized_activations_are_not_supported(w, a):
    with pytest.raises(NotImplementedError, match="asymmetric"):
        args_to_quant_type("int-quantized", w, a)
    assert args_to_quant_type("int-quantized", W8_CH, A8_TOKEN) == "W8A8_DYNAMIC"


def test_modelslim_static_weight_offset_must_be_zero(tiny_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "w8a8"
    assert _quantize(capsys, tiny_dir, out, "--scheme", "w8a8", "--format", "modelslim")[0] == 0
    shard = next(out.glob("quant_model_weight*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in tensors if n.endswith("q_proj.weight_offset"))
    tensors[name] = torch.full_like(tensors[name], 3.0)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match="weight_offset has non-zero entries"):
        LLM(model=str(out), dtype="float32", max_model_len=32, disable_log_stats=True)


def test_quantized_checkpoint_without_its_config_is_an_error(tiny_dir, tmp_path, capsys):
    out = tmp_path / "w8a16"
    assert _quantize(capsys, tiny_dir, out, "--scheme", "w8a16", "--format", "modelslim")[0] == 0
    (out / "quant_model_description.json").unlink()
    with pytest.raises(ValueError, match="torch.int8 values for a torch.float32 parameter"):
        LLM(model=str(out), dtype="float32", max_model_len=32, disable_log_stats=True)
