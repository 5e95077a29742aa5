"""Asymmetric weight-only export (``ascent quantize --asymmetric``): min-max RTN with float offsets written as
ModelSlim ``weight_offset`` and read back by the W4A16 / W8A16 schemes (``W = (q - offset) * scale``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ascent.benchmarks.quant import export_dir_name
from ascent.entrypoints.cli import main as cli_main
from ascent.quantization.export.rtn import quantize_asymmetric, quantize_per_group
from ascent.quantization.export.schemes import check_asymmetric, get_scheme
from tests.fixtures.tiny_models import build_model

TINY = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def affine_grid_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight on a per-group affine 4-bit grid ``w = d * u + m`` (u in 0..15, both ends used in every group, as
    GGUF Q4_1 blocks are) and its integers u."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (n, k // group, group), generator=g)
    u[:, :, 0], u[:, :, 1] = 0, 15
    d = torch.rand(n, k // group, 1, generator=g, dtype=torch.float64) * 0.02 + 1e-3
    m = -torch.rand(n, k // group, 1, generator=g, dtype=torch.float64) * 0.2
    return (d * u + m).reshape(n, k), u.reshape(n, k)


def test_asymmetric_rtn_reproduces_an_affine_4bit_grid():
    w, u = affine_grid_weight(48, 128, 32, seed=1)
    asym = quantize_asymmetric(w, 4, 32, torch.float32)
    assert torch.equal(asym.q, (u - 8).to(torch.int8))
    torch.testing.assert_close(asym.dequantize(), w, rtol=0, atol=1e-7)
    sym = quantize_per_group(w, 4, 32, torch.float32)
    sym_err = (sym.dequantize() - w).pow(2).sum()
    assert (asym.dequantize() - w).pow(2).sum() < sym_err * 1e-6


@pytest.mark.parametrize("bits,group", [(4, 16), (4, None), (8, 32), (8, None)])
def test_asymmetric_rtn_bounds(bits, group):
    """Integers in range, each group's min / max at the range's ends, error at most half a step."""
    w = torch.randn(20, 64, generator=torch.Generator().manual_seed(bits)) * 0.1 + 0.03
    qw = quantize_asymmetric(w, bits, group, torch.float32)
    size = group or 64
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert qw.scale.shape == qw.offset.shape == (20, 64 // size) and qw.offset.dtype == torch.float32
    blocks = qw.q.reshape(20, -1, size)
    assert torch.equal(blocks.amin(2), torch.full_like(blocks.amin(2), qmin))
    assert torch.equal(blocks.amax(2), torch.full_like(blocks.amax(2), qmax))
    step = qw.scale.double().repeat_interleave(size, dim=1)
    assert bool(((qw.dequantize() - w.double()).abs() <= step * (0.5 + 1e-6)).all())


def test_asymmetric_rtn_rejects_a_group_that_does_not_divide_k():
    with pytest.raises(ValueError, match=r"layer\.x.*K=100.*group_size=32"):
        quantize_asymmetric(torch.zeros(4, 100), 4, 32, torch.float32, name="layer.x")


def test_asymmetric_needs_a_weight_only_scheme_and_modelslim():
    check_asymmetric(get_scheme("w4a16"), "modelslim")
    check_asymmetric(get_scheme("w8a16"), "modelslim")
    with pytest.raises(ValueError, match="w8a8_dynamic"):
        check_asymmetric(get_scheme("w8a8_dynamic"), "modelslim")
    with pytest.raises(ValueError, match="compressed-tensors"):
        check_asymmetric(get_scheme("w4a16"), "compressed-tensors")


def test_bench_caches_asymmetric_exports_apart():
    assert export_dir_name("w4a16", "modelslim", False, 32) != export_dir_name("w4a16", "modelslim", False, 32,
                                                                               asymmetric=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("tiny_asym"), seed=5, **TINY)


def dequantized_hf(tiny_dir: Path, export: Path, group: int | None):
    """HF float model whose quantized linears hold ``(q - weight_offset) * weight_scale`` from the export's files."""
    from transformers import AutoModelForCausalLM

    from ascent.quantization.export.calibrate import quantized_linear_names

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    tensors = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    with torch.no_grad():
        for name in quantized_linear_names(model):
            q = tensors[f"{name}.weight"].double()
            size = group or q.shape[1]
            scale = tensors[f"{name}.weight_scale"].double().repeat_interleave(size, dim=1)
            offset = tensors[f"{name}.weight_offset"].double().repeat_interleave(size, dim=1)
            model.get_submodule(name).weight.copy_(((q - offset) * scale).float())
    return model


@pytest.mark.parametrize("scheme,group", [("w4a16", 32), ("w8a16", None)])
def test_asymmetric_modelslim_export_reloads_through_the_engine(tiny_dir, tmp_path, scheme, group):
    """The export carries non-zero fp32 offsets; ``LLM(model=OUT)`` greedy tokens equal HF on the weights the
    integers, scales and offsets represent."""
    from ascent import LLM, SamplingParams
    from tests.integration.helpers import hf_greedy, random_prompts

    out = tmp_path / scheme
    args = ["quantize", str(tiny_dir), str(out), "--scheme", scheme, "--format", "modelslim", "--asymmetric"]
    assert cli_main(args + (["--group-size", str(group)] if group else [])) == 0
    tensors = load_file(str(next(out.glob("*.safetensors"))))
    offset = tensors["model.layers.0.mlp.down_proj.weight_offset"]
    assert offset.dtype == torch.float32 and bool((offset != 0).any())
    llm = LLM(model=str(out), dtype="float32", max_model_len=128, disable_log_stats=True)
    prompts = random_prompts(4, 500, 4, 12, seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(dequantized_hf(tiny_dir, out, group), prompts, 12)


def test_asymmetric_compressed_tensors_export_is_a_clear_error(tiny_dir, tmp_path, capsys):
    rc = cli_main(["quantize", str(tiny_dir), str(tmp_path / "bad"), "--scheme", "w4a16", "--asymmetric"])
    assert rc == 2 and "format='modelslim'" in capsys.readouterr().err
