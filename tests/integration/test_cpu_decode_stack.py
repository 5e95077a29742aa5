"""The C++ whole-stack decode (``models/decode_stack.py``) gives exactly the module path's tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

from ascent import LLM, SamplingParams
from ascent.models.decode_stack import linear_call
from tests.fixtures.tiny_models import build_model

PROMPTS = ["Hello world! This is", "The quick brown fox", "a", "tiny tokenizer for tests of an inference engine"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)


def _decoder_model(llm: LLM):
    return llm.llm_engine.engine_core.executor.driver_worker.model_runner.model.model


def _engine(model_dir: str, monkeypatch, stack: str, **engine_kwargs) -> LLM:
    monkeypatch.setenv("ASCENT_CPU_DECODE_STACK", stack)
    kwargs = {"dtype": "bfloat16", "max_model_len": 256, "disable_log_stats": True, "seed": 0, **engine_kwargs}
    return LLM(model=model_dir, **kwargs)


def _generate(llm: LLM, prompts: list) -> list:
    """Greedy tokens and top-3 logprobs of each prompt."""
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _run(model_dir: str, monkeypatch, stack: str, prompts: list = PROMPTS, **engine_kwargs):
    llm = _engine(model_dir, monkeypatch, stack, **engine_kwargs)
    result = _generate(llm, prompts) + [_generate(llm, [p])[0] for p in prompts[:2]]
    model = _decoder_model(llm)
    windows = [layer.self_attn.attn.impl.sliding_window for layer in model.layers]
    return result, model._decode_stack, windows


@pytest.mark.parametrize("kind,layer_types", [("llama", None), ("llama", ["sliding_attention", "full_attention"]),
                                              ("qwen3", None), ("qwen2", None)])
def test_stack_equals_module_path(tmp_path, monkeypatch, kind, layer_types):
    extra = {"layer_types": layer_types, "sliding_window": 6} if layer_types else {}
    model_dir = str(build_model(kind, tmp_path / kind, seed=3, **extra))
    fused, stack, windows = _run(model_dir, monkeypatch, "1")
    assert stack is not None and stack._eligible and stack.steps_run > 0  # the stack really served decode steps
    assert windows == ([6, None] if layer_types else [None, None])
    plain, off, _ = _run(model_dir, monkeypatch, "0")
    assert off is not None and not off._eligible and off.steps_run == 0
    assert fused == plain  # tokens and top-3 logprobs bit-identical


@pytest.mark.parametrize("dual_layout_bytes", [None, "0"])
@pytest.mark.parametrize("gemm_layout", ["cpu", "fp32"])
def test_stack_beyond_the_small_m_range_equals_module_path(tmp_path, monkeypatch, dual_layout_bytes, gemm_layout):
    """Batches above the small-M range: unquantized projections make the same per-call choice in both paths (AMX
    tiles or the plain rows kept beside the oneDNN-packed weight, and with those released so only the packed weights
    exist).
    ``fp32``: the GEMM layout of CPUs without native 16-bit GEMM (an fp32 copy), whatever this CPU has."""
    from ascent.layers import cpu_packing
    from ascent.layers.cpu_packing import small_m_max

    if gemm_layout == "fp32":
        monkeypatch.setattr(cpu_packing, "native_16bit_gemm", lambda dtype: False)
    if dual_layout_bytes is not None:
        monkeypatch.setenv("ASCENT_CPU_DUAL_LAYOUT_BYTES", dual_layout_bytes)
    model_dir = str(build_model("llama", tmp_path / "m", seed=7))
    rows = small_m_max(torch.bfloat16) + 1  # decode steps one row beyond the small-M kernel's range
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(rows)]
    fused, stack, _ = _run(model_dir, monkeypatch, "1", prompts, max_num_seqs=rows)
    assert stack.largest_step == len(prompts) > small_m_max(torch.bfloat16)
    layer = stack.model.layers[0].self_attn.qkv_proj
    if layer.panel_weight is not None:  # the small-M kernel's AVX2 path takes every row count, panels if kept
        assert getattr(layer, "packed_weight", None) is None and layer.weight.numel() > 0
        assert (layer.panel_weight.panels is not None) == (dual_layout_bytes is None)
    else:
        second_copy = layer.amx_weight is not None or layer.weight.numel() > 0  # AMX tiles, else the plain rows
        assert second_copy == (dual_layout_bytes is None) and layer.packed_weight is not None
        assert (layer.packed_weight.dtype == torch.float32) == (not cpu_packing.native_16bit_gemm(torch.bfloat16))
    plain, _, _ = _run(model_dir, monkeypatch, "0", prompts, max_num_seqs=rows)
    assert fused == plain


def test_stack_under_preemption_and_prefix_caching(tmp_path, monkeypatch):
    model_dir = str(build_model("llama", tmp_path / "m", seed=4))
    # 4 blocks of 16 tokens for 4 requests of up to 3 blocks each: requests are preempted and recomputed
    kwargs = {"enable_prefix_caching": True, "kv_cache_memory_bytes": 16 * 1024, "block_size": 16, "max_model_len": 48}
    fused, stack, _ = _run(model_dir, monkeypatch, "1", **kwargs)
    assert stack.steps_run > 0
    plain, _, _ = _run(model_dir, monkeypatch, "0", **kwargs)
    assert fused == plain


def test_speculative_verification_through_the_stack_equals_plain_greedy(tmp_path, monkeypatch):
    """bf16: verification rows take the decode kernels, so n-gram speculation reproduces plain greedy exactly."""
    monkeypatch.setenv("ASCENT_CPU_DECODE_STACK", "1")
    model_dir = str(build_model("llama", tmp_path / "m", seed=5))
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]}
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    common = {"dtype": "bfloat16", "max_model_len": 128, "disable_log_stats": True, "seed": 0}
    plain = LLM(model=model_dir, **common).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    spec_llm = LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}, **common)
    spec = spec_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(spec) == list(plain)
    assert _decoder_model(spec_llm)._decode_stack.steps_run > 0


def test_batched_speculative_verification_through_the_stack_equals_module_path(tmp_path, monkeypatch):
    """Verification steps of several requests (k + 1 rows each, above the small-M range) run through the stack with the
    module path's values."""
    model_dir = str(build_model("llama", tmp_path / "m", seed=8))
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 5 + i, 6, 7, 8, 9, 5 + i, 6, 7, 8]} for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    results, stacks = [], []
    for flag in ("1", "0"):
        monkeypatch.setenv("ASCENT_CPU_DECODE_STACK", flag)
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=128, disable_log_stats=True, seed=0,
                  speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in d.items()}
                                                        for d in o.outputs[0].logprobs]) for o in outs])
        stacks.append(_decoder_model(llm)._decode_stack)
    assert stacks[0].largest_step > 4 and stacks[1].steps_run == 0
    assert results[0] == results[1]


@pytest.mark.parametrize("scheme,fmt,amx", [("w8a8_dynamic", "compressed-tensors", "1"), ("w8a16", "modelslim", "1"),
                                            ("w4a16", "compressed-tensors", "1"), ("w8a8", "modelslim", "1"),
                                            ("w8a8", "modelslim", "0"), ("w4a8", "compressed-tensors", "0"),
                                            ("w4a8", "modelslim", "1")])
def test_quantized_stack_equals_module_path(tmp_path, monkeypatch, scheme, fmt, amx):
    """Quantized projections join the stack through their schemes' small-M kernels (within each scheme's own
    small-M range, so the values are the module path's); ``amx`` 0: the kernels of CPUs without AMX-INT8."""
    from ascent.quantization.export.quantize import quantize_model

    monkeypatch.setenv("ASCENT_CPU_AMX", amx)

    float_dir = build_model("llama", tmp_path / "float", seed=6, hidden_size=128, intermediate_size=256,
                            head_dim=32)
    quant_dir = str(tmp_path / scheme)
    quantize_model(str(float_dir), scheme, fmt, quant_dir, group_size=32, calib_tokens=64, dtype="bfloat16")
    fused, stack, _ = _run(quant_dir, monkeypatch, "1")
    assert stack._eligible and stack.steps_run > 0
    plain, _, _ = _run(quant_dir, monkeypatch, "0")
    assert fused == plain


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8_dynamic", "w8a16"])
def test_quantized_stack_beyond_four_rows_equals_module_path(tmp_path, monkeypatch, scheme):
    """Row-interleaved kernels (``quantization/wo_nv.py``, AVX512-VNNI CPUs) serve the stack's steps up to their own
    larger M ranges (17 rows here); elsewhere the stack steps back to the module path above the small-M range."""
    from ascent.quantization.export.quantize import quantize_model

    monkeypatch.setenv("ASCENT_CPU_AMX", "0")
    float_dir = build_model("llama", tmp_path / "float", seed=8, hidden_size=128, intermediate_size=256,
                            head_dim=32)
    quant_dir = str(tmp_path / scheme)
    quantize_model(str(float_dir), scheme, "compressed-tensors", quant_dir, group_size=32, calib_tokens=64,
                   dtype="bfloat16")
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS] + ["one more prompt"]
    fused, stack, _ = _run(quant_dir, monkeypatch, "1", prompts=prompts)
    plain, _, _ = _run(quant_dir, monkeypatch, "0", prompts=prompts)
    assert fused == plain
    from ascent.layers.cpu_kernels import quant_ops

    if "vnni" in quant_ops().isa():
        assert stack.largest_step == len(prompts)  # every decode step of the batch ran in the stack


def test_w4a16_stack_on_amx_tiles_equals_module_path(tmp_path, monkeypatch):
    """On AMX CPUs the W4A16 projections join the stack with their AMX-BF16 tiles above ``WO_AMX_MIN_M`` rows
    (``quantization/wo_amx.py``): a 17-sequence batch runs every decode step in the stack, with the module path's
    values."""
    from ascent.layers.cpu_kernels import amx_ops
    from ascent.quantization import kernels
    from ascent.quantization.export.quantize import quantize_model

    monkeypatch.setenv("ASCENT_CPU_AMX", "1")
    float_dir = build_model("llama", tmp_path / "float", seed=9, hidden_size=128, intermediate_size=256,
                            head_dim=32)
    quant_dir = str(tmp_path / "w4a16")
    quantize_model(str(float_dir), "w4a16", "compressed-tensors", quant_dir, group_size=32, calib_tokens=64,
                   dtype="bfloat16")
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS] + ["one more prompt"]
    fused, stack, _ = _run(quant_dir, monkeypatch, "1", prompts=prompts)
    plain, _, _ = _run(quant_dir, monkeypatch, "0", prompts=prompts)
    assert fused == plain
    kinds = {linear_call(layer.self_attn.qkv_proj)[0] for layer in stack.model.layers}
    if amx_ops() is not None:
        assert kinds == {kernels.STACK_KIND_WO_AMX}
        assert stack.largest_step == len(prompts)  # every decode step of the batch ran in the stack


@pytest.fixture
def two_threads():
    """torch at 2 threads for the test (an earlier test may have left it at 1), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_team_steps_equal_forked_steps_and_survive_a_failing_step(tmp_path, monkeypatch, two_threads):
    """Decode steps run as one team of torch's threads (``cpu_kernels/parallel_team.h``) give the values of the same
    steps with a fork and join per loop (``set_team_rows(0)``); an error raised inside a team step reaches Python
    as an exception (no hang) and the next steps run normally."""
    llm = _engine(str(build_model("llama", tmp_path / "m", seed=11)), monkeypatch, "1")
    team = _generate(llm, PROMPTS)
    stack = _decoder_model(llm)._decode_stack
    cpp = stack._stack
    assert stack.steps_run > 0 and torch.get_num_threads() == 2
    # teams up to 64 rows, fewer where a dense projection's AMX / small-M range ends (this CPU's kernels decide)
    projections = [p for layer in stack.model.layers
                   for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)]
    assert cpp.team_rows() == min([64] + [max(linear_call(p)[2]) for p in projections])
    assert cpp.team_rows() >= len(PROMPTS)  # so the decode steps above ran as teams
    hidden = torch.zeros(1, stack.model.embed_tokens.weight.shape[1], dtype=torch.bfloat16)
    bad_rows = torch.zeros(1, 2 * stack.model.rotary_emb.rotary_dim, dtype=torch.float32)  # not bf16: rotary fails
    slots = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError):
        cpp.forward(hidden, bad_rows, slots, slots.view(1, 1), slots + 1)
    assert _generate(llm, PROMPTS) == team
    cpp.set_team_rows(0)
    assert cpp.team_rows() == 0
    assert _generate(llm, PROMPTS) == team
