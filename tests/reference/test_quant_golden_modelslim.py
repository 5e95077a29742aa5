"""Golden ModelSlim checkpoints (made by msmodelslim 26.1's PTQ tools on CPU, ``tests/fixtures/quant/modelslim_*``)
loaded by ascent.

The reference is the published ModelSlim dequant math, written out here and applied to the checkpoint tensors
read with ``safetensors``:

* weights (all types): ``W = (Wq - weight_offset) * weight_scale`` (per output channel);
* W8A8 (static): ``xq = clamp(rint(x / input_scale + input_offset), -128, 127)``,
  ``y = ((xq - input_offset) * input_scale) @ W^T + bias``; ``deq_scale`` (int64 holding the fp32 bits for fp16
  models, plain fp32 for bf16 models) and ``quant_bias`` are checked against their definitions
  (``deq_scale = input_scale * weight_scale``, ``quant_bias = rint(bias / deq_scale - input_offset * sum_k Wq)``);
* W8A8_DYNAMIC: per token ``s = amax / 127``, ``xq = rint(x / s)``, ``y = (xq * s) @ W^T``;
* W8A16: weight-only.
* Anti-outlier (msmodelslim ``anti_method="m4"``): RMSNorms carry a FLOAT ``<norm>.bias`` added after the norm, and
  the shifted linears a FLOAT ``bias`` (folded into ``quant_bias`` by the tool).

End to end, an HF transformers Qwen3 built from the fixture's config gets the FLOAT tensors, the dequantized weights,
the biases and activation fake-quant pre-hooks; ascent (fp32) must match its prompt logprobs.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.reference.quant_golden_common import (
    FIXTURES,
    add_input_quant,
    add_output_bias,
    ascent_linear_slices,
    ascent_logprobs,
    build_float_source,
    hf_logprobs,
    int8_per_token,
    int8_static,
    llm_prompt_logprobs,
    load_ascent,
    max_logprob_diff,
    prompt_ids,
    rel_err,
    scheme_of,
    set_linear,
)

NAMES = ["modelslim_w8a8_fp16", "modelslim_w8a8_bf16", "modelslim_w8a8_dynamic", "modelslim_w8a16",
         "modelslim_w8a8_smooth"]
STATIC = ["modelslim_w8a8_fp16", "modelslim_w8a8_bf16", "modelslim_w8a8_smooth"]
TYPES = {"modelslim_w8a8_fp16": "W8A8", "modelslim_w8a8_bf16": "W8A8", "modelslim_w8a8_smooth": "W8A8",
         "modelslim_w8a8_dynamic": "W8A8_DYNAMIC", "modelslim_w8a16": "W8A16"}
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
NORMS = ["input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"]

# (c) bounds on max |logprob difference| over all prompt positions.
E2E_TOL = {"W8A8": 0.2, "W8A8_DYNAMIC": 1e-2, "W8A16": 1e-4}  # vs the dequant-formula reference
INTEGER_TOL = 1e-4  # static W8A8 vs its stored deq_scale/quant_bias integer pipeline
FLOAT_TOL = {"modelslim_w8a8_fp16": 0.5, "modelslim_w8a8_bf16": 0.5, "modelslim_w8a8_smooth": 1.0,
             "modelslim_w8a8_dynamic": 0.25, "modelslim_w8a16": 0.1}


@lru_cache(maxsize=None)
def _state(name: str) -> dict[str, torch.Tensor]:
    files = sorted((FIXTURES / name).glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(str(files[0]))


@lru_cache(maxsize=None)
def _description(name: str) -> dict:
    return json.loads((FIXTURES / name / "quant_model_description.json").read_text())


def _hf_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(FIXTURES / name))


def reference_weight(name: str, prefix: str) -> torch.Tensor:
    sd = _state(name)
    wq = sd[f"{prefix}.weight"]
    assert wq.dtype == torch.int8
    return (wq.float() - sd[f"{prefix}.weight_offset"].float()) * sd[f"{prefix}.weight_scale"].float()


def linear_bias(name: str, prefix: str) -> torch.Tensor | None:
    b = _state(name).get(f"{prefix}.bias")
    return None if b is None else b.float()


def act_quant(name: str, prefix: str):
    qtype = TYPES[name]
    if qtype == "W8A8":
        sd = _state(name)
        return int8_static(float(sd[f"{prefix}.input_scale"].float()), float(sd[f"{prefix}.input_offset"].float()))
    if qtype == "W8A8_DYNAMIC":
        return int8_per_token
    return None


def decode_deq_scale(t: torch.Tensor) -> torch.Tensor:
    """ModelSlim's deq_scale: int64 whose low 32 bits are an fp32 bit pattern (fp16 models) or plain fp32."""
    if t.dtype == torch.int64:
        assert int(t.min()) >= 0 and int(t.max()) < 2 ** 32
        return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    assert t.dtype == torch.float32
    return t


def prefixes(config) -> list[str]:
    return [f"model.layers.{i}.{ln}" for i in range(config.num_hidden_layers) for ln in LINEARS]


@lru_cache(maxsize=None)
def ascent_model(name: str):
    return load_ascent(FIXTURES / name)


@pytest.fixture(scope="module")
def float_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_float_source(tmp_path_factory.mktemp("modelslim_float_source") / "dense")


# ------------------------------------------------------------------------------------------------------------------
# checkpoint-level checks (no ascent)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_description_and_tensor_dtypes(name: str) -> None:
    desc, sd, config = _description(name), _state(name), _hf_config(name)
    assert desc["model_quant_type"] == TYPES[name]
    model_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[config.dtype if isinstance(config.dtype, str)
                                                                         else str(config.dtype).split(".")[-1]]
    for prefix in prefixes(config):
        assert desc[f"{prefix}.weight"] == TYPES[name]
        assert sd[f"{prefix}.weight"].dtype == torch.int8
        assert sd[f"{prefix}.weight_scale"].dtype == model_dtype
        assert float(sd[f"{prefix}.weight_offset"].abs().max()) == 0.0  # msmodelslim's default: symmetric weights
        if TYPES[name] == "W8A8":
            # the int64 deq-scale encoding is for fp16 models; bf16 models store fp32 (vLLM Ascend reads both)
            assert sd[f"{prefix}.deq_scale"].dtype == (torch.int64 if model_dtype == torch.float16 else torch.float32)
            assert sd[f"{prefix}.quant_bias"].dtype == torch.int32
        else:
            assert f"{prefix}.deq_scale" not in sd and f"{prefix}.input_scale" not in sd
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert desc[key] == "FLOAT"
    if name == "modelslim_w8a8_smooth":
        biases = [k for k in sd if k.endswith("norm.bias") and ".module." not in k]
        assert desc["model.layers.0.input_layernorm.bias"] == "FLOAT"
        assert any(float(sd[k].abs().max()) > 1e-3 for k in biases), "anti-outlier produced no norm bias"
        assert "model.layers.0.input_layernorm.module.weight" in sd  # legacy duplicate keys are present


@pytest.mark.parametrize("name", STATIC)
def test_deq_scale_and_quant_bias_identities(name: str) -> None:
    sd, config = _state(name), _hf_config(name)
    for prefix in prefixes(config):
        s_x, z_x = sd[f"{prefix}.input_scale"], sd[f"{prefix}.input_offset"].float()
        s_w = sd[f"{prefix}.weight_scale"]
        d = decode_deq_scale(sd[f"{prefix}.deq_scale"])
        # msmodelslim multiplies in the model dtype (fp16 products of small scales can be subnormal, so this is not
        # the fp32 product), then widens to fp32: bit-exact
        torch.testing.assert_close(d, (s_x * s_w).reshape(-1).float(), rtol=0, atol=0)
        wsum = sd[f"{prefix}.weight"].float().sum(dim=1)
        b = linear_bias(name, prefix)
        expected = torch.round((b if b is not None else 0.0) / d - z_x * wsum)
        diff = (sd[f"{prefix}.quant_bias"].float() - expected).abs()
        assert float(diff.max()) <= 1.0, (prefix, float(diff.max()))  # ±1 for the fp16-rounded bias
        assert float((diff > 0).float().mean()) <= 0.05, prefix


# ------------------------------------------------------------------------------------------------------------------
# (a) dequantized weights, (b) layer outputs
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_dequantized_weights_match(name: str) -> None:
    config = _hf_config(name)
    model = ascent_model(name)
    for i in range(config.num_hidden_layers):
        for hf_name, (layer, rows) in ascent_linear_slices(model, i, config).items():
            prefix = f"model.layers.{i}.{hf_name}"
            scheme = scheme_of(layer)
            assert scheme.spec.quant_type == TYPES[name]
            ours = scheme.dequantized_weight(layer)
            assert ours.dtype == torch.float32
            torch.testing.assert_close(ours[rows], reference_weight(name, prefix), rtol=1e-6, atol=0,
                                       msg=lambda m: f"{name} {prefix}: {m}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_layer_outputs_match_reference(name: str, tokens: int) -> None:
    """Fast path on random activations vs the dequant formula per shard (relative to max |y|): 1e-2 with activation
    quantization (one-LSB flips at rounding ties; deq_scale carries the model-dtype rounding of s_x*s_w), 1e-3
    weight-only."""
    config = _hf_config(name)
    model = ascent_model(name)
    gen = torch.Generator().manual_seed(100 + tokens)
    tol = 1e-3 if TYPES[name] == "W8A16" else 1e-2
    for i in range(config.num_hidden_layers):
        groups: dict[int, tuple[torch.nn.Module, list[tuple[str, slice]]]] = {}
        for hf_name, (layer, rows) in ascent_linear_slices(model, i, config).items():
            groups.setdefault(id(layer), (layer, []))[1].append((hf_name, rows))
        for layer, shards in groups.values():
            k = reference_weight(name, f"model.layers.{i}.{shards[0][0]}").shape[1]
            x = torch.randn(tokens, k, generator=gen)
            with torch.no_grad():
                y = layer(x)
            assert y.dtype == torch.float32 and y.shape[0] == tokens
            for hf_name, rows in shards:
                prefix = f"model.layers.{i}.{hf_name}"
                fn = act_quant(name, prefix)
                ref = (fn(x) if fn is not None else x) @ reference_weight(name, prefix).t()
                b = linear_bias(name, prefix)
                if b is not None:
                    ref = ref + b
                err = rel_err(y[:, rows], ref)
                assert err <= tol, (name, prefix, tokens, err)
            yr = scheme_of(layer).apply_reference(layer, x, getattr(layer, "bias", None))
            assert rel_err(yr, y) <= tol, (name, i, tokens)


# ------------------------------------------------------------------------------------------------------------------
# (c) end to end
# ------------------------------------------------------------------------------------------------------------------
def integer_pipeline(name: str, prefix: str):
    """The static W8A8 checkpoint's own integer pipeline (what vLLM Ascend's ``npu_quant_matmul`` computes):
    ``y = deq_scale * (xq @ Wq^T + quant_bias)`` with the stored deq_scale/quant_bias (quant_bias already holds the
    activation-offset correction and the float bias)."""
    sd = _state(name)
    s_x = float(sd[f"{prefix}.input_scale"].float())
    z_x = float(sd[f"{prefix}.input_offset"].float())
    wq = sd[f"{prefix}.weight"].double()
    d = decode_deq_scale(sd[f"{prefix}.deq_scale"]).double()
    beta = sd[f"{prefix}.quant_bias"].double()

    def fn(x: torch.Tensor) -> torch.Tensor:
        xq = torch.round(x.float() / s_x + z_x).clamp(-128, 127).double()
        return (d * (xq @ wq.t() + beta)).to(x.dtype)

    return fn


def hf_reference_model(name: str, pipeline: str = "dequant"):
    """HF Qwen3 from the fixture config with FLOAT tensors, dequantized weights, biases and activation fake-quant.
    ``pipeline="integer"`` (static W8A8 only) replaces each quantized linear by :func:`integer_pipeline`."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sd, desc = _state(name), _description(name)
    params = dict(hf.named_parameters())
    done = set()
    for key, qtype in desc.items():
        if qtype == "FLOAT" and key in params:
            with torch.no_grad():
                params[key].copy_(sd[key].float())
            done.add(key)
    for prefix in prefixes(config):
        lin = hf.get_submodule(prefix)
        set_linear(lin, reference_weight(name, prefix), linear_bias(name, prefix))
        done.add(prefix + ".weight")
        if pipeline == "integer":
            fn = integer_pipeline(name, prefix)
            lin.register_forward_hook(lambda mod, args, out, fn=fn: fn(args[0]))
            continue
        fn = act_quant(name, prefix)
        if fn is not None:
            add_input_quant(lin, fn)
    assert set(params) == done, sorted(set(params) - done)
    norm_biases = [k for k, t in desc.items() if t == "FLOAT" and k.endswith("norm.bias")]
    for key in norm_biases:
        add_output_bias(hf.get_submodule(key.removesuffix(".bias")), sd[key])
    return hf


@pytest.mark.parametrize("name", NAMES)
def test_end_to_end_logprobs(name: str, float_source: Path) -> None:
    """Measured max |dlogprob| of ascent (fp32) on this machine: vs the integer-pipeline reference (static W8A8:
    fp16, bf16, smooth) 9.5e-7; vs the dequant-formula reference: static W8A8 fp16 0.085, bf16 0.099, smooth 0.071
    (the stored deq_scale is s_x*s_w rounded in the model dtype -- subnormal fp16 for small scales -- and the
    logits of this random model are large), W8A8_DYNAMIC 1.9e-6, W8A16 1.9e-6; vs the float source: W8A8 fp16 0.43,
    bf16 0.46, smooth 0.69 (m4 smoothing does not help a random model without outliers), W8A8_DYNAMIC 0.086,
    W8A16 0.061."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    seqs = prompt_ids(config.vocab_size, seed=11)
    ours = ascent_logprobs(ascent_model(name), seqs)
    d_ref = max_logprob_diff(ours, hf_logprobs(hf_reference_model(name), seqs))
    flt = AutoModelForCausalLM.from_pretrained(str(float_source), dtype=torch.float32).eval()
    d_float = max_logprob_diff(ours, hf_logprobs(flt, seqs))
    msg = f"{name}: max|dlogprob| vs dequant reference {d_ref:.2e}, vs float {d_float:.2e}"
    if name in STATIC:
        d_int = max_logprob_diff(ours, hf_logprobs(hf_reference_model(name, pipeline="integer"), seqs))
        msg += f", vs integer pipeline {d_int:.2e}"
    print(msg)
    if name in STATIC:
        assert d_int <= INTEGER_TOL, (name, d_int)
    assert d_ref <= E2E_TOL[TYPES[name]], (name, d_ref)
    assert d_float <= FLOAT_TOL[name], (name, d_float)


@pytest.mark.parametrize(("name", "quantization"), [("modelslim_w8a8_fp16", "ascend"), ("modelslim_w8a16", None)])
def test_llm_api_prompt_logprobs(name: str, quantization: str | None, tmp_path: Path) -> None:
    """The offline ``LLM`` entry point (explicit ``ascend`` and auto-detected) gives the reference prompt logprobs
    (static W8A8 against its integer pipeline)."""
    config = _hf_config(name)
    prompt = prompt_ids(config.vocab_size, seed=13)["A"]
    ours = llm_prompt_logprobs(FIXTURES / name, tmp_path, prompt, quantization)
    pipeline = "integer" if name in STATIC else "dequant"
    ref = hf_logprobs(hf_reference_model(name, pipeline=pipeline), {"A": prompt})["A"]
    expected = [float(ref[pos - 1, prompt[pos]]) for pos in range(1, len(prompt))]
    tol = INTEGER_TOL if name in STATIC else E2E_TOL[TYPES[name]]
    assert max(abs(a - b) for a, b in zip(ours, expected)) <= tol


def test_smooth_norm_bias_matters() -> None:
    """The anti-outlier fixture is only meaningful if dropping its norm biases changes the output: the reference
    without them must be far from the reference with them (so (c) detects an engine that ignores them)."""
    config = _hf_config("modelslim_w8a8_smooth")
    seqs = prompt_ids(config.vocab_size, seed=11)
    with_bias = hf_logprobs(hf_reference_model("modelslim_w8a8_smooth"), seqs)
    hf = hf_reference_model("modelslim_w8a8_smooth")
    for module in hf.modules():
        module._forward_hooks.clear()  # drop the norm-bias hooks (activation quant pre-hooks stay)
    without = hf_logprobs(hf, seqs)
    assert max_logprob_diff(with_bias, without) > 10 * E2E_TOL["W8A8"]
