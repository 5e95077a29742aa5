"""Golden compressed-tensors checkpoints (made by llmcompressor 0.14, ``tests/fixtures/quant/ct_*``) loaded by ascent.

References, all independent of ascent's quantization code:

* compressed-tensors' own decompression (0.20.1: the compressor registered for the checkpoint's ``format``,
  ``BaseCompressor.decompress(local_state_dict, scheme)``) gives the float weight of every layer, experts included.
  It computes ``q * scale`` in the scale's dtype (bf16/fp16), so it is the exact product rounded once to that dtype;
* the format's dequant formula written out here (int8 / packed int4 LSB-first with +8 offset / FP8 with channel,
  group or block scales) gives the exact float32 weight; the test first checks that it agrees bit-for-bit with
  compressed-tensors after rounding to the scale dtype, then uses it as the fp32 reference;
* activation quantization of the schemes that have it is emulated with forward pre-hooks on the HF linears with
  the serving semantics of vLLM / vLLM Ascend (int8 per token ``amax/127``, int8 static per tensor ``input_scale``,
  FP8 per token / per 128-group ``amax/448``). (compressed-tensors' own fake-quant divides int8 amax by 127.5 --
  a calibration-time convention that serving kernels do not follow.)

Assertions per fixture: (a) ascent's ``dequantized_weight`` of every fused layer equals the reference per shard;
(b) the layer's fast path on random activations matches the reference formula; (c) paged/chunked end-to-end
logprobs of ascent (fp32) match the HF model running the reference weights (+ activation fake-quant), and the
original float model within a looser bound.
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
    ascent_linear_slices,
    ascent_logprobs,
    build_float_source,
    fp8_per_group,
    fp8_per_token,
    hf_logprobs,
    int8_per_token,
    int8_static,
    llm_prompt_logprobs,
    load_ascent,
    max_logprob_diff,
    patch_moe_experts_act_quant,
    prompt_ids,
    rel_err,
    scheme_of,
    set_linear,
)

DENSE = ["ct_w8a8", "ct_w8a8_static", "ct_w4a16_g32", "ct_w4a16_g128", "ct_w4a16_asym", "ct_w4a8",
         "ct_w4a8_channel", "ct_fp8_dynamic", "ct_fp8_block"]
MOE = ["ct_moe_w4a16", "ct_moe_w8a8"]
ALL = DENSE + MOE
# FP8_BLOCK's scheme belongs to the next quantization issue (MX / FP8-block / FlatQuant / LAOS / KV-C8): the config
# must already route it, and loading must fail with the registry's error naming both keys (test below).
LATER_ISSUE = {"ct_fp8_block"}
DENSE_LOADABLE = [n for n in DENSE if n not in LATER_ISSUE]
ALL_LOADABLE = [n for n in ALL if n not in LATER_ISSUE]
# the ModelSlim-named quant type each checkpoint must map to (specs/quantization.md §1.2)
QUANT_TYPES = {"ct_w8a8": "W8A8_DYNAMIC", "ct_w8a8_static": "W8A8", "ct_w4a16_g32": "W4A16", "ct_w4a16_g128": "W4A16",
               "ct_w4a16_asym": "W4A16", "ct_w4a8": "W4A8_DYNAMIC", "ct_w4a8_channel": "W4A8_DYNAMIC",
               "ct_fp8_dynamic": "W8A8FP8_DYNAMIC", "ct_fp8_block": "FP8_BLOCK", "ct_moe_w4a16": "W4A16",
               "ct_moe_w8a8": "W8A8_DYNAMIC"}
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]

# (c) bounds on max |logprob difference| over all prompt positions (measured values in comments).
E2E_TOL = {  # vs the HF model running the reference weights with activation fake-quant
    "weight_only": 1e-4,  # measured <= 1.9e-6
    "act_quant": 1e-2,  # measured <= 1.9e-6, except ct_w4a8_channel 1.7e-3 (one int8 activation LSB flip)
}
FLOAT_TOL = {  # vs the original float model (the quantization error itself); measured value in the comment
    "ct_w8a8": 0.15,  # 0.085
    "ct_w8a8_static": 0.25,  # 0.146
    "ct_fp8_dynamic": 0.45,  # 0.292
    "ct_fp8_block": 0.45,  # reference vs float 0.318
    "ct_w4a16_g32": 1.0,  # 0.644
    "ct_w4a16_g128": 1.3,  # 0.846
    "ct_w4a16_asym": 1.2,  # 0.790
    "ct_w4a8": 1.1,  # 0.736 (the W4A8 preset's group 128 equals per-channel for K=128; down_proj has 2 groups)
    "ct_w4a8_channel": 1.2,  # 0.792
    "ct_moe_w4a16": 0.7,  # reference vs float 0.417
    "ct_moe_w8a8": 0.1,  # reference vs float 0.041
}


# ------------------------------------------------------------------------------------------------------------------
# reading the checkpoint
# ------------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _state(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "model.safetensors"))


@lru_cache(maxsize=None)
def _qconfig(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())["quantization_config"]


def _group(name: str) -> dict:
    groups = _qconfig(name)["config_groups"]
    assert len(groups) == 1, groups
    return next(iter(groups.values()))


def _unpack_int4_lsb_first(packed: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """int32 words holding 8 unsigned nibbles (element i at bits 4i..4i+3) -> signed values (nibble - 8)."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], dim=dim + 1)  # [..., words, 8, ...]
    shape = list(packed.shape)
    shape[dim] = shape[dim] * 8
    vals = nib.reshape(shape) - 8
    return vals.narrow(dim, 0, n)


def _expand_cols(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[N, G] per-group scale -> [N, K] (G == 1: per channel)."""
    return scale.float().repeat_interleave(k // scale.shape[1], dim=1)


def reference_weight(name: str, prefix: str) -> torch.Tensor:
    """Exact float32 weight of ``prefix`` (HF name, e.g. ``model.layers.0.mlp.up_proj``) from the format's formula."""
    sd, fmt, wargs = _state(name), _group(name)["format"], _group(name)["weights"]
    scale = sd[f"{prefix}.weight_scale"]
    if fmt == "pack-quantized":
        n, k = (int(v) for v in sd[f"{prefix}.weight_shape"])
        q = _unpack_int4_lsb_first(sd[f"{prefix}.weight_packed"], k, dim=1).float()
        zp_key = f"{prefix}.weight_zero_point"
        if not wargs["symmetric"]:
            zp = _unpack_int4_lsb_first(sd[zp_key], n, dim=0).float()
            q = q - _expand_cols(zp, k)
        else:
            assert zp_key not in sd
        return q * _expand_cols(scale, k)
    w = sd[f"{prefix}.weight"]
    n, k = w.shape
    if fmt == "int-quantized":
        assert w.dtype == torch.int8
        assert int(w.min()) >= -(2 ** (wargs["num_bits"] - 1)) and int(w.max()) < 2 ** (wargs["num_bits"] - 1)
        return w.float() * _expand_cols(scale, k)
    if fmt == "float-quantized":
        assert w.dtype == torch.float8_e4m3fn
        if wargs["strategy"] == "block":
            bn, bk = wargs["block_structure"]
            assert scale.shape == ((n + bn - 1) // bn, (k + bk - 1) // bk)
            full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            return w.float() * full
        return w.float() * (scale.float().reshape(1, 1) if scale.numel() == 1 else _expand_cols(scale, k))
    raise AssertionError(f"unexpected format {fmt}")


def scale_dtype(name: str, prefix: str) -> torch.dtype:
    return _state(name)[f"{prefix}.weight_scale"].dtype


def act_quant(name: str, prefix: str):
    """The input fake-quantizer of ``prefix`` (None for weight-only schemes)."""
    a = _group(name)["input_activations"]
    if a is None:
        return None
    if a["type"] == "int":
        assert a["num_bits"] == 8 and a["symmetric"]
        if a["strategy"] == "token" and a["dynamic"]:
            return int8_per_token
        if a["strategy"] == "tensor" and not a["dynamic"]:
            return int8_static(float(_state(name)[f"{prefix}.input_scale"].float().item()))
    if a["type"] == "float" and a["dynamic"]:
        if a["strategy"] == "token":
            return fp8_per_token
        if a["strategy"] == "group":
            return fp8_per_group(a["group_size"])
    raise AssertionError(f"unexpected input_activations {a}")


def layer_prefixes(name: str, config) -> list[str]:
    """Every quantized linear of the checkpoint (HF names, experts included)."""
    out = []
    for i in range(config.num_hidden_layers):
        out += [f"model.layers.{i}.{ln}" for ln in LINEARS[:4]]
        if name in MOE:
            for e in range(config.num_experts):
                out += [f"model.layers.{i}.mlp.experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        else:
            out += [f"model.layers.{i}.{ln}" for ln in LINEARS[4:]]
    return out


# ------------------------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------------------------
def _hf_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(FIXTURES / name))


def ct_weight(name: str, prefix: str) -> torch.Tensor:
    """compressed-tensors' own per-module decompression (the compressor registered for the checkpoint's format,
    ``BaseCompressor.decompress(local_state_dict, scheme)``) of the layer ``prefix``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = _group(name)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    local = {k[len(prefix) + 1:]: v for k, v in _state(name).items() if k.startswith(prefix + ".")}
    return compressor.decompress(local, QuantizationScheme(**group))["weight"]


@lru_cache(maxsize=None)
def ascent_model(name: str):
    return load_ascent(FIXTURES / name)


@pytest.fixture(scope="module")
def float_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("ct_float_sources")
    return {moe: build_float_source(root / ("moe" if moe else "dense"), moe=moe) for moe in (False, True)}


# ------------------------------------------------------------------------------------------------------------------
# checkpoint-level checks (no ascent): our formula == compressed-tensors' decompression
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_formula_reference_matches_compressed_tensors(name: str) -> None:
    config = _hf_config(name)
    assert _qconfig(name)["quant_method"] == "compressed-tensors"
    for prefix in layer_prefixes(name, config):
        ours = reference_weight(name, prefix)
        ref = ct_weight(name, prefix)
        dt = scale_dtype(name, prefix)
        assert torch.equal(ours.to(dt), ref.to(dt)), (name, prefix, float((ours - ref.float()).abs().max()))


def test_fixture_formats() -> None:
    """The fixtures exercise the formats they are named after (guards against silently regenerated presets)."""
    expect = {
        "ct_w8a8": ("int-quantized", 8, "channel", None, "token"),
        "ct_w8a8_static": ("int-quantized", 8, "channel", None, "tensor"),
        "ct_w4a16_g32": ("pack-quantized", 4, "group", 32, None),
        "ct_w4a16_g128": ("pack-quantized", 4, "group", 128, None),
        "ct_w4a16_asym": ("pack-quantized", 4, "group", 128, None),
        "ct_w4a8": ("int-quantized", 4, "group", 128, "token"),
        "ct_w4a8_channel": ("int-quantized", 4, "channel", None, "token"),
        "ct_fp8_dynamic": ("float-quantized", 8, "channel", None, "token"),
        "ct_fp8_block": ("float-quantized", 8, "block", None, "group"),
        "ct_moe_w4a16": ("pack-quantized", 4, "group", 32, None),
        "ct_moe_w8a8": ("int-quantized", 8, "channel", None, "token"),
    }
    for name, (fmt, bits, strategy, group, act) in expect.items():
        g = _group(name)
        w, a = g["weights"], g["input_activations"]
        assert (g["format"], w["num_bits"], w["strategy"], w["group_size"]) == (fmt, bits, strategy, group), name
        assert (a["strategy"] if a else None) == act, name
        assert w["symmetric"] == (name != "ct_w4a16_asym"), name
    assert _state("ct_w4a16_asym")["model.layers.0.mlp.down_proj.weight_zero_point"].dtype == torch.int32


# ------------------------------------------------------------------------------------------------------------------
# (a) dequantized weights, (b) layer outputs
# ------------------------------------------------------------------------------------------------------------------
def test_fp8_block_is_routed_to_the_registry() -> None:
    with pytest.raises(NotImplementedError, match=r"quant_type='FP8_BLOCK' for layer_type='linear'"):
        ascent_model("ct_fp8_block")


@pytest.mark.parametrize("name", DENSE_LOADABLE)
def test_dequantized_weights_match(name: str) -> None:
    config = _hf_config(name)
    model = ascent_model(name)
    for i in range(config.num_hidden_layers):
        for hf_name, (layer, rows) in ascent_linear_slices(model, i, config).items():
            prefix = f"model.layers.{i}.{hf_name}"
            scheme = scheme_of(layer)
            assert scheme.spec.quant_type == QUANT_TYPES[name], (prefix, scheme.spec)
            assert scheme.spec.source_format == "compressed-tensors"
            ours = scheme.dequantized_weight(layer)
            assert ours.dtype == torch.float32
            ours = ours[rows]
            ref = reference_weight(name, prefix)
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0, msg=lambda m: f"{name} {prefix}: {m}")
            dt = scale_dtype(name, prefix)
            assert torch.equal(ours.to(dt), ct_weight(name, prefix).to(dt)), (name, prefix)


@pytest.mark.parametrize("name", MOE)
def test_moe_dequantized_weights_match(name: str) -> None:
    from ascent.layers.fused_moe import FusedMoE

    config = _hf_config(name)
    model = ascent_model(name)
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moe_layers) == config.num_hidden_layers
    inter = config.moe_intermediate_size
    for i, layer in enumerate(moe_layers):
        assert scheme_of(layer).spec.quant_type == QUANT_TYPES[name]
        assert scheme_of(layer).spec.layer_type == "moe"
        w13, w2 = scheme_of(layer).dequantized_weights(layer)
        assert w13.shape == (config.num_experts, 2 * inter, config.hidden_size)
        assert w2.shape == (config.num_experts, config.hidden_size, inter)
        for e in range(config.num_experts):
            p = f"model.layers.{i}.mlp.experts.{e}"
            (slot,) = layer.expert_map.local_slots(e)
            for ours, proj in ((w13[slot, :inter], "gate_proj"), (w13[slot, inter:], "up_proj"),
                               (w2[slot], "down_proj")):
                ref = reference_weight(name, f"{p}.{proj}")
                torch.testing.assert_close(ours.float(), ref, rtol=1e-6, atol=0, msg=lambda m: f"{p}.{proj}: {m}")
    # the attention projections of the MoE model are ordinary quantized linears
    for i in range(config.num_hidden_layers):
        for hf_name, (layer, rows) in ascent_linear_slices(model, i, config).items():
            ref = reference_weight(name, f"model.layers.{i}.{hf_name}")
            torch.testing.assert_close(scheme_of(layer).dequantized_weight(layer)[rows], ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", MOE)
def test_moe_expert_outputs_match_reference(name: str) -> None:
    """``apply_experts`` on rows grouped by slot (some slots empty) vs, per expert, ``h = actq(x) @ W13^T``,
    ``a = silu(gate) * up``, ``y = actq(a) @ W2^T`` with the reference weights (tolerances as for linears)."""
    from ascent.layers.fused_moe import FusedMoE

    config = _hf_config(name)
    model = ascent_model(name)
    gen = torch.Generator().manual_seed(3)
    fn = act_quant(name, "model.layers.0.mlp.experts.0.gate_proj") or (lambda t: t)
    tol = 1e-3 if _group(name)["input_activations"] is None else 1e-2
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, FusedMoE)):
        counts = [3, 0, 5, 1][: config.num_experts] + [2] * max(0, config.num_experts - 4)
        slot_of = {e: layer.expert_map.local_slots(e)[0] for e in range(config.num_experts)}
        rows = torch.randn(sum(counts), config.hidden_size, generator=gen)
        group_list = torch.zeros(len(slot_of), dtype=torch.int64)
        expert_rows = {}
        start = 0
        for slot in range(len(slot_of)):
            e = next(ex for ex, sl in slot_of.items() if sl == slot)
            group_list[slot] = counts[e]
            expert_rows[e] = (start, start + counts[e])
            start += counts[e]
        with torch.no_grad():
            y = scheme_of(layer).apply_experts(layer, rows, group_list, "silu")
        assert y.shape == rows.shape
        for e, (a, b) in expert_rows.items():
            if a == b:
                continue
            p = f"model.layers.{i}.mlp.experts.{e}"
            x = fn(rows[a:b])
            gate = x @ reference_weight(name, f"{p}.gate_proj").t()
            up = x @ reference_weight(name, f"{p}.up_proj").t()
            ref = fn(torch.nn.functional.silu(gate) * up) @ reference_weight(name, f"{p}.down_proj").t()
            assert rel_err(y[a:b], ref) <= tol, (name, p, rel_err(y[a:b], ref))


@pytest.mark.parametrize("name", DENSE_LOADABLE)
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_layer_outputs_match_reference(name: str, tokens: int) -> None:
    """Fast path on random activations vs ``actq(x) @ W_ref^T`` per shard. Tolerance (relative to max |y|): 1e-2
    when activations are quantized (a rounding tie or x/s vs x*(1/s) flips one int8 LSB), 1e-3 weight-only (fp32)."""
    config = _hf_config(name)
    model = ascent_model(name)
    gen = torch.Generator().manual_seed(tokens)
    tol = 1e-3 if _group(name)["input_activations"] is None else 1e-2
    worst = 0.0
    for i in range(config.num_hidden_layers):
        fused: dict[int, list[tuple[str, slice]]] = {}
        layers = {}
        for hf_name, (layer, rows) in ascent_linear_slices(model, i, config).items():
            fused.setdefault(id(layer), []).append((hf_name, rows))
            layers[id(layer)] = layer
        for key, shards in fused.items():
            layer = layers[key]
            k = reference_weight(name, f"model.layers.{i}.{shards[0][0]}").shape[1]
            x = torch.randn(tokens, k, generator=gen) * 1.5
            with torch.no_grad():
                y = layer(x)
            assert y.dtype == torch.float32 and y.shape[0] == tokens
            for hf_name, rows in shards:
                prefix = f"model.layers.{i}.{hf_name}"
                fn = act_quant(name, prefix)
                xin = fn(x) if fn is not None else x
                ref = xin @ reference_weight(name, prefix).t()
                err = rel_err(y[:, rows], ref)
                worst = max(worst, err)
                assert err <= tol, (name, prefix, tokens, err)
            # the scheme's own reference path agrees with its fast path
            yr = scheme_of(layer).apply_reference(layer, x, getattr(layer, "bias", None))
            assert rel_err(yr, y) <= tol, (name, i, tokens)


# ------------------------------------------------------------------------------------------------------------------
# (c) end to end
# ------------------------------------------------------------------------------------------------------------------
def hf_reference_model(name: str):
    """HF model built from the fixture's config: unquantized tensors from the checkpoint, every quantized linear /
    expert set to the exact reference weight (validated against compressed-tensors above), activation fake-quant
    hooks where the scheme quantizes activations."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(FIXTURES / name))
    config.quantization_config = None
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    sd = _state(name)
    floats = {k: v.float() for k, v in sd.items() if k.endswith(".weight") and v.is_floating_point()}
    params = dict(hf.named_parameters())
    done = set()
    for k, v in floats.items():
        if k in params:
            with torch.no_grad():
                params[k].copy_(v)
            done.add(k)
    for i in range(config.num_hidden_layers):
        for ln in (LINEARS[:4] if name in MOE else LINEARS):
            prefix = f"model.layers.{i}.{ln}"
            set_linear(hf.get_submodule(prefix), reference_weight(name, prefix))
            done.add(prefix + ".weight")
            fn = act_quant(name, prefix)
            if fn is not None:
                add_input_quant(hf.get_submodule(prefix), fn)
        if name in MOE:
            experts = hf.get_submodule(f"model.layers.{i}.mlp.experts")
            with torch.no_grad():
                for e in range(config.num_experts):
                    p = f"model.layers.{i}.mlp.experts.{e}"
                    experts.gate_up_proj[e].copy_(torch.cat([reference_weight(name, f"{p}.gate_proj"),
                                                             reference_weight(name, f"{p}.up_proj")]))
                    experts.down_proj[e].copy_(reference_weight(name, f"{p}.down_proj"))
            done |= {f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj"}
            fn = act_quant(name, f"model.layers.{i}.mlp.experts.0.gate_proj")
            if fn is not None:
                patch_moe_experts_act_quant(experts, fn)
    assert set(params) == done, sorted(set(params) - done)
    return hf


@pytest.mark.parametrize("name", ALL_LOADABLE)
def test_end_to_end_logprobs(name: str, float_sources: dict[bool, Path]) -> None:
    """Max |dlogprob| of ascent (fp32) vs the reference (E2E_TOL) and vs the float source (FLOAT_TOL); measured
    values next to the bounds."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    seqs = prompt_ids(config.vocab_size, seed=7)
    ours = ascent_logprobs(ascent_model(name), seqs)
    ref = hf_logprobs(hf_reference_model(name), seqs)
    kind = "weight_only" if _group(name)["input_activations"] is None else "act_quant"
    d_ref = max_logprob_diff(ours, ref)
    float_dir = float_sources[name in MOE]
    flt = hf_logprobs(AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval(), seqs)
    d_float = max_logprob_diff(ours, flt)
    print(f"{name}: max|dlogprob| vs reference {d_ref:.2e}, vs float {d_float:.2e}")
    assert d_ref <= E2E_TOL[kind], (name, d_ref)
    assert d_float <= FLOAT_TOL[name], (name, d_float)


@pytest.mark.parametrize(("name", "quantization"), [("ct_w8a8", None), ("ct_w4a16_g32", "compressed-tensors")])
def test_llm_api_prompt_logprobs(name: str, quantization: str | None, tmp_path: Path) -> None:
    """The offline ``LLM`` entry point (auto-detected and explicit ``quantization``) gives the same prompt logprobs
    as the reference model."""
    config = _hf_config(name)
    prompt = prompt_ids(config.vocab_size, seed=13)["A"]
    ours = llm_prompt_logprobs(FIXTURES / name, tmp_path, prompt, quantization)
    ref = hf_logprobs(hf_reference_model(name), {"A": prompt})["A"]
    expected = [float(ref[pos - 1, prompt[pos]]) for pos in range(1, len(prompt))]
    kind = "weight_only" if _group(name)["input_activations"] is None else "act_quant"
    assert max(abs(a - b) for a, b in zip(ours, expected)) <= E2E_TOL[kind]


def test_float_source_is_the_fixtures_origin(float_sources: dict[bool, Path]) -> None:
    """The float model rebuilt from make_fixtures.py is the one the fixtures were quantized from: its unquantized
    tensors equal the checkpoints' (rounded to the checkpoint dtype)."""
    for name in ("ct_w8a8", "ct_fp8_dynamic", "ct_moe_w4a16"):
        src = load_file(str(float_sources[name in MOE] / "model.safetensors"))
        sd = _state(name)
        for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                    "model.layers.1.self_attn.q_norm.weight"):
            assert torch.equal(src[key].to(sd[key].dtype), sd[key]), (name, key)
