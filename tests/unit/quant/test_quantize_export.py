"""``ascent quantize`` on a tiny random Qwen3: file layout, names and dtypes per specs/quantization.md §1.1 / §1.2,
integers equal to an independent float64 round-to-nearest, compressed-tensors output decompressed by
compressed-tensors' own code, ModelSlim identities, SmoothQuant exactness, and reload through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ascent.entrypoints.cli import main as cli_main
from ascent.quantization.export.calibrate import collect_input_stats, corpus_token_ids, quantized_linear_names
from ascent.quantization.export.rtn import pack_int4_pairs_along_n, pack_rows_int32
from ascent.quantization.export.smoothquant import apply_smoothquant, smooth_lm_head
from tests.fixtures.tiny_models import build_model

SCHEMES = ("w8a8", "w8a8_dynamic", "w8a16", "w4a16", "w4a8")
FORMATS = ("modelslim", "compressed-tensors")
MS_TYPES = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC", "w8a16": "W8A16", "w4a16": "W4A16",
            "w4a8": "W4A8_DYNAMIC"}
BITS = {"w8a8": 8, "w8a8_dynamic": 8, "w8a16": 8, "w4a16": 4, "w4a8": 4}
GROUP = 128
TINY = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # every K (128, 256) divisible by 128


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_model("qwen3", tmp_path_factory.mktemp("tiny_q3"), seed=3, **TINY)


@pytest.fixture(scope="module")
def float_weights(tiny_dir) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def exports(tiny_dir, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for scheme in SCHEMES:
        for fmt in FORMATS:
            target = root / f"{scheme}-{fmt}"
            rc = cli_main(["quantize", str(tiny_dir), str(target), "--scheme", scheme, "--format", fmt,
                           "--group-size", str(GROUP), "--calib-tokens", "256"])
            assert rc == 0
            out[(scheme, fmt)] = target
    return out


def linear_names(weights: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[:-len(".weight")] for k in weights if ".layers." in k and k.endswith("_proj.weight"))


def reference_rtn(w: torch.Tensor, bits: int, group: int | None, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Independent float64 RTN: scale = absmax / (2^(b-1) - 1) rounded to ``dtype``, q = rint(w / scale)."""
    qmax = 2 ** (bits - 1) - 1
    w64 = w.double()
    n, k = w64.shape
    blocks = w64.reshape(n, k // group, group) if group else w64.reshape(n, 1, k)
    scale = (blocks.abs().amax(dim=2, keepdim=True) / qmax).to(dtype)
    q = torch.clamp(torch.round(blocks / scale.double()), -qmax - 1, qmax)
    return q.reshape(n, k).to(torch.int8), scale.reshape(n, -1)


def pack_reference(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-by-bit compressed-tensors packing with Python integers (element j at bit j*bits, LSB first)."""
    rows = []
    for row in q.tolist():
        stream = 0
        for j, value in enumerate(row):
            stream |= (value + 2 ** (bits - 1)) << (j * bits)
        words = (len(row) * bits + 31) // 32
        rows.append([((stream >> (32 * i)) & 0xFFFFFFFF) for i in range(words)])
    packed = torch.tensor(rows, dtype=torch.int64)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


@pytest.mark.parametrize("bits,k", [(4, 24), (8, 12), (3, 22), (2, 9)])
def test_pack_rows_int32_matches_bitwise_reference(bits, k):
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (5, k), generator=gen, dtype=torch.int8)
    assert torch.equal(pack_rows_int32(q, bits), pack_reference(q, bits))


def test_int4_pair_packing_along_n():
    q = torch.tensor([[-8, 7, 0], [1, -1, 5], [3, -4, -8], [7, 2, -2]], dtype=torch.int8)
    packed = pack_int4_pairs_along_n(q)
    assert packed.shape == (2, 3) and packed.dtype == torch.int8
    for i in range(2):
        for j in range(3):
            byte = (int(q[2 * i, j]) & 0xF) | ((int(q[2 * i + 1, j]) & 0xF) << 4)
            assert int(packed[i, j]) & 0xFF == byte


MS_SHAPES = {  # tensor -> (dtype for an fp32 model, shape as a function of N, K, g)
    "W8A16": {"weight": (torch.int8, "NK"), "weight_scale": (torch.float32, "N1"),
              "weight_offset": (torch.float32, "N1")},
    "W8A8_DYNAMIC": {"weight": (torch.int8, "NK"), "weight_scale": (torch.float32, "N1"),
                     "weight_offset": (torch.float32, "N1")},
    "W4A16": {"weight": (torch.int8, "NK"), "weight_scale": (torch.float32, "NG"),
              "weight_offset": (torch.float32, "NG")},
    "W8A8": {"weight": (torch.int8, "NK"), "weight_scale": (torch.float32, "N1"),
             "weight_offset": (torch.float32, "N1"), "input_scale": (torch.float32, "1"),
             "input_offset": (torch.float32, "1"), "deq_scale": (torch.float32, "N"),
             "quant_bias": (torch.int32, "N")},
    "W4A8_DYNAMIC": {"weight": (torch.int8, "HK"), "weight_scale": (torch.float32, "N1"),
                     "weight_offset": (torch.float32, "N1"), "scale_bias": (torch.float32, "SB")},
}


def _shape(code: str, name: str, n: int, k: int) -> tuple[int, ...]:
    row_parallel = name.endswith(("o_proj", "down_proj"))
    return {"NK": (n, k), "N1": (n, 1), "NG": (n, k // GROUP), "1": (1,), "N": (n,), "HK": (n // 2, k),
            "SB": (n, 16) if row_parallel else (n, 1)}[code]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_modelslim_layout(exports, float_weights, scheme):
    out = exports[(scheme, "modelslim")]
    qtype = MS_TYPES[scheme]
    tensors = load_file(str(out / f"quant_model_weight_{qtype.lower()}.safetensors"))
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == qtype and "version" in desc
    assert (desc.get("group_size") == GROUP) if scheme == "w4a16" else ("group_size" not in desc)
    assert set(tensors) == set(desc) - {"model_quant_type", "version", "group_size"}
    for name in linear_names(float_weights):
        n, k = float_weights[f"{name}.weight"].shape
        for suffix, (dtype, code) in MS_SHAPES[qtype].items():
            t = tensors[f"{name}.{suffix}"]
            assert (t.dtype, tuple(t.shape)) == (dtype, _shape(code, name, n, k)), (name, suffix)
            assert desc[f"{name}.{suffix}"] == qtype
        assert not any(key.startswith(f"{name}.") and key.split(".")[-1] not in MS_SHAPES[qtype] for key in tensors)
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                "model.layers.0.input_layernorm.weight"):
        assert desc[key] == "FLOAT" and torch.equal(tensors[key], float_weights[key])
    for required in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / required).is_file()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_modelslim_integers_equal_reference_rtn(exports, float_weights, scheme):
    qtype = MS_TYPES[scheme]
    tensors = load_file(str(exports[(scheme, "modelslim")] / f"quant_model_weight_{qtype.lower()}.safetensors"))
    for name in linear_names(float_weights):
        q_ref, s_ref = reference_rtn(float_weights[f"{name}.weight"], BITS[scheme],
                                     GROUP if scheme == "w4a16" else None, torch.float32)
        stored = tensors[f"{name}.weight"]
        if qtype == "W4A8_DYNAMIC":
            assert torch.equal(stored, pack_int4_pairs_reference(q_ref))
        else:
            assert torch.equal(stored, q_ref)
        torch.testing.assert_close(tensors[f"{name}.weight_scale"].double(), s_ref.double(), rtol=1e-6, atol=0)
        assert not tensors[f"{name}.weight_offset"].any()


def pack_int4_pairs_reference(q: torch.Tensor) -> torch.Tensor:
    low = q[0::2].to(torch.int32) & 0xF
    high = q[1::2].to(torch.int32) & 0xF
    return ((low | (high << 4)).to(torch.uint8)).view(torch.int8)


@pytest.mark.parametrize("dtype,deq_dtype", [("float16", torch.int64), ("bfloat16", torch.float32),
                                             ("float32", torch.float32)])
def test_modelslim_w8a8_static_identities(tiny_dir, tmp_path, dtype, deq_dtype):
    out = tmp_path / "w8a8"
    assert cli_main(["quantize", str(tiny_dir), str(out), "--scheme", "w8a8", "--format", "modelslim",
                     "--dtype", dtype, "--calib-tokens", "300"]) == 0
    tensors = load_file(str(out / "quant_model_weight_w8a8.safetensors"))
    model_dtype = getattr(torch, dtype)
    for name in linear_names(load_file(str(tiny_dir / "model.safetensors"))):
        t = {s: tensors[f"{name}.{s}"] for s in ("weight", "weight_scale", "input_scale", "input_offset",
                                                  "deq_scale", "quant_bias")}
        assert t["input_scale"].dtype == model_dtype and t["weight_scale"].dtype == model_dtype
        assert t["deq_scale"].dtype == deq_dtype
        expected = t["input_scale"].float() * t["weight_scale"].float().reshape(-1)
        if deq_dtype == torch.int64:
            low32 = (t["deq_scale"] & 0xFFFFFFFF).to(torch.int64)
            assert torch.equal(low32, expected.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)
            deq = low32.to(torch.int32).view(torch.float32)
        else:
            assert torch.equal(t["deq_scale"], expected)
            deq = t["deq_scale"]
        z = float(t["input_offset"])
        assert z == round(z) and -128 <= z <= 127
        row_sum = t["weight"].to(torch.int64).sum(dim=1).double()
        assert torch.equal(t["quant_bias"], torch.round(0.0 / deq.double() - z * row_sum).to(torch.int32))


def test_modelslim_w8a8_static_range_maps_to_int8(tiny_dir, exports):
    """input_scale / input_offset map the calibrated [min, max] (widened to include 0) onto [-128, 127]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    tokens = corpus_token_ids(AutoTokenizer.from_pretrained(str(tiny_dir)), 256)
    lows, highs = {}, {}

    def record(name: str, x: torch.Tensor) -> None:
        lows[name] = min(lows.get(name, 0.0), float(x.min()))
        highs[name] = max(highs.get(name, 0.0), float(x.max()))

    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: record(n, a[0]))
             for n in quantized_linear_names(model)]
    with torch.no_grad():
        for start in range(0, len(tokens), 512):
            model(input_ids=torch.tensor([tokens[start:start + 512]]))
    for h in hooks:
        h.remove()
    tensors = load_file(str(exports[("w8a8", "modelslim")] / "quant_model_weight_w8a8.safetensors"))
    for name in lows:
        s, z = float(tensors[f"{name}.input_scale"]), float(tensors[f"{name}.input_offset"])
        assert s == pytest.approx((highs[name] - lows[name]) / 255, rel=1e-6)
        assert round(lows[name] / s + z) == -128 and round(highs[name] / s + z) in (126, 127, 128)


def test_modelslim_w4a8_scale_bias(exports, float_weights):
    tensors = load_file(str(exports[("w4a8", "modelslim")] / "quant_model_weight_w4a8_dynamic.safetensors"))
    for name in linear_names(float_weights):
        q, s = reference_rtn(float_weights[f"{name}.weight"], 4, None, torch.float32)
        n, k = q.shape
        chunks = 16 if name.endswith(("o_proj", "down_proj")) else 1
        expected = 8.0 * q.double().reshape(n, chunks, k // chunks).sum(dim=2) * s.double()
        torch.testing.assert_close(tensors[f"{name}.scale_bias"].double(), expected, rtol=1e-6, atol=1e-6)


def test_group_size_must_divide_k(tiny_dir, tmp_path, capsys):
    rc = cli_main(["quantize", str(tiny_dir), str(tmp_path / "bad"), "--scheme", "w4a16", "--group-size", "96"])
    err = capsys.readouterr().err
    assert rc == 2 and "group_size=96" in err and "K=128" in err and "model.layers.0.self_attn.q_proj" in err


def test_smoothquant_preserves_float_function(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    smoothed = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    tokens = corpus_token_ids(AutoTokenizer.from_pretrained(str(tiny_dir)), 200)
    stats = collect_input_stats(smoothed, tokens)
    new_stats = apply_smoothquant(smoothed, stats, alpha=0.5)
    layer = smoothed.model.layers[0]
    assert not torch.equal(layer.input_layernorm.weight, original.model.layers[0].input_layernorm.weight)
    assert not torch.equal(layer.mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(layer.self_attn.v_proj.weight, original.model.layers[0].self_attn.v_proj.weight)
    ids = torch.tensor([tokens[-64:]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)
    check = collect_input_stats(smoothed, tokens)  # the predicted post-smoothing statistics are exact
    for name, st in check.items():
        torch.testing.assert_close(new_stats[name].max, st.max, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(new_stats[name].min, st.min, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_smoothquant_of_the_lm_head_preserves_float_function(tiny_dir, tied):
    """The head's factors fold into the final norm; a tied head is untied first (the embedding keeps its values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load():
        model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()  # untied
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    original, smoothed = load(), load()
    assert (smoothed.lm_head.weight.data_ptr() == smoothed.model.embed_tokens.weight.data_ptr()) is tied
    tokens = corpus_token_ids(AutoTokenizer.from_pretrained(str(tiny_dir)), 200)
    stats = collect_input_stats(smoothed, tokens, quantized_linear_names(smoothed, include_lm_head=True))
    new_stats = smooth_lm_head(smoothed, "lm_head", stats, alpha=0.5)
    assert smoothed.lm_head.weight.data_ptr() != smoothed.model.embed_tokens.weight.data_ptr()
    assert torch.equal(smoothed.model.embed_tokens.weight, original.model.embed_tokens.weight)
    assert not torch.equal(smoothed.model.norm.weight, original.model.norm.weight)
    ids = torch.tensor([tokens[-64:]])
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)
    check = collect_input_stats(smoothed, tokens, ["lm_head"])
    torch.testing.assert_close(new_stats["lm_head"].max, check["lm_head"].max, rtol=1e-4, atol=1e-5)


def test_compressed_tensors_config_is_what_compressed_tensors_writes(exports):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    for scheme in SCHEMES:
        qc = json.loads((exports[(scheme, "compressed-tensors")] / "config.json").read_text())["quantization_config"]
        fmt = "pack-quantized" if scheme in ("w8a16", "w4a16") else "int-quantized"
        weights = (QuantizationArgs(num_bits=4, strategy="group", group_size=GROUP) if scheme == "w4a16"
                   else QuantizationArgs(num_bits=BITS[scheme], strategy="channel"))
        acts = {"w8a8": QuantizationArgs(num_bits=8, strategy="tensor"),
                "w8a8_dynamic": QuantizationArgs(num_bits=8, strategy="token", dynamic=True),
                "w4a8": QuantizationArgs(num_bits=8, strategy="token", dynamic=True)}.get(scheme)
        expected = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                         input_activations=acts, format=fmt)},
            ignore=["lm_head"], format=fmt, quantization_status="compressed")
        dumped = expected.model_dump(exclude=["quant_method"])
        assert {k: v for k, v in qc.items() if k in dumped} == json.loads(json.dumps(dumped))
        assert set(qc) - set(dumped) == {"quant_method", "version", "sparsity_config", "transform_config"}
        assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
        QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in ("version", "sparsity_config",
                                                                                    "transform_config")})


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_layout(exports, float_weights, scheme):
    tensors = load_file(str(exports[(scheme, "compressed-tensors")] / "model.safetensors"))
    for name in linear_names(float_weights):
        n, k = float_weights[f"{name}.weight"].shape
        expected = ({"weight_packed": (torch.int32, (n, k * BITS[scheme] // 32)),
                     "weight_scale": (torch.float32, (n, k // GROUP if scheme == "w4a16" else 1)),
                     "weight_shape": (torch.int64, (2,))} if scheme in ("w8a16", "w4a16")
                    else {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float32, (n, 1))})
        if scheme == "w8a8":
            expected["input_scale"] = (torch.float32, (1,))
        got = {key[len(name) + 1:]: (t.dtype, tuple(t.shape)) for key, t in tensors.items()
               if key.startswith(f"{name}.")}
        assert got == expected, name
        if "weight_shape" in got:
            assert tensors[f"{name}.weight_shape"].tolist() == [n, k]
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_decompress_equals_reference_rtn(exports, float_weights, scheme):
    """transformers + compressed-tensors (``run_compressed=False`` -> ModelCompressor.decompress_model) give the
    float weights; they equal the independent RTN (integers exact, scales rtol 1e-6)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(exports[(scheme, "compressed-tensors")]), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    for name in linear_names(float_weights):
        group = GROUP if scheme == "w4a16" else None
        q_ref, s_ref = reference_rtn(float_weights[f"{name}.weight"], BITS[scheme], group, torch.float32)
        scale = s_ref.double().repeat_interleave(group or q_ref.shape[1], dim=1)
        weight = model.get_submodule(name).weight.detach().double()
        assert torch.equal(torch.round(weight / scale).to(torch.int8), q_ref), name
        torch.testing.assert_close(weight, q_ref.double() * scale, rtol=1e-6, atol=0)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(model.state_dict()[key], float_weights[key])


def _fake_quant_input(x: torch.Tensor, scale: torch.Tensor | None, offset: float) -> torch.Tensor:
    """int8 fake quantization of a linear input: per-token dynamic (``scale`` None) or static per-tensor."""
    x64 = x.double()
    if scale is None:
        s = (x64.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-12)
        return (torch.clamp(torch.round(x64 / s), -128, 127) * s).to(x.dtype)
    s = float(scale)
    return ((torch.clamp(torch.round(x64 / s + offset), -128, 127) - offset) * s).to(x.dtype)


def fake_quant_hf(tiny_dir: Path, scheme: str, export: Path, fmt: str):
    """HF float model whose quantized linears hold the reference-RTN dequantized weights and, for W8A8 schemes,
    fake-quantize their inputs (per token, or with the exported static scale / offset)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    group = GROUP if scheme == "w4a16" else None
    files = sorted(export.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    with torch.no_grad():
        for name in quantized_linear_names(model):
            linear = model.get_submodule(name)
            q, s = reference_rtn(linear.weight, BITS[scheme], group, torch.float32)
            linear.weight.copy_((q.double() * s.double().repeat_interleave(group or q.shape[1], dim=1)).float())
            if scheme in ("w8a8_dynamic", "w4a8"):
                linear.register_forward_pre_hook(lambda _m, a: (_fake_quant_input(a[0], None, 0.0),))
            elif scheme == "w8a8":
                offset = float(tensors[f"{name}.input_offset"]) if fmt == "modelslim" else 0.0
                scale = tensors[f"{name}.input_scale"]
                linear.register_forward_pre_hook(lambda _m, a, sc=scale, z=offset: (_fake_quant_input(a[0], sc, z),))
    return model


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over prompts of (common-prefix length / length): positions after a divergence count as misses."""
    total = 0.0
    for x, y in zip(a, b):
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        total += same / max(len(x), 1)
    return total / len(a)


# Greedy prefix agreement measured on this tiny random model against the fake-quant reference: 1.0 for every scheme
# and format (against the unquantized float model only 0.34-0.58 for 8-bit and 0.0 for 4-bit: a random model's
# logits are nearly tied, so the reference must carry the same quantization).
RELOAD_FLOOR = {"w8a8": 0.9, "w8a8_dynamic": 0.9, "w8a16": 0.9, "w4a16": 0.75, "w4a8": 0.75}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_reload_through_engine_matches_fake_quant_reference(exports, tiny_dir, scheme, fmt):
    """``LLM(model=OUT)`` auto-detects the format; greedy tokens agree with HF on the dequantized weights."""
    from ascent import LLM, SamplingParams
    from tests.integration.helpers import hf_greedy, random_prompts

    llm = LLM(model=str(exports[(scheme, fmt)]), dtype="float32", max_model_len=128, disable_log_stats=True,
              quantization=None)
    prompts = random_prompts(4, 500, 4, 12, seed=7)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    reference = hf_greedy(fake_quant_hf(tiny_dir, scheme, exports[(scheme, fmt)], fmt), prompts, 16)
    assert prefix_agreement(ours, reference) >= RELOAD_FLOOR[scheme]


def test_smoothquant_export_folds_into_norm(tiny_dir, float_weights, tmp_path):
    """With --smoothquant the exported norm weight and the dequantized q_proj keep W[:, j] * norm[j] invariant."""
    out = tmp_path / "sq"
    assert cli_main(["quantize", str(tiny_dir), str(out), "--scheme", "w8a8", "--format", "modelslim",
                     "--smoothquant", "0.5", "--calib-tokens", "256"]) == 0
    tensors = load_file(str(out / "quant_model_weight_w8a8.safetensors"))
    norm = tensors["model.layers.0.input_layernorm.weight"].double()
    original_norm = float_weights["model.layers.0.input_layernorm.weight"].double()
    assert not torch.allclose(norm, original_norm)
    for proj in ("q_proj", "k_proj"):  # v_proj rows also carry o_proj's factors
        name = f"model.layers.0.self_attn.{proj}"
        scale = tensors[f"{name}.weight_scale"].double()
        dequant = tensors[f"{name}.weight"].double() * scale
        expected = float_weights[f"{name}.weight"].double() * original_norm[None, :]
        error = (dequant * norm[None, :] - expected).abs()
        assert bool((error <= 0.5 * scale * norm.abs()[None, :] * (1 + 1e-5) + 1e-6).all()), proj


def test_bench_quant_smoke(tiny_dir, tmp_path):
    """``ascent bench quant`` at tiny size: schema, ratios against bf16 and finite perplexities."""
    out_json = tmp_path / "quant.json"
    rc = cli_main(["bench", "quant", "--model", str(tiny_dir), "--schemes", "w8a8_dynamic,w4a16",
                   "--batch-sizes", "1,2", "--decode-tokens", "4", "--rounds", "2", "--ppl-tokens", "128",
                   "--ppl-window", "64", "--kv-cache-memory-bytes", "16M", "--output-json", str(out_json)])
    assert rc == 0
    result = json.loads(out_json.read_text())
    assert result["benchmark"] == "quant" and set(result["variants"]) == {"bf16", "w8a8_dynamic", "w4a16"}
    assert result["config"]["group_size"] == 128 and isinstance(result["cpu"]["flags"], list)
    assert result["cpu"]["torch_cpu_capability"] and len(result["env"]["loadavg"]) == 3
    base = result["variants"]["bf16"]
    assert base["tokens_per_second_ratio_vs_bf16"] == {"1": 1.0, "2": 1.0} and base["ppl_increase_pct"] == 0.0
    for name, entry in result["variants"].items():
        assert entry["error"] is None, (name, entry["error"])
        for batch in ("1", "2"):
            decode = entry["decode"][batch]
            assert decode["decode_tokens_per_second"] > 0 and len(decode["all_rounds"]) == 2
        ppl = entry["perplexity"]
        assert ppl["scored_tokens"] == 2 * 63 and 1.0 < ppl["perplexity"] < 1e6
        assert entry["tokens_per_second_ratio_vs_bf16"]["1"] > 0
        per_round = entry["tokens_per_second_ratio_per_round"]["1"]
        rounds = [r["decode_tokens_per_second"] / b["decode_tokens_per_second"]
                  for r, b in zip(entry["decode"]["1"]["all_rounds"], base["decode"]["1"]["all_rounds"])]
        assert per_round["rounds"] == pytest.approx(rounds) and per_round["median"] == pytest.approx(
            sorted(rounds)[0] / 2 + sorted(rounds)[1] / 2)  # two rounds: the median is their mean
    w4 = result["variants"]["w4a16"]
    assert w4["checkpoint_bytes"] < result["variants"]["w8a8_dynamic"]["checkpoint_bytes"]
