"""``ascent quantize --quantize-lm-head`` on a tiny random tied Llama: the checkpoint is untied (float
``embed_tokens``, integer ``lm_head`` equal to an independent RTN), the compressed-tensors ``ignore`` list / ModelSlim
description say so, and the engine loads the lm_head through the scheme (``quant_method`` set) with logits close to a
fake-quantized HF reference. Without the flag nothing changes (tied, float head). ``ascent bench quant`` keeps float-
and quantized-head exports in separate cache folders and records the flag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ascent.entrypoints.cli import main as cli_main
from tests.fixtures.tiny_models import build_model
from tests.integration.helpers import hf_greedy, random_prompts

TINY = dict(tie_word_embeddings=True, hidden_size=128, intermediate_size=256, head_dim=32)
GROUP = 32
CASES = [("w8a16", "modelslim"), ("w4a16", "compressed-tensors"), ("w8a8_dynamic", "compressed-tensors")]
BITS = {"w8a16": 8, "w4a16": 4, "w8a8_dynamic": 8, "w8a8": 8}
MS_TYPES = {"w8a16": "W8A16", "w4a16": "W4A16", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a8": "W8A8"}
VOCAB = 512
# Measured on this model (bf16 engine vs float32 HF with the same fake quantization, lm_head included), 4 prompts x 12
# tokens: teacher-forced top-1 agreement 1.0 / 1.0 / 0.96 and max |logprob difference| of the reference tokens
# 0.034 / 0.027 / 0.069 (w8a16 modelslim / w4a16 ct / w8a8_dynamic ct); the bounds leave room for bf16 rounding on a
# random model whose logits are nearly tied.
AGREEMENT_FLOOR = 0.85
LOGPROB_ATOL = 0.15


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _export(src: Path, out: Path, scheme: str, fmt: str, head: bool) -> Path:
    argv = ["quantize", str(src), str(out), "--scheme", scheme, "--format", fmt, "--group-size", str(GROUP),
            "--calib-tokens", "256"]
    assert cli_main(argv + (["--quantize-lm-head"] if head else [])) == 0
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_model("llama", tmp_path_factory.mktemp("tiny_tied_llama"), seed=5, **TINY)


@pytest.fixture(scope="module")
def embed(tiny_dir) -> torch.Tensor:
    weights = load_file(str(tiny_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights  # the source really is tied
    return weights["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def exports(tiny_dir, tmp_path_factory) -> dict[tuple[str, str, bool], Path]:
    root = tmp_path_factory.mktemp("lm_head_exports")
    return {(s, f, h): _export(tiny_dir, root / f"{s}-{f}-{h}", s, f, h) for s, f in CASES for h in (True, False)}


def reference_rtn(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent float64 symmetric RTN: (int8 q [N, K], float32 scale [N, K / group or 1])."""
    qmax = 2 ** (bits - 1) - 1
    n, k = w.shape
    blocks = w.double().reshape(n, k // group, group) if group else w.double().reshape(n, 1, k)
    scale = (blocks.abs().amax(dim=2, keepdim=True) / qmax).float()
    q = torch.clamp(torch.round(blocks / scale.double()), -qmax - 1, qmax)
    return q.reshape(n, k).to(torch.int8), scale.reshape(n, -1)


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """compressed-tensors pack-quantized rows (LSB first, offset 2^(bits-1)) -> int8 [N, k]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return (values.reshape(packed.shape[0], -1)[:, :k] - 2 ** (bits - 1)).to(torch.int8)


def exported_head_ints(tensors: dict[str, torch.Tensor], fmt: str, bits: int, k: int) -> torch.Tensor:
    if fmt == "modelslim":
        return tensors["lm_head.weight"]
    if "lm_head.weight_packed" in tensors:
        return unpack_int32(tensors["lm_head.weight_packed"], bits, k)
    return tensors["lm_head.weight"]


@pytest.mark.parametrize("scheme,fmt", CASES)
def test_checkpoint_is_untied_with_integer_lm_head(exports, embed, scheme, fmt):
    out = exports[(scheme, fmt, True)]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    tensors = _tensors(out)
    assert torch.equal(tensors["model.embed_tokens.weight"], embed)
    head = {k: v for k, v in tensors.items() if k.startswith("lm_head.")}
    group = GROUP if scheme == "w4a16" else None
    q_ref, s_ref = reference_rtn(embed, BITS[scheme], group)
    if fmt == "compressed-tensors":
        assert config["quantization_config"]["ignore"] == []
        weight_key = "lm_head.weight_packed" if scheme in ("w8a16", "w4a16") else "lm_head.weight"
        assert head[weight_key].dtype == (torch.int32 if weight_key.endswith("packed") else torch.int8)
    else:
        description = json.loads((out / "quant_model_description.json").read_text())
        assert description["lm_head.weight"] == MS_TYPES[scheme]
        assert description["model.embed_tokens.weight"] == "FLOAT"
        assert head["lm_head.weight"].dtype == torch.int8
    assert not any(v.is_floating_point() and k.endswith(".weight") for k, v in head.items())
    assert torch.equal(exported_head_ints(tensors, fmt, BITS[scheme], embed.shape[1]), q_ref)
    torch.testing.assert_close(head["lm_head.weight_scale"].float(), s_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme,fmt", CASES)
def test_without_flag_head_stays_tied_and_float(exports, scheme, fmt):
    out = exports[(scheme, fmt, False)]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    tensors = _tensors(out)
    assert not any(k.startswith("lm_head.") for k in tensors) and "model.embed_tokens.weight" in tensors
    if fmt == "compressed-tensors":
        assert config["quantization_config"]["ignore"] == ["lm_head"]
    else:
        description = json.loads((out / "quant_model_description.json").read_text())
        assert not any(k.startswith("lm_head.") for k in description)


@pytest.mark.parametrize("fmt", ["modelslim", "compressed-tensors"])
def test_static_w8a8_calibrates_lm_head(tiny_dir, tmp_path, fmt):
    """Static activation scales need lm_head input statistics: the activation parameters are written for it."""
    tensors = _tensors(_export(tiny_dir, tmp_path / fmt, "w8a8", fmt, True))
    keys = ("input_scale", "input_offset", "deq_scale", "quant_bias") if fmt == "modelslim" else ("input_scale",)
    for key in keys:
        assert f"lm_head.{key}" in tensors, key
    assert float(tensors["lm_head.input_scale"]) > 0


def _fake_quant_dynamic(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    s = (x64.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.clamp(torch.round(x64 / s), -128, 127) * s).to(x.dtype)


def fake_quant_hf(tiny_dir: Path, scheme: str):
    """HF float32 model whose decoder linears and (untied) lm_head hold reference-RTN dequantized weights; W8A8
    dynamic fake-quantizes their inputs per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    group = GROUP if scheme == "w4a16" else None
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
        names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert "lm_head" in names
        for name in names:
            linear = model.get_submodule(name)
            q, s = reference_rtn(linear.weight, BITS[scheme], group)
            linear.weight.copy_((q.double() * s.double().repeat_interleave(group or q.shape[1], dim=1)).float())
            if scheme == "w8a8_dynamic":
                linear.register_forward_pre_hook(lambda _m, a: (_fake_quant_dynamic(a[0]),))
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


def _runner_model(llm):
    return llm.llm_engine.engine_core.worker.model_runner.model


@pytest.mark.parametrize("scheme,fmt", CASES)
def test_engine_loads_quantized_lm_head(exports, tiny_dir, scheme, fmt):
    """bf16 engine: lm_head runs the scheme; its prompt logprobs of the fake-quant reference's greedy tokens are
    close to the reference's and the reference tokens are mostly the engine's top-1."""
    from ascent import LLM, SamplingParams

    llm = LLM(model=str(exports[(scheme, fmt, True)]), dtype="bfloat16", max_model_len=128, disable_log_stats=True)
    model = _runner_model(llm)
    assert model.lm_head.quant_method is not None
    assert model.model.embed_tokens.quant_method is None
    assert getattr(model.lm_head, "weight", None) is not model.model.embed_tokens.weight
    reference = fake_quant_hf(tiny_dir, scheme)
    prompts = random_prompts(4, VOCAB, 4, 12, seed=11)
    answers = hf_greedy(reference, prompts, 12)
    results = llm.generate([{"prompt_token_ids": p + a} for p, a in zip(prompts, answers)],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    hits = total = 0
    worst = 0.0
    for result, prompt, answer in zip(results, prompts, answers):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + answer])).logits[0].double()
        ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
        for pos, (token, entry) in enumerate(zip(answer, result.prompt_logprobs[len(prompt):])):
            total += 1
            hits += int(entry[token].rank == 1)
            worst = max(worst, abs(entry[token].logprob - float(ref[pos, token])))
    assert hits / total >= AGREEMENT_FLOOR, (hits, total)
    assert worst <= LOGPROB_ATOL, worst


def test_engine_without_flag_keeps_float_head(exports):
    from ascent import LLM

    llm = LLM(model=str(exports[("w8a8_dynamic", "compressed-tensors", False)]), dtype="bfloat16",
              max_model_len=128, disable_log_stats=True)
    model = _runner_model(llm)
    assert model.lm_head.quant_method is None


def test_bench_quant_cache_separates_head_modes(tiny_dir, tmp_path):
    """Float-head and quantized-head exports land in different cache folders; the JSON records the flag."""
    from ascent.benchmarks.quant import export_dir_name, export_schemes

    assert export_dir_name("w8a16", "modelslim", True) != export_dir_name("w8a16", "modelslim", False)
    names = {export_dir_name("w8a8", "modelslim", False, group, alpha, calib)
             for group, alpha, calib in [(None, None, 512), (64, None, 512), (None, 0.5, 512), (None, 0.8, 512),
                                         (None, 0.5, 256)]}
    assert len(names) == 5  # group size and SmoothQuant settings each get their own folder
    cache = tmp_path / "cache"
    for head in (False, True):
        args = argparse.Namespace(schemes=["w8a16"], format="compressed-tensors", model=str(tiny_dir),
                                  group_size=None, smoothquant=None, calib_tokens=256, quantize_lm_head=head)
        record = export_schemes(args, cache)["w8a16"]
        assert record["error"] is None, record
        config = json.loads((Path(record["path"]) / "config.json").read_text())
        assert config["tie_word_embeddings"] is (not head)
    assert len(list(cache.iterdir())) == 2
    out_json = tmp_path / "quant.json"
    rc = cli_main(["bench", "quant", "--model", str(tiny_dir), "--schemes", "w8a16", "--batch-sizes", "1",
                   "--decode-tokens", "2", "--rounds", "1", "--ppl-tokens", "0", "--ppl-window", "64",
                   "--kv-cache-memory-bytes", "16M",
                   "--quantize-lm-head", "--cache-dir", str(cache), "--output-json", str(out_json)])
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["config"]["quantize_lm_head"] is True
    assert result["variants"]["w8a16"]["error"] is None
    assert result["variants"]["w8a16"]["path"].endswith(export_dir_name("w8a16", "compressed-tensors", True))
